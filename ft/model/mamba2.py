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

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ft.model.recurrent import StateSpan
from ft.model.ssd import ChunkPlan, ScanInput, plan_chunks, ssd_chunked, ssd_step

# The scan's cost per token grows with the chunk (its diagonal blocks are chunk x chunk), and a
# short prompt's padding to a whole chunk is wasted work; shorter chunks mean more, smaller
# products. 64 was the fastest on a CPU core for 512- and 20-token prompts (of 32-256) with
# Granite 4.0-H tiny's shapes; checkpoints ask for 256, the size their GPU kernels were tuned for.
MAX_CHUNK_SIZE = 64


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
        if num_heads < 1:
            raise ValueError(f"mamba2: mamba_n_heads must be positive, got {num_heads}")
        inner = int(cfg.get("mamba_expand", 2)) * hidden
        head_dim = cfg.get("mamba_d_head", "auto")
        head_dim = inner // num_heads if head_dim == "auto" else int(head_dim)
        if head_dim * num_heads != inner:
            raise ValueError(
                f"mamba2: {num_heads} heads of {head_dim} do not make mamba_expand * hidden ({inner})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"mamba2: the convolution's activation must be silu, got {cfg['hidden_act']!r}")
        limit = cfg.get("time_step_limit") or (0.0, math.inf)
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ValueError(f"mamba2: time_step_limit {limit!r:.40} is not a (low, high) pair")
        low, high = (_json_float(v) for v in limit)
        return cls(
            hidden_size=hidden,
            num_heads=num_heads,
            head_dim=head_dim,
            state_size=int(cfg.get("mamba_d_state", 256)),
            num_groups=int(cfg.get("mamba_n_groups", 1)),
            conv_kernel=int(cfg.get("mamba_d_conv", 4)),
            chunk_size=min(int(cfg.get("mamba_chunk_size", 256)), MAX_CHUNK_SIZE),
            time_step_min=low,
            time_step_max=high,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        )


def _json_float(value: Any) -> float:
    """A number from `config.json`: JSON's own, Python's `Infinity`, or transformers 5's
    `{"__float__": "Infinity"}` for a value JSON cannot write.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"mamba2: time_step_limit holds {value!r:.40}, not a number")
    return float(value)


def mamba2_weights_from_hf(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A transformers Mamba-2 layer's weights under `prefix` (Granite 4.0-H:
    `model.layers.{i}.mamba.`) as `Mamba2Mixer`'s state dict.

    A is stored as `-exp(A_log)` in float32, the value transformers computes each forward (and
    the one llama.cpp's GGUFs store as `ssm_a`).

    Raises:
        KeyError: a required weight is missing.
        ValueError: an `A_log` whose exp is not a float32 (A = -inf: every state NaN).
    """
    A = -torch.exp(tensors[prefix + "A_log"].float())
    if not torch.isfinite(A).all():
        raise ValueError(f"mamba2: {prefix}A_log holds values whose exp overflows float32 (or NaN)")
    out = {
        "in_proj.weight": tensors[prefix + "in_proj.weight"],
        "conv_weight": tensors[prefix + "conv1d.weight"].squeeze(1),  # [conv_dim, 1, k] -> [conv_dim, k]
        "dt_bias": tensors[prefix + "dt_bias"],
        "A": A,
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


class StepIndex(NamedTuple):
    """Where a step's spans sit; the same for every Mamba-2 layer of the step (`step_index`).

    Rows are taken span after span (`rows`: their batch rows, `R` in all). The convolution reads a
    buffer of every span's k-1 past inputs followed by the spans' rows: `taps[j]` is the buffer
    row of tap j for each row, `tail` each span's last k-1 inputs (its next conv state). Decode
    spans (one row) and prefill spans are scanned apart; `fresh_*` are positions within each
    group, and `place[i]` says where span i's final states are (prefill?, position)."""

    rows: torch.Tensor  # [R] int64
    in_order: bool  # rows == arange(T)
    slots: torch.Tensor  # [S]
    fresh: torch.Tensor  # span ids, [<= S]
    taps: torch.Tensor  # [k, R] into the conv buffer
    tail: torch.Tensor  # [S, k-1] into the conv buffer
    decode_rows: torch.Tensor  # [Sd] span-order row of each decode span
    decode_slots: torch.Tensor  # [Sd]
    decode_fresh: torch.Tensor  # positions in the decode group
    prefill_slots: torch.Tensor  # [Sp]
    prefill_fresh: torch.Tensor  # positions in the prefill group
    plan: ChunkPlan | None
    place: tuple[tuple[bool, int], ...]


@functools.lru_cache(maxsize=8)
def step_index(
    spans: tuple[StateSpan, ...], num_rows: int, conv_kernel: int, chunk_size: int, device: torch.device
) -> StepIndex:
    """The `StepIndex` of `spans` over a batch of `num_rows` rows. Cached: the layers of a step
    (and steady decode steps, whose spans repeat) share one.

    Raises:
        ValueError: a span without rows, or past the batch.
    """
    for s in spans:
        if s.num_rows < 1 or s.row_start < 0 or s.row_start + s.num_rows > num_rows:
            raise ValueError(f"mamba2: span {s} does not fit a batch of {num_rows} rows")

    def longs(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    k = conv_kernel
    num_spans = len(spans)
    starts, lengths = longs([s.row_start for s in spans]), longs([s.num_rows for s in spans])
    span = torch.repeat_interleave(torch.arange(num_spans, device=device), lengths)  # [R]
    first = torch.cumsum(lengths, 0) - lengths  # each span's first row, in span order
    offset = torch.arange(len(span), device=device) - first[span]
    rows = starts[span] + offset

    def at(owner: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        # The buffer row of `time` (from the span's first row; -(k-1) is its oldest past input).
        return torch.where(
            time >= 0, num_spans * (k - 1) + first[owner] + time, owner * (k - 1) + (k - 1) + time
        )

    taps = torch.stack([at(span, offset - (k - 1) + j) for j in range(k)])
    tail_time = lengths[:, None] - (k - 1) + torch.arange(k - 1, device=device)  # [S, k-1]
    tail = at(torch.arange(num_spans, device=device)[:, None].expand_as(tail_time), tail_time)

    decode = [i for i, s in enumerate(spans) if s.num_rows == 1]
    prefill = [i for i, s in enumerate(spans) if s.num_rows > 1]
    first_rows = [0, *itertools.accumulate(s.num_rows for s in spans)]
    place = [(False, 0)] * num_spans
    for j, i in enumerate(decode):
        place[i] = (False, j)
    for j, i in enumerate(prefill):
        place[i] = (True, j)
    plan = None
    if prefill:
        plan = plan_chunks(
            [first_rows[i] for i in prefill],
            [spans[i].num_rows for i in prefill],
            len(span),
            chunk_size,
            device,
        )
    return StepIndex(
        rows=rows,
        in_order=[s.row_start for s in spans] == first_rows[:-1] and first_rows[-1] == num_rows,
        slots=longs([s.slot for s in spans]),
        fresh=longs([i for i, s in enumerate(spans) if s.fresh]),
        taps=taps,
        tail=tail,
        decode_rows=longs([first_rows[i] for i in decode]),
        decode_slots=longs([spans[i].slot for i in decode]),
        decode_fresh=longs([j for j, i in enumerate(decode) if spans[i].fresh]),
        prefill_slots=longs([spans[i].slot for i in prefill]),
        prefill_fresh=longs([j for j, i in enumerate(prefill) if spans[i].fresh]),
        plan=plan,
        place=tuple(place),
    )


def _read_states(slot_states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """A copy of `slot_states[slots]` in float32, zero at the positions `fresh` (whatever the
    slot held there, NaN included)."""
    states = slot_states[slots].float()
    if len(fresh):
        states.index_fill_(0, fresh, 0.0)
    return states


class Mamba2Mixer(nn.Module):
    """Mamba-2's mixer over a step's spans (`RecurrentMixer`); its states per sequence are
    `(conv [k-1, conv_dim], ssm [heads, head_dim, d_state])`, float32. Its small parameters stay
    float32 whatever the model's dtype (`float32_parameters`, read by `llama.assemble_model`):
    the decays compound over every step of a sequence, and all of them together are a few
    numbers per channel."""

    float32_parameters = ("conv_weight", "conv_bias", "dt_bias", "A", "D", "norm_weight")

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
        index = step_index(tuple(spans), x.shape[0], c.conv_kernel, c.chunk_size, x.device)
        conv_slots, ssm_slots = states

        projected = self.in_proj(x)
        gate, xbc, dt = projected.split([c.inner_size, c.conv_dim, c.num_heads], dim=-1)
        if not index.in_order:
            xbc, dt = xbc[index.rows], dt[index.rows]
        conv_out, conv_states = self._convolve(xbc.float(), index, conv_slots)
        xs, B, C = conv_out.split(
            [c.inner_size, c.num_groups * c.state_size, c.num_groups * c.state_size], -1
        )
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(c.time_step_min, c.time_step_max)
        num_rows = len(index.rows)
        inp = ScanInput(
            xs.reshape(num_rows, c.num_heads, c.head_dim),
            dt,
            B.reshape(num_rows, c.num_groups, c.state_size),
            C.reshape(num_rows, c.num_groups, c.state_size),
        )
        y, decode_states, prefill_states = self._scan(inp, index, ssm_slots)

        y = y.reshape(num_rows, c.inner_size)
        if not index.in_order:
            y = y.new_zeros(x.shape[0], c.inner_size).index_copy_(0, index.rows, y)
        out = self.out_proj(self._gated_norm(y, gate).to(x.dtype))
        new_states: list[tuple[torch.Tensor, ...]] = []
        for i, (is_prefill, j) in enumerate(index.place):
            new_states.append((conv_states[i], (prefill_states if is_prefill else decode_states)[j]))
        return out, new_states

    def _convolve(
        self, xbc: torch.Tensor, index: StepIndex, conv_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal convolution of every span's rows `[R, conv_dim]` over its own past, then
        silu; and each span's new conv state `[S, k-1, conv_dim]`."""
        k = self.config.conv_kernel
        past = _read_states(conv_slots, index.slots, index.fresh)  # [S, k-1, conv_dim]
        buffer = torch.cat([past.reshape(-1, xbc.shape[1]), xbc])
        weight = self.conv_weight.float()
        out = buffer[index.taps[0]] * weight[:, 0]
        for j in range(1, k):
            out = out.addcmul_(buffer[index.taps[j]], weight[:, j])
        if self.conv_bias is not None:
            out = out + self.conv_bias.float()
        return F.silu(out), buffer[index.tail]

    def _scan(
        self, inp: ScanInput, index: StepIndex, ssm_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The spans' scans: decode spans in one recurrent step, the others chunked together.
        Returns y `[R, heads, head_dim]` and the final states of the decode and of the prefill
        spans, `[Sd | Sp, heads, head_dim, d_state]`."""
        A, D = self.A.float(), self.D.float()
        y = torch.zeros_like(inp.x)
        prefill_states = decode_states = inp.x.new_empty(0)
        if index.plan is not None:
            initial = _read_states(ssm_slots, index.prefill_slots, index.prefill_fresh)
            y, prefill_states = ssd_chunked(inp, A, D, initial, index.plan)
        if len(index.decode_rows):
            rows = index.decode_rows
            initial = _read_states(ssm_slots, index.decode_slots, index.decode_fresh)
            step_in = ScanInput(inp.x[rows], inp.dt[rows], inp.B[rows], inp.C[rows])
            y[rows], decode_states = ssd_step(step_in, A, D, initial)
        return y, decode_states, prefill_states

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm of `y * silu(gate)` over each group of `inner / num_groups` channels."""
        c = self.config
        h = y * F.silu(gate.float())
        grouped = h.view(h.shape[0], c.num_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        return self.norm_weight.float() * grouped.view_as(h)
