"""A mixture-of-experts MLP (Qwen3-MoE): a softmax router's top-k experts, run grouped by expert.

Each token's `num_experts_per_tok` experts are chosen from the router's softmax (in float32, as
transformers does), their weights renormalized to sum to one where the config says
`norm_topk_prob`. The step's (token, expert) assignments are then sorted by expert, so each
expert runs once over all of its tokens — one pair of matmuls per expert used in the step,
never a loop over tokens — and its outputs, scaled by the routing weights, are added back to
their rows in expert order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ft.model.llama import LlamaConfig


class Routing(NamedTuple):
    """Each token's chosen experts and their weights."""

    experts: torch.Tensor  # [T, top_k] int64
    weights: torch.Tensor  # [T, top_k] in the activations' dtype


class SparseMoE(nn.Module):
    """The router `[experts, hidden]` and the experts' fused gate/up `[experts, 2 * inter, hidden]`
    and down `[experts, hidden, inter]` weights (transformers' `Qwen3MoeExperts` layout)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(e, h))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))

    def route(self, x: torch.Tensor) -> Routing:
        """The top-k experts of each row of `x` `[T, hidden]`."""
        logits = F.linear(x, self.router)  # [T, experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(experts, weights.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        routing = self.route(x)
        flat = routing.experts.flatten()  # [T * top_k]: assignment a is row a // top_k
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        rows_of = order // self.top_k
        weight_of = routing.weights.flatten()[order]
        # NOTE: one host sync per layer for the group sizes; the loop is over experts in use.
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = rows_of[start : start + count]
            gate, up = F.linear(x[rows], self.gate_up[expert]).chunk(2, dim=-1)  # [n, inter] each
            y = F.linear(F.silu(gate) * up, self.down[expert])  # [n, hidden]
            out.index_add_(0, rows, y * weight_of[start : start + count, None])
            start += count
        return out


def fuse_experts(sd: dict[str, torch.Tensor], prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
    """The `SparseMoE` weights (`router`, `gate_up`, `down`) of the MLP at `prefix` (`...mlp.`),
    from a checkpoint's per-expert `experts.N.{gate,up,down}_proj.weight`, transformers' fused
    3-D `experts.gate_up_proj` / `experts.down_proj`, or a GGUF's stacked 3-D
    `experts.{gate,up,down}_proj` (`architectures.MOE_NAMES`)."""
    out = {"router": sd[prefix + "gate.weight"]}
    if prefix + "experts.gate_up_proj" in sd:
        out["gate_up"], out["down"] = sd[prefix + "experts.gate_up_proj"], sd[prefix + "experts.down_proj"]
        return out
    if prefix + "experts.gate_proj" in sd:  # [experts, inter, hidden] each
        gate_up = [sd[prefix + "experts.gate_proj"], sd[prefix + "experts.up_proj"]]
        out["gate_up"], out["down"] = torch.cat(gate_up, dim=1), sd[prefix + "experts.down_proj"]
        return out
    experts = [f"{prefix}experts.{e}." for e in range(num_experts)]
    out["gate_up"] = torch.stack(
        [torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]]) for p in experts]
    )
    out["down"] = torch.stack([sd[p + "down_proj.weight"] for p in experts])
    return out
