"""A mixture-of-experts MLP over experts kept as GGUF blocks (the packed path's routed layers).

The native layer (`kernels.cpp`, `LayerArgs.attention_only`) stops after the attention
residual; this runs the rest of the layer: the post-attention RMSNorm, the router in torch
(float32 logits over a float router, the family's top-k rule: `moe.route`), the step's tokens
grouped by expert (`moe.group_by_expert`), and each expert in use once over all of its rows —
its gate and up products on one quantization of those rows, SwiGLU, its down product — with the
packed gemm (`kernels.gemm_into`), the weighted sum added back into x (`moe.mix`). Each expert's
weights are a `QuantTensor` view into its projection's stack as the GGUF stored it
(`kernels.expert_views`), so a file of 128 experts is never a float copy.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ft.model import kernels
from ft.model.llama import LlamaConfig
from ft.model.moe import group_by_expert, mix, route
from ft.model.quant import QuantTensor


class PackedExperts:
    """One layer's post-attention norm, float router `[experts, hidden]` and packed experts."""

    def __init__(
        self, config: LlamaConfig, sd: dict[str, torch.Tensor | QuantTensor], prefix: str, lib: ctypes.CDLL
    ) -> None:
        """Raises:
        ValueError: a weight is missing, or of a shape or kind other than the config's.
        """
        c = config
        self.lib = lib
        self.hidden, self.inter = c.hidden_size, c.moe_intermediate_size
        self.top_k, self.renormalize, self.eps = c.num_experts_per_tok, c.norm_topk_prob, c.rms_norm_eps
        self.norm = _floats(sd, prefix + "post_attention_layernorm.weight", (c.hidden_size,))
        self.router = _floats(sd, prefix + "mlp.gate.weight", (c.num_experts, c.hidden_size))
        shapes = {"gate_proj": (self.inter, self.hidden), "up_proj": (self.inter, self.hidden)}
        shapes["down_proj"] = (self.hidden, self.inter)
        self.gate, self.up, self.down = (
            [_packed(sd, f"{prefix}mlp.experts.{e}.{name}.weight", shape) for e in range(c.num_experts)]
            for name, shape in shapes.items()
        )

    def forward(self, x: torch.Tensor) -> None:
        """x `[T, hidden]` float32 += the routed experts' mixture of rms_norm(x)."""
        num_tokens = x.shape[0]
        normed = torch.empty_like(x)
        kernels.check(self.lib, self.lib.ft_rms_norm(
            x.data_ptr(), num_tokens, self.hidden, x.stride(0), self.norm.data_ptr(), self.norm.numel(),
            self.eps, normed.data_ptr(),
        ))  # fmt: skip
        routing = route(F.linear(normed, self.router), self.top_k, self.renormalize)  # float32 logits
        x += mix(normed, group_by_expert(routing, self.router.shape[0]), self.run_expert)

    def run_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU over `rows` `[n, hidden]` → `[n, hidden]`, on its blocks."""
        acts = kernels.QuantizedActivations(rows.contiguous(), self.lib)
        gate_up = torch.empty(rows.shape[0], 2 * self.inter)  # [n, gate | up]
        kernels.gemm_into(gate_up[:, : self.inter], self.gate[expert], acts, self.lib)
        kernels.gemm_into(gate_up[:, self.inter :], self.up[expert], acts, self.lib)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = (F.silu(gate) * up).contiguous()  # [n, inter]
        out = torch.empty(rows.shape[0], self.hidden)
        kernels.gemm_into(out, self.down[expert], kernels.QuantizedActivations(hidden, self.lib), self.lib)
        return out


def _floats(sd: dict[str, torch.Tensor | QuantTensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = sd.get(name)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        found = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected float weights of shape {list(shape)}, found {found}")
    return t.float().contiguous()


def _packed(sd: dict[str, torch.Tensor | QuantTensor], name: str, shape: tuple[int, int]) -> QuantTensor:
    t = sd.get(name)
    if not isinstance(t, QuantTensor) or (t.rows, t.cols) != shape:
        found = [t.rows, t.cols] if isinstance(t, QuantTensor) else type(t).__name__
        raise ValueError(f"{name}: expected packed weights of shape {list(shape)}, found {found}")
    return t
