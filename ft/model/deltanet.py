"""Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as a recurrent mixer.

One layer: a fused input projection gives the conv channels (q | k | v), the output gate z and
the per-value-head b and a; a causal depthwise conv (kernel 4) with SiLU over the conv channels;
l2-normalized q and k; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta
rule (`ft.model.delta_rule`); an RMSNorm of each head's output gated by silu(z); `out_proj`.
Value heads may outnumber key heads: value head h reads key head h // (num_v_heads // num_k_heads)
(transformers' `repeat_interleave`).

A sequence's state is two tensors (`state_shapes`): its conv channels' last `conv_kernel - 1`
inputs `[conv_kernel - 1, conv_dim]` (oldest first; transformers keeps `[conv_dim, conv_kernel]`,
one input more than the next token needs) and the recurrent matrices `[num_v_heads, head_k_dim,
head_v_dim]` (transformers' order). Everything after the input projection is float32.

Weights: Qwen3.5 stores the projections apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`), Qwen3-Next fused and grouped by key head (`in_proj_qkvz`, `in_proj_ba`);
`hf_weights` maps either onto this module's one `in_proj`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ft.model.delta_rule import CHUNK_SIZE, chunk_rule, l2norm, recurrent_step
from ft.model.recurrent import StateSpan


@dataclass(frozen=True, slots=True)
class DeltaNetConfig:
    """The shapes of one Gated DeltaNet layer."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    chunk_size: int = CHUNK_SIZE

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if min(sizes) < 1 or self.conv_kernel < 2 or self.chunk_size < 1:
            raise ValueError(f"Gated DeltaNet shapes {self}: expected positive sizes, a kernel of 2 or more")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"{self.num_v_heads} value heads over {self.num_k_heads} key heads: "
                "expected a multiple of the key heads"
            )

    @property
    def key_dim(self) -> int:
        """Width of q (and of k): all key heads."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """Width of v (and of z and of the output before `out_proj`)."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_size(self) -> int:
        """Width of the fused input projection: q | k | v | z | b | a."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> DeltaNetConfig:
        """From a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next `config.json` (or its `text_config`).

        Raises:
            ValueError: a field is missing, or the conv's activation is not SiLU.
        """
        cfg = cfg.get("text_config") or cfg
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet with activation {act!r}: only silu is supported")
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                num_k_heads=int(cfg["linear_num_key_heads"]),
                num_v_heads=int(cfg["linear_num_value_heads"]),
                head_k_dim=int(cfg["linear_key_head_dim"]),
                head_v_dim=int(cfg["linear_value_head_dim"]),
                conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            )
        except KeyError as e:
            raise ValueError(f"Gated DeltaNet config without {e.args[0]!r}") from None


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer's mixer (`ft.model.recurrent.RecurrentMixer`).

    Decode rows (spans of one row) of every sequence run as one batched recurrent step over
    their gathered states; each longer span runs the chunked rule on its own: a step has few
    prefill spans, and batching them did not pay even at equal lengths (four spans of 128 rows
    at Qwen3.5-9B's heads: 105 ms one at a time, 122 ms padded into one batch, on one core).
    The conv is K shifted multiply-adds (a third of `F.conv1d`'s time there). Its small
    parameters stay float32 whatever the model's dtype (`float32_parameters`, read by
    `llama.assemble_model`): everything after the input projection runs in float32 anyway.
    """

    float32_parameters = ("conv_weight", "A_log", "dt_bias", "norm_weight")

    def __init__(self, config: DeltaNetConfig) -> None:
        super().__init__()
        c = self.config = config
        self.in_proj = nn.Linear(c.hidden_size, c.in_proj_size, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(c.conv_kernel, c.conv_dim))  # [K, conv_dim]
        self.A_log = nn.Parameter(torch.empty(c.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(c.num_v_heads))
        self.norm_weight = nn.Parameter(torch.empty(c.head_v_dim))
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The conv inputs `[conv_kernel - 1, conv_dim]` and the matrices `[v_heads, dk, dv]`."""
        c = self.config
        return (c.conv_kernel - 1, c.conv_dim), (c.num_v_heads, c.head_k_dim, c.head_v_dim)

    def forward(
        self, x: torch.Tensor, spans: Sequence[StateSpan], states: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """`x` `[T, hidden]` → (`[T, hidden]`, each span's (conv, recurrent) state after it)."""
        c = self.config
        conv_states, matrices = states  # [S, K-1, conv_dim], [S, Hv, dk, dv]
        proj = self.in_proj(x)  # [T, in_proj_size]
        mixed, z, b, a = proj.float().split([c.conv_dim, c.value_dim, c.num_v_heads, c.num_v_heads], dim=-1)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())  # [T, Hv]
        weight = self.conv_weight.float()  # [K, conv_dim]
        core = mixed.new_empty(x.shape[0], c.num_v_heads, c.head_v_dim)  # [T, Hv, dv]
        new_states: list[tuple[torch.Tensor, ...]] = [()] * len(spans)

        decodes = [i for i, s in enumerate(spans) if s.num_rows == 1]
        if decodes:
            rows = torch.tensor([spans[i].row_start for i in decodes], device=x.device)
            slots = torch.tensor([spans[i].slot for i in decodes], device=x.device)
            conv_in = conv_states.index_select(0, slots)  # [B, K-1, conv_dim], a copy
            state = matrices.index_select(0, slots)  # [B, Hv, dk, dv], a copy
            fresh = [j for j, i in enumerate(decodes) if spans[i].fresh]
            if fresh:
                conv_in[fresh] = 0
                state[fresh] = 0
            window = torch.cat((conv_in, mixed[rows][:, None]), dim=1)  # [B, K, conv_dim]
            conv_out = F.silu((window * weight).sum(1))  # [B, conv_dim]
            q, k, v = self._heads(conv_out)
            core[rows] = recurrent_step(q, k, v, g[rows], beta[rows], state)  # state updated
            for j, i in enumerate(decodes):
                new_states[i] = (window[j, 1:], state[j])

        for i, span in enumerate(spans):
            if span.num_rows == 1:
                continue
            r = slice(span.row_start, span.row_start + span.num_rows)
            conv_in = conv_states[span.slot]  # [K-1, conv_dim]
            state = matrices[span.slot][None]
            if span.fresh:
                conv_in, state = torch.zeros_like(conv_in), torch.zeros_like(state)
            window = torch.cat((conv_in, mixed[r]))  # [K-1 + n, conv_dim]
            conv_out = F.silu(_causal_conv(window, weight))  # [n, conv_dim]
            q, k, v = self._heads(conv_out)
            out, state = chunk_rule(
                q[None], k[None], v[None], g[r][None], beta[r][None], state, chunk_size=c.chunk_size
            )
            core[r] = out[0]
            new_states[i] = (window[-(c.conv_kernel - 1) :], state[0])

        out = _gated_rms_norm(core, z.view_as(core), self.norm_weight.float(), c.rms_norm_eps)
        return self.out_proj(out.reshape(x.shape[0], c.value_dim).to(x.dtype)), new_states

    def _heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output `[n, conv_dim]` → q, k `[n, Hv, dk]` (normalized, key heads repeated
        for their value heads, q scaled) and v `[n, Hv, dv]`."""
        c = self.config
        n = conv_out.shape[0]
        q, k, v = conv_out.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = l2norm(q.view(n, c.num_k_heads, c.head_k_dim)) * c.head_k_dim**-0.5
        k = l2norm(k.view(n, c.num_k_heads, c.head_k_dim))
        group = c.num_v_heads // c.num_k_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return q, k, v.view(n, c.num_v_heads, c.head_v_dim)


def _causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of `window` `[K-1 + n, C]` (the K-1 inputs before the span, then its
    n) with `weight` `[K, C]` → `[n, C]`: row t is sum_j weight[j] * window[t + j]."""
    kernel = weight.shape[0]
    n = window.shape[0] - kernel + 1
    out = window[:n] * weight[0]
    for j in range(1, kernel):
        out.addcmul_(window[j : j + n], weight[j])
    return out


def _gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output `x` `[T, H, dv]`, times `weight`, gated by silu(z)
    (transformers' `RMSNormGated`: norm first, then gate)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x * F.silu(z)


def hf_weights(
    config: DeltaNetConfig, sd: Mapping[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    """One layer's Hugging Face weights under `prefix` (e.g. `model.layers.0.linear_attn.`) →
    this module's names: Qwen3.5's separate projections or Qwen3-Next's fused, per-key-head
    grouped ones, whichever the state dict holds.

    Raises:
        KeyError: neither layout's projections are there.
        ValueError: an `A_log` whose exp is not a float32 (the decays -inf: every state NaN).
    """
    c = config
    if not torch.isfinite(sd[prefix + "A_log"].float().exp()).all():
        raise ValueError(f"Gated DeltaNet: {prefix}A_log holds values whose exp overflows float32 (or NaN)")
    if prefix + "in_proj_qkvz.weight" in sd:
        fused = sd[prefix + "in_proj_qkvz.weight"], sd[prefix + "in_proj_ba.weight"]
        q, k, v, z, b, a = _split_next(c, *fused)
    else:
        qkv = sd[prefix + "in_proj_qkv.weight"]
        q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim])
        z, b, a = (sd[prefix + f"in_proj_{name}.weight"] for name in ("z", "b", "a"))
    conv = sd[prefix + "conv1d.weight"]  # [conv_dim, 1, K]
    return {
        "in_proj.weight": torch.cat([q, k, v, z, b, a]),
        "conv_weight": conv[:, 0, :].t().contiguous(),  # [K, conv_dim]
        "A_log": sd[prefix + "A_log"],
        "dt_bias": sd[prefix + "dt_bias"],
        "norm_weight": sd[prefix + "norm.weight"],
        "out_proj.weight": sd[prefix + "out_proj.weight"],
    }


def _split_next(
    c: DeltaNetConfig, qkvz: torch.Tensor, ba: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's fused rows, grouped by key head (each: its q, k, then the v and z of its
    value heads; b and a likewise) → q, k, v, z, b, a rows in head order."""
    group = c.num_v_heads // c.num_k_heads
    hidden = qkvz.shape[-1]
    per_head = qkvz.view(c.num_k_heads, -1, hidden)  # [Hk, 2 dk + 2 group dv, hidden]
    parts = per_head.split([c.head_k_dim, c.head_k_dim, group * c.head_v_dim, group * c.head_v_dim], dim=1)
    q, k, v, z = (p.reshape(-1, hidden) for p in parts)  # value head h = key head h // group
    b, a = (p.reshape(-1, hidden) for p in ba.view(c.num_k_heads, 2 * group, hidden).split(group, dim=1))
    return q, k, v, z, b, a
