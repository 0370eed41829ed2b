"""Tensor parallelism over torch.distributed: how a rank's shard is cut, and what ranks exchange.

Megatron's layout on the fused projections: `qkv_proj` and `gate_up_proj` are split by output
rows (a rank holds a share of the kv heads with their query heads, and a share of the MLP
columns), `o_proj` and `down_proj` by input columns, and their partial outputs are summed with
`all_reduce`. Shares are as even as can be, not necessarily equal: the default model's 3 kv
heads run on 2 ranks as 2 + 1 (every rank needs at least one kv head). The embedding is
replicated; the lm_head is split by vocabulary rows and its logits gathered. Experts are split
the same way, every expert by its MLP columns: the router is replicated, so every rank routes
the (all-reduced, identical) activations to the same experts and sums its columns' share. OLMoE's
norms over the whole q and k projections are split with their rows, and the ranks sum their
squares before normalizing (`llama.whole_qk_norm`). Each rank's KV
cache holds its own kv heads with the same page layout, so page ids mean the same on every rank
and the scheduler does not change.

Rank 0 hosts the runner actor; it broadcasts each step's description (CBOR) and the other ranks
run the same forward from it (`TorchRunner.follow`). Control messages go through a gloo group
(CPU tensors); activations go through the main group (NCCL on CUDA, gloo on the CPU).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import cbor2
import torch
import torch.distributed as dist

from ft.core.batch import RunnerFailure, SeqWork
from ft.model.llama import LlamaConfig
from ft.params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)

log = logging.getLogger("ft.ranks")


class RankFailure(RunnerFailure):
    """A collective failed: a rank died, hung past the step timeout, or left the group.

    Fatal for the whole engine (every rank's KV and step state is now unknown): the runner
    actor fails every request instead of retrying sequences one by one.
    """


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


# --- the step description ------------------------------------------------------------------


def encode_works(works: list[SeqWork]) -> bytes:
    """The fields a forward pass needs, as CBOR (sampling happens on rank 0 only; the scored
    rows are sent because every rank runs their vocabulary projection, a collective)."""
    rows = [
        [
            list(w.token_ids),
            w.start_pos,
            list(w.page_ids),
            w.sample,
            w.score_offset,
            list(w.score_ids),
            w.num_draft,
        ]
        for w in works
    ]
    return cbor2.dumps({"op": "step", "works": rows})


def decode_works(rows: list[Any]) -> list[SeqWork]:
    """`SeqWork`s rebuilt from `encode_works`'s rows (greedy params: they are never sampled here)."""
    return [
        SeqWork(
            i,
            tuple(tokens),
            int(start),
            tuple(pages),
            bool(sample),
            _GREEDY,
            0,
            score_offset=int(score_offset),
            score_ids=tuple(score_ids),
            num_draft=int(num_draft),
        )
        for i, (tokens, start, pages, sample, score_offset, score_ids, num_draft) in enumerate(rows)
    ]


def collective_failed(op: str, e: Exception) -> RankFailure:
    """The failure of a collective, for clients: what failed, not gloo's or NCCL's text (it
    names source paths and peers' addresses); that goes to the log."""
    log.error("tensor-parallel %s failed: %s", op, e)
    return RankFailure(
        f"tensor-parallel {op} failed ({type(e).__name__}): a rank died or lost its connection"
    )


class RankGroup:
    """This process's place in the tensor-parallel group: the collectives a step uses.

    `group` carries activations (NCCL on CUDA, gloo on the CPU); `control` is a gloo group for
    the step descriptions rank 0 broadcasts (the same group when that is gloo already).
    Every collective error is raised as `RankFailure`.
    """

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.group: Any = dist.group.WORLD
        self.control: Any = (
            dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        )

    @property
    def shard(self) -> Shard:
        """This rank's slice."""
        return Shard(self.rank, self.world)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that schedules, broadcasts steps and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        try:
            dist.all_reduce(x, group=self.group)
        except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError
            raise collective_failed("all_reduce", e) from e
        return x

    def all_gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """`[R, rows]` logits of each rank's vocabulary slice → `[R, world * rows]`."""
        parts = [torch.empty_like(local) for _ in range(self.world)]
        try:
            dist.all_gather(parts, local.contiguous(), group=self.group)
        except Exception as e:
            raise collective_failed("all_gather", e) from e
        return torch.cat(parts, dim=-1)

    def send(self, payload: bytes) -> None:
        """Rank 0: broadcast one message (its length, then its bytes) to the other ranks."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        try:
            dist.broadcast(size, src=0, group=self.control)
            dist.broadcast(data, src=0, group=self.control)
        except Exception as e:
            raise collective_failed("broadcast", e) from e

    def receive(self) -> Any:
        """Other ranks: the next message rank 0 sent, decoded from CBOR."""
        size = torch.zeros(1, dtype=torch.int64)
        try:
            dist.broadcast(size, src=0, group=self.control)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.control)
        except Exception as e:
            raise collective_failed("broadcast", e) from e
        return cbor2.loads(data.numpy().tobytes())

    def send_step(self, works: list[SeqWork]) -> None:
        """Rank 0: tell the other ranks to run this step."""
        self.send(encode_works(works))

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks to leave their step loop."""
        self.send(cbor2.dumps({"op": "stop"}))
