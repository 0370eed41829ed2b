"""Tensor parallelism over torch.distributed: how a rank's shard is cut, and what ranks exchange.

Megatron's layout on the fused projections: `qkv_proj` and `gate_up_proj` are split by output
rows (a rank holds `num_heads / N` query heads, `num_kv_heads / N` kv heads and
`intermediate_size / N` MLP columns), `o_proj` and `down_proj` by input columns, and their
partial outputs are summed with `all_reduce`. The embedding is replicated; the lm_head is split
by vocabulary rows and its logits gathered. Each rank's KV cache holds its own kv heads with the
same page layout, so page ids mean the same on every rank and the scheduler does not change.

Rank 0 hosts the runner actor; it broadcasts each step's description (CBOR) and the other ranks
run the same forward from it (`TorchRunner.follow`). Control messages go through a gloo group
(CPU tensors); activations go through the main group (NCCL on CUDA, gloo on the CPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import cbor2
import torch
import torch.distributed as dist

from ft.core.batch import RunnerFailure, SeqWork
from ft.model.llama import LlamaConfig
from ft.params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


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
    """Raise `ValueError` unless heads, kv heads and MLP columns divide evenly by `world`."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be positive, got {world}")
    if config.num_kv_heads % world:
        raise ValueError(
            f"tensor_parallel_size {world} must divide the model's {config.num_kv_heads} kv heads"
        )
    if config.intermediate_size % world:
        raise ValueError(
            f"tensor_parallel_size {world} must divide the model's intermediate size "
            f"{config.intermediate_size}"
        )


def local_config(config: LlamaConfig, world: int) -> LlamaConfig:
    """The per-rank shapes: heads, kv heads and MLP columns divided by `world`."""
    check_shardable(config, world)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=config.num_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
        head_dim=config.head_dim,  # explicit: the default would be hidden_size // local heads
    )


def vocab_rows(vocab_size: int, world: int) -> int:
    """lm_head rows per rank (the last rank's slice is padded with zero rows to this)."""
    return -(-vocab_size // world)


def shard_fused(config: LlamaConfig, fused: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """This rank's slice of a fused state dict (`llama.fuse_hf_state_dict` names)."""
    if shard.world == 1:
        return fused
    r, n = shard.rank, shard.world
    hd = config.head_dim
    q_rows = config.q_size // n
    kv_rows = config.kv_size // n
    inter = config.intermediate_size // n

    def qkv(w: torch.Tensor) -> torch.Tensor:
        q, k, v = w.split([config.q_size, config.kv_size, config.kv_size], dim=0)
        pick = [t.narrow(0, r * rows, rows) for t, rows in ((q, q_rows), (k, kv_rows), (v, kv_rows))]
        return torch.cat(pick)  # [(heads + 2 * kv_heads) / n * head_dim, ...]

    assert q_rows % hd == 0 and kv_rows % hd == 0
    out: dict[str, torch.Tensor] = {}
    for name, w in fused.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            out[name] = qkv(w)
        elif name.endswith("o_proj.weight"):
            out[name] = w.narrow(1, r * q_rows, q_rows)  # [hidden, q_size / n]
        elif name.endswith("gate_up_proj.weight"):
            gate, up = w.chunk(2, dim=0)
            out[name] = torch.cat([gate.narrow(0, r * inter, inter), up.narrow(0, r * inter, inter)])
        elif name.endswith("down_proj.weight"):
            out[name] = w.narrow(1, r * inter, inter)  # [hidden, intermediate / n]
        elif name == "lm_head.weight":
            rows = vocab_rows(config.vocab_size, n)
            part = w[r * rows : (r + 1) * rows]
            if part.shape[0] < rows:  # [rows, hidden], zero-padded on the last rank
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], w.shape[1])])
            out[name] = part
        else:  # embedding and norms are replicated
            out[name] = w
    return {k: v.contiguous() for k, v in out.items()}


# --- the step description ------------------------------------------------------------------


def encode_works(works: list[SeqWork]) -> bytes:
    """The fields a forward pass needs, as CBOR (sampling happens on rank 0 only)."""
    return cbor2.dumps(
        {"op": "step", "works": [[list(w.token_ids), w.start_pos, list(w.page_ids), w.sample] for w in works]}
    )


def decode_works(rows: list[Any]) -> list[SeqWork]:
    """`SeqWork`s rebuilt from `encode_works`'s rows (greedy params: they are never sampled here)."""
    return [
        SeqWork(i, tuple(tokens), int(start), tuple(pages), bool(sample), _GREEDY, 0)
        for i, (tokens, start, pages, sample) in enumerate(rows)
    ]


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
            raise RankFailure(f"tensor-parallel all_reduce failed: {e}") from e
        return x

    def all_gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """`[R, rows]` logits of each rank's vocabulary slice → `[R, world * rows]`."""
        parts = [torch.empty_like(local) for _ in range(self.world)]
        try:
            dist.all_gather(parts, local.contiguous(), group=self.group)
        except Exception as e:
            raise RankFailure(f"tensor-parallel all_gather failed: {e}") from e
        return torch.cat(parts, dim=-1)

    def send(self, payload: bytes) -> None:
        """Rank 0: broadcast one message (its length, then its bytes) to the other ranks."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        try:
            dist.broadcast(size, src=0, group=self.control)
            dist.broadcast(data, src=0, group=self.control)
        except Exception as e:
            raise RankFailure(f"tensor-parallel broadcast failed: {e}") from e

    def receive(self) -> Any:
        """Other ranks: the next message rank 0 sent, decoded from CBOR."""
        size = torch.zeros(1, dtype=torch.int64)
        try:
            dist.broadcast(size, src=0, group=self.control)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.control)
        except Exception as e:
            raise RankFailure(f"tensor-parallel broadcast failed: {e}") from e
        return cbor2.loads(data.numpy().tobytes())

    def send_step(self, works: list[SeqWork]) -> None:
        """Rank 0: tell the other ranks to run this step."""
        self.send(encode_works(works))

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks to leave their step loop."""
        self.send(cbor2.dumps({"op": "stop"}))
