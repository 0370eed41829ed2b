"""The tensor-parallel group: the collectives a step uses and the step description rank 0
broadcasts (CBOR over a gloo control group)."""

from __future__ import annotations

import logging
from typing import Any

import cbor2
import torch
import torch.distributed as dist

from ft.core.batch import RunnerFailure, SeqWork
from ft.model.parallel.shard import Shard
from ft.params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)

log = logging.getLogger("ft.ranks")


class RankFailure(RunnerFailure):
    """A collective failed: a rank died, hung past the step timeout, or left the group.

    Fatal for the whole engine (every rank's KV and step state is now unknown): the runner
    actor fails every request instead of retrying sequences one by one.
    """


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
