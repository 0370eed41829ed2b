"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral, OLMoE, Qwen3.5-MoE, Qwen3-Next): a softmax
router's top-k experts, run grouped by expert, and optionally a shared expert beside them.

Each token's `num_experts_per_tok` experts are chosen from the router's softmax over every expert
(in float32, as transformers does), their weights renormalized to sum to one where the config
says `norm_topk_prob` (Qwen3-MoE's choice, always on Mixtral: the same as Mixtral's softmax over
the k chosen logits, OLMoE's default off). The step's (token, expert) assignments are then sorted
by expert (`group_by_expert`), so each expert runs once over all of its tokens — one set of
products per expert used in the step, never a loop over tokens — and its outputs, scaled by the
routing weights, are added back to their rows in expert order (`mix`). The float `SparseMoE` and
the packed path (`quantized_llama`, whose experts stay GGUF blocks) share `route`,
`group_by_expert` and `mix`; only how one expert runs over its rows differs.

Qwen3.5-MoE and Qwen3-Next add a shared expert (`SharedExpert`): a SwiGLU MLP every token goes
through, its output scaled by sigmoid of a one-row gate, added to the routed experts' sum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ft.model.llama import LlamaConfig


class Routing(NamedTuple):
    """Each token's chosen experts and their weights."""

    experts: torch.Tensor  # [T, top_k] int64
    weights: torch.Tensor  # [T, top_k] float32 (`SparseMoE.route`: the activations' dtype)


class ExpertGroups(NamedTuple):
    """A step's (token, expert) assignments sorted by expert: expert e's are the `counts[e]`
    entries after those of experts 0..e-1."""

    rows: torch.Tensor  # [T * top_k] int64: the token row of each assignment
    weights: torch.Tensor  # [T * top_k] float32: its routing weight
    counts: list[int]  # [experts]: assignments per expert


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, rows [n, hidden]) -> [n, hidden]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """The top-k experts of each row of router `logits` `[T, experts]`: softmax over every expert
    in float32, top-k, optionally renormalized over the k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


def group_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    """`routing`'s assignments grouped by expert (stable: rows ascending within an expert).

    NOTE: one host sync per layer for the group sizes; callers loop over the experts in use.
    """
    top_k = routing.experts.shape[1]
    flat = routing.experts.flatten()  # [T * top_k]: assignment a is row a // top_k
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order // top_k, routing.weights.flatten()[order], counts)


def mix(x: torch.Tensor, groups: ExpertGroups, run_expert: ExpertFn) -> torch.Tensor:
    """`sum_k weight_k * expert_k(x)` for every row of `x` `[T, hidden]`: each expert in use run
    once over all of its rows (`run_expert(e, x[rows])`), its weighted outputs added to them."""
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(groups.counts):
        if count == 0:
            continue
        rows = groups.rows[start : start + count]
        y = run_expert(expert, x[rows])  # [count, hidden]
        out.index_add_(0, rows, y * groups.weights[start : start + count, None].to(y.dtype))
        start += count
    return out


class SharedExpert(nn.Module):
    """The expert every token goes through (Qwen3.5-MoE's and Qwen3-Next's `shared_expert`):
    SwiGLU with gate/up fused `[2 * inter, hidden]` and down `[hidden, inter]`, its output times
    sigmoid(`gate` `[1, hidden]` . x), one scalar per token (`shared_expert_gate`)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(hidden, intermediate))
        self.gate = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)  # [T, inter] each
        return torch.sigmoid(F.linear(x, self.gate)) * F.linear(F.silu(gate) * up, self.down)


class SparseMoE(nn.Module):
    """The router `[experts, hidden]` and the experts' fused gate/up `[experts, 2 * inter, hidden]`
    and down `[experts, hidden, inter]` weights (transformers' `Qwen3MoeExperts` layout); a
    `SharedExpert` beside them when the config has one (`shared_expert_intermediate_size`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(e, h))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))
        shared = config.shared_expert_intermediate_size
        self.shared = SharedExpert(h, shared) if shared else None

    def route(self, x: torch.Tensor) -> Routing:
        """The top-k experts of each row of `x` `[T, hidden]` (weights in `x`'s dtype)."""
        routing = route(F.linear(x, self.router), self.top_k, self.norm_topk_prob)
        return Routing(routing.experts, routing.weights.to(x.dtype))

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU over rows `x` `[n, hidden]` → `[n, hidden]`."""
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)  # [n, inter] each
        return F.linear(F.silu(gate) * up, self.down[expert])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        groups = group_by_expert(self.route(x), self.gate_up.shape[0])
        out = mix(x, groups, self.run_expert)
        return out if self.shared is None else out + self.shared(x)


def moe_prefix(sd: Mapping[str, object], layer: str) -> str:
    """The name of layer `layer`'s (`model.layers.N.`) MoE block: `mlp.`, or Mixtral's
    `block_sparse_moe.`."""
    return "block_sparse_moe." if layer + "block_sparse_moe.gate.weight" in sd else "mlp."


def fuse_experts(sd: dict[str, torch.Tensor], prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
    """The `SparseMoE` weights (`router`, `gate_up`, `down`) of the MLP at `prefix` (`...mlp.`),
    from a checkpoint's per-expert `experts.N.{gate,up,down}_proj.weight` (Mixtral's
    `experts.N.{w1,w3,w2}.weight`), transformers' fused 3-D `experts.gate_up_proj` /
    `experts.down_proj`, or a GGUF's stacked 3-D `experts.{gate,up,down}_proj`
    (`architectures.MOE_NAMES`); and the shared expert's (`shared.*`) from
    `shared_expert.{gate,up,down}_proj.weight` and `shared_expert_gate.weight` where they are."""
    out = {"router": sd[prefix + "gate.weight"]} | _shared_expert(sd, prefix)
    if prefix + "experts.gate_up_proj" in sd:
        out["gate_up"], out["down"] = sd[prefix + "experts.gate_up_proj"], sd[prefix + "experts.down_proj"]
        return out
    if prefix + "experts.gate_proj" in sd:  # [experts, inter, hidden] each
        gate_up = [sd[prefix + "experts.gate_proj"], sd[prefix + "experts.up_proj"]]
        out["gate_up"], out["down"] = torch.cat(gate_up, dim=1), sd[prefix + "experts.down_proj"]
        return out
    experts = [f"{prefix}experts.{e}." for e in range(num_experts)]
    gate, up, down = (
        ("w1", "w3", "w2") if experts[0] + "w1.weight" in sd else ("gate_proj", "up_proj", "down_proj")
    )
    out["gate_up"] = torch.stack(
        [torch.cat([sd[p + gate + ".weight"], sd[p + up + ".weight"]]) for p in experts]
    )
    out["down"] = torch.stack([sd[p + down + ".weight"] for p in experts])
    return out


def _shared_expert(sd: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """`SharedExpert`'s weights (under `shared.`) of the MoE block at `prefix`, if it has one."""
    shared = prefix + "shared_expert."
    if shared + "gate_proj.weight" not in sd:
        return {}
    return {
        "shared.gate_up": torch.cat([sd[shared + "gate_proj.weight"], sd[shared + "up_proj.weight"]]),
        "shared.down": sd[shared + "down_proj.weight"],
        "shared.gate": sd[prefix + "shared_expert_gate.weight"],
    }
