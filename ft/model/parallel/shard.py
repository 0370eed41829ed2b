"""How a rank's slice of the model is cut and its model built (the layout: `ft.model.parallel`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ft.model.llama import LlamaConfig, LlamaForCausalLM, assemble_model, fuse_hf_state_dict

if TYPE_CHECKING:
    from ft.model.parallel.group import RankGroup


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's slice of the model: `rank` of `world`."""

    rank: int
    world: int


def check_shardable(config: LlamaConfig, world: int) -> None:
    """Raise `ValueError` unless every rank gets at least one kv head and one MLP column."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be positive, got {world}")
    if config.num_experts and config.moe_intermediate_size < world:
        raise ValueError(f"tensor_parallel_size {world} is more than the model's expert MLP columns")
    if config.num_kv_heads < world:
        raise ValueError(
            f"tensor_parallel_size {world} is more than the model's {config.num_kv_heads} kv heads"
        )
    if config.intermediate_size < world:
        raise ValueError(f"tensor_parallel_size {world} is more than the model's MLP columns")


def split(total: int, shard: Shard) -> tuple[int, int]:
    """`(start, count)` of this rank's part of `total` items, as even as can be (the first
    `total % world` ranks take one more): 3 kv heads over 2 ranks are 2 + 1."""
    base, extra = divmod(total, shard.world)
    return shard.rank * base + min(shard.rank, extra), base + (shard.rank < extra)


def local_config(config: LlamaConfig, shard: Shard) -> LlamaConfig:
    """This rank's shapes: its kv heads (with their query heads) and its MLP columns."""
    check_shardable(config, shard.world)
    group = config.num_heads // config.num_kv_heads
    kv_heads = split(config.num_kv_heads, shard)[1]
    return dataclasses.replace(
        config,
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        intermediate_size=split(config.intermediate_size, shard)[1],
        moe_intermediate_size=split(config.moe_intermediate_size, shard)[1] if config.num_experts else 0,
        head_dim=config.head_dim,  # explicit: the default would be hidden_size // local heads
    )


def vocab_rows(vocab_size: int, world: int) -> int:
    """lm_head rows per rank (the last rank's slice is padded with zero rows to this)."""
    return -(-vocab_size // world)


def shard_fused(config: LlamaConfig, fused: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """This rank's slice of a fused state dict (`llama.fuse_hf_state_dict` names)."""
    if shard.world == 1:
        return fused
    hd = config.head_dim
    group = config.num_heads // config.num_kv_heads
    kv_start, kv_heads = split(config.num_kv_heads, shard)
    q0, q_rows = kv_start * group * hd, kv_heads * group * hd  # query heads follow their kv head
    kv0, kv_rows = kv_start * hd, kv_heads * hd
    i0, inter = split(config.intermediate_size, shard)
    e0, expert_inter = split(config.moe_intermediate_size, shard) if config.num_experts else (0, 0)

    def qkv(w: torch.Tensor) -> torch.Tensor:
        q, k, v = w.split([config.q_size, config.kv_size, config.kv_size], dim=0)
        # [(heads + 2 * kv_heads) of this rank * head_dim, ...]
        return torch.cat([q.narrow(0, q0, q_rows), k.narrow(0, kv0, kv_rows), v.narrow(0, kv0, kv_rows)])

    out: dict[str, torch.Tensor] = {}
    for name, w in fused.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            out[name] = qkv(w)
        elif config.qk_norm_whole and name.endswith("q_norm.weight"):  # OLMoE: one weight per q row
            out[name] = w.narrow(0, q0, q_rows)
        elif config.qk_norm_whole and name.endswith("k_norm.weight"):
            out[name] = w.narrow(0, kv0, kv_rows)
        elif name.endswith("o_proj.weight"):
            out[name] = w.narrow(1, q0, q_rows)  # [hidden, this rank's q_size]
        elif name.endswith("gate_up_proj.weight"):
            gate, up = w.chunk(2, dim=0)
            out[name] = torch.cat([gate.narrow(0, i0, inter), up.narrow(0, i0, inter)])
        elif name.endswith("moe.gate_up"):  # every expert's columns: [experts, 2 * inter, hidden]
            gate, up = w.chunk(2, dim=1)
            out[name] = torch.cat([gate.narrow(1, e0, expert_inter), up.narrow(1, e0, expert_inter)], dim=1)
        elif name.endswith("moe.down"):
            out[name] = w.narrow(2, e0, expert_inter)  # [experts, hidden, this rank's inter]
        elif name.endswith("down_proj.weight"):
            out[name] = w.narrow(1, i0, inter)  # [hidden, this rank's intermediate]
        elif name == "lm_head.weight":
            rows = vocab_rows(config.vocab_size, shard.world)
            part = w[shard.rank * rows : (shard.rank + 1) * rows]
            if part.shape[0] < rows:  # [rows, hidden], zero-padded on the last rank
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], w.shape[1])])
            out[name] = part
        else:  # embedding and norms are replicated
            out[name] = w
    return {k: v.contiguous() for k, v in out.items()}


def build_rank_model(
    config: LlamaConfig, hf_state_dict: dict[str, torch.Tensor], dtype: torch.dtype, ranks: RankGroup
) -> LlamaForCausalLM:
    """This rank's model on `ranks.device`: its slice of the (fused) weights, its local shapes,
    the row-parallel outputs summed over the ranks and its lm_head's vocabulary rows.

    The model is built as one process would (`llama.assemble_model`); parallelism is the
    weights cut here and the `all_reduce` passed in, nothing inside the model file.
    """
    fused = fuse_hf_state_dict(config, hf_state_dict)
    if ranks.world == 1:
        return assemble_model(config, fused, dtype, device=ranks.device)
    shard = ranks.shard
    return assemble_model(
        config,
        shard_fused(config, fused, shard),
        dtype,
        device=ranks.device,
        local=local_config(config, shard),
        reduce=ranks.all_reduce,
        lm_head_rows=vocab_rows(config.vocab_size, shard.world),
    )
