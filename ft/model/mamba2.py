"""Mamba-2's mixer (Granite 4.0-H's `mamba` layers), a `RecurrentMixer` over many sequences.

    in_proj → gate z | xBC | dt
    xBC → causal depthwise conv (kernel k, over each sequence's own past) → silu → x, B, C
    dt → softplus(dt + dt_bias), clamped to time_step_limit
    y = SSD scan of (x, dt, A = -exp(A_log), B, C) + D * x          (`ft.model.ssd`)
    out_proj(RMSNorm_by_group(y * silu(z)) * norm_weight)

A sequence's state is its convolution's last k-1 inputs, `[k-1, conv_dim]` (time-major, the
rows as they came; transformers and vLLM keep `[conv_dim, k]`), and the SSM state
`[heads, head_dim, d_state]` (transformers' layout). Everything from the convolution to the norm
runs in float32, whatever the activations' dtype; only the two projections run in it.

Prefill spans (more than one row) go through the chunked scan together, decode spans (one row)
through one batched recurrent step. Both read the slots only for spans that are not `fresh`,
so whatever a reused slot still holds never reaches a new sequence.

NOTE: transformers clamps dt to `time_step_limit` only in its chunked scan, not in its decode
step (nor does mamba_ssm's step kernel); this mixer clamps in both, so a sequence's result does
not depend on where its steps split it. Granite 4.0-H's limit is (0, inf): nothing differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ft.model.recurrent import StateSpan
from ft.model.ssd import ScanInput, plan_chunks, ssd_chunked, ssd_step

# The scan's cost per token grows with the chunk (its diagonal blocks are chunk x chunk), and a
# chunk's padding is wasted work; past this size longer chunks only save loop steps.
MAX_CHUNK_SIZE = 128


@dataclass(frozen=True, slots=True)
class Mamba2Config:
    """Shapes and constants of one Mamba-2 mixer."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int  # d_state
    num_groups: int  # B and C are shared by num_heads // num_groups heads
    conv_kernel: int
    chunk_size: int
    time_step_min: float = 0.0
    time_step_max: float = math.inf
    norm_eps: float = 1e-6
    conv_bias: bool = True
    proj_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "state_size", "num_groups", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"mamba2: {name} must be positive, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise ValueError(f"mamba2: conv_kernel must be at least 2, got {self.conv_kernel}")
        if self.num_heads % self.num_groups:
            raise ValueError(
                f"mamba2: num_groups ({self.num_groups}) must divide num_heads ({self.num_heads})"
            )
        if not 0.0 <= self.time_step_min <= self.time_step_max:
            raise ValueError(f"mamba2: bad time_step_limit ({self.time_step_min}, {self.time_step_max})")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Mamba2Config:
        """From a Granite 4.0-H (`granitemoehybrid`) `config.json` dict, transformers' defaults
        for absent keys.

        Raises:
            ValueError: inconsistent shapes, or an activation other than silu.
        """
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg.get("mamba_n_heads", 128))
        inner = int(cfg.get("mamba_expand", 2)) * hidden
        head_dim = cfg.get("mamba_d_head", "auto")
        head_dim = inner // num_heads if head_dim == "auto" else int(head_dim)
        if head_dim * num_heads != inner:
            raise ValueError(
                f"mamba2: {num_heads} heads of {head_dim} do not make mamba_expand * hidden ({inner})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"mamba2: the convolution's activation must be silu, got {cfg['hidden_act']!r}")
        low, high = cfg.get("time_step_limit") or (0.0, math.inf)
        return cls(
            hidden_size=hidden,
            num_heads=num_heads,
            head_dim=head_dim,
            state_size=int(cfg.get("mamba_d_state", 256)),
            num_groups=int(cfg.get("mamba_n_groups", 1)),
            conv_kernel=int(cfg.get("mamba_d_conv", 4)),
            chunk_size=min(int(cfg.get("mamba_chunk_size", 256)), MAX_CHUNK_SIZE),
            time_step_min=float(low),
            time_step_max=float(high),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        )


def mamba2_weights_from_hf(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A transformers Mamba-2 layer's weights under `prefix` (Granite 4.0-H:
    `model.layers.{i}.mamba.`) as `Mamba2Mixer`'s state dict.

    A is stored as `-exp(A_log)` in float32, the value transformers computes each forward (and
    the one llama.cpp's GGUFs store as `ssm_a`).

    Raises:
        KeyError: a required weight is missing.
    """
    out = {
        "in_proj.weight": tensors[prefix + "in_proj.weight"],
        "conv_weight": tensors[prefix + "conv1d.weight"].squeeze(1),  # [conv_dim, 1, k] -> [conv_dim, k]
        "dt_bias": tensors[prefix + "dt_bias"],
        "A": -torch.exp(tensors[prefix + "A_log"].float()),
        "D": tensors[prefix + "D"],
        "norm_weight": tensors[prefix + "norm.weight"],
        "out_proj.weight": tensors[prefix + "out_proj.weight"],
    }
    for ours, theirs in (
        ("conv_bias", "conv1d.bias"),
        ("in_proj.bias", "in_proj.bias"),
        ("out_proj.bias", "out_proj.bias"),
    ):
        if prefix + theirs in tensors:
            out[ours] = tensors[prefix + theirs]
    return out


class Mamba2Mixer(nn.Module):
    """Mamba-2's mixer over a step's spans (`RecurrentMixer`); its states per sequence are
    `(conv [k-1, conv_dim], ssm [heads, head_dim, d_state])`, float32."""

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        c = config
        self.config = c
        self.in_proj = nn.Linear(c.hidden_size, c.inner_size + c.conv_dim + c.num_heads, bias=c.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(c.conv_dim, c.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(c.conv_dim)) if c.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(c.num_heads))
        self.A = nn.Parameter(torch.empty(c.num_heads))  # -exp(A_log)
        self.D = nn.Parameter(torch.empty(c.num_heads))
        self.norm_weight = nn.Parameter(torch.empty(c.inner_size))
        self.out_proj = nn.Linear(c.inner_size, c.hidden_size, bias=c.proj_bias)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The conv state `[k-1, conv_dim]` and the SSM state `[heads, head_dim, d_state]`."""
        c = self.config
        return ((c.conv_kernel - 1, c.conv_dim), (c.num_heads, c.head_dim, c.state_size))

    def forward(
        self, x: torch.Tensor, spans: Sequence[StateSpan], states: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """`x` `[T, hidden]` → `[T, hidden]` and each span's `(conv, ssm)` states after its last
        row. `states`: the slot tensors `[slots, k-1, conv_dim]`, `[slots, heads, head_dim,
        d_state]`, read only. Rows outside every span come out as the projections of zero."""
        c = self.config
        device = x.device
        conv_slots, ssm_slots = states
        slots = torch.tensor([s.slot for s in spans], dtype=torch.long, device=device)
        fresh = torch.tensor([s.fresh for s in spans], dtype=torch.bool, device=device)
        starts = torch.tensor([s.row_start for s in spans], dtype=torch.long, device=device)
        lengths = torch.tensor([s.num_rows for s in spans], dtype=torch.long, device=device)

        projected = self.in_proj(x)
        gate, xbc, dt = projected.split([c.inner_size, c.conv_dim, c.num_heads], dim=-1)
        rows, xbc, conv_out = self._convolve(xbc.float(), slots, fresh, starts, lengths, conv_slots)
        xs, B, C = xbc.split([c.inner_size, c.num_groups * c.state_size, c.num_groups * c.state_size], -1)
        dt = F.softplus(dt[rows].float() + self.dt_bias.float())
        dt = dt.clamp(c.time_step_min, c.time_step_max)
        num_rows = len(rows)
        inp = ScanInput(
            xs.reshape(num_rows, c.num_heads, c.head_dim),
            dt,
            B.reshape(num_rows, c.num_groups, c.state_size),
            C.reshape(num_rows, c.num_groups, c.state_size),
        )
        y, ssm_out = self._scan(inp, spans, slots, fresh, lengths, ssm_slots)

        full = y.new_zeros(x.shape[0], c.inner_size)
        full[rows] = y.reshape(num_rows, c.inner_size)
        out = self.out_proj(self._gated_norm(full, gate).to(x.dtype))
        return out, [(conv_out[i], ssm_out[i]) for i in range(len(spans))]

    def _convolve(
        self,
        xbc: torch.Tensor,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        conv_slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The causal convolution of every span's rows over its own past, then silu.

        Returns the spans' rows of the batch in span order `[R]`, their outputs `[R, conv_dim]`,
        and each span's new conv state `[S, k-1, conv_dim]`.
        """
        k = self.config.conv_kernel
        num_spans = len(slots)
        past = conv_slots[slots].float()  # [S, k-1, conv_dim], a copy
        past = torch.where(fresh[:, None, None], 0.0, past)
        # One buffer holds every span's past rows, then the batch's rows: tap j of a row at
        # offset i of span s reads time i - (k-1) + j, which is either in the batch or in s's past.
        buffer = torch.cat([past.reshape(num_spans * (k - 1), -1), xbc])
        device = xbc.device
        span = torch.repeat_interleave(torch.arange(num_spans, device=device), lengths)  # [R]
        offset = torch.arange(len(span), device=device) - (torch.cumsum(lengths, 0) - lengths)[span]
        rows = starts[span] + offset

        def at(owner: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
            # Buffer index of `time` (relative to the span's first row, from -(k-1)) of a span.
            return torch.where(
                time >= 0, num_spans * (k - 1) + starts[owner] + time, owner * (k - 1) + (k - 1) + time
            )

        weight = self.conv_weight.float()
        out = buffer[at(span, offset - (k - 1))] * weight[:, 0]
        for j in range(1, k):
            out = out + buffer[at(span, offset - (k - 1) + j)] * weight[:, j]
        if self.conv_bias is not None:
            out = out + self.conv_bias.float()
        tail = lengths[:, None] - (k - 1) + torch.arange(k - 1, device=device)  # [S, k-1]
        owners = torch.arange(num_spans, device=device)[:, None].expand_as(tail)
        return rows, F.silu(out), buffer[at(owners, tail)]

    def _scan(
        self,
        inp: ScanInput,
        spans: Sequence[StateSpan],
        slots: torch.Tensor,
        fresh: torch.Tensor,
        lengths: torch.Tensor,
        ssm_slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The spans' scans: decode spans in one recurrent step, the others chunked together.
        Returns y `[R, heads, head_dim]` and each span's final state `[S, heads, head_dim, d_state]`."""
        device = inp.x.device
        A, D = self.A.float(), self.D.float()
        initial = ssm_slots[slots].float()  # [S, H, P, N], a copy
        initial = torch.where(fresh[:, None, None, None], 0.0, initial)
        first_row = torch.cumsum(lengths, 0) - lengths  # each span's first row in span order
        is_decode = torch.tensor([s.num_rows == 1 for s in spans], dtype=torch.bool, device=device)
        decode = torch.nonzero(is_decode).flatten()
        prefill = torch.nonzero(~is_decode).flatten()

        y = torch.zeros_like(inp.x)
        final = torch.empty_like(initial)
        if len(prefill):
            plan = plan_chunks(first_row[prefill], lengths[prefill], len(inp.x), self.config.chunk_size)
            y, final[prefill] = ssd_chunked(inp, A, D, initial[prefill], plan)
        if len(decode):
            rows = first_row[decode]
            step_in = ScanInput(inp.x[rows], inp.dt[rows], inp.B[rows], inp.C[rows])
            y[rows], final[decode] = ssd_step(step_in, A, D, initial[decode])
        return y, final

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm of `y * silu(gate)` over each group of `inner / num_groups` channels."""
        c = self.config
        h = y * F.silu(gate.float())
        grouped = h.view(h.shape[0], c.num_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        return self.norm_weight.float() * grouped.view_as(h)
