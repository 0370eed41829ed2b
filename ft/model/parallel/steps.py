"""The leader/follower step protocol a runner calls into under tensor parallelism.

Rank 0 (the leader) runs each forward through `lead`: the step's description goes to the other
ranks first, then rank 0 runs the same forward; a failure there leaves the group out of step,
so it is a `RankFailure`. The other ranks (followers) run `follow` until rank 0 sends "stop"
(`stop_followers`). The lm_head's logits over each rank's vocabulary slice are gathered by
`gathered_lm_head`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from ft.core.batch import SeqWork
from ft.model.parallel.group import RankFailure, RankGroup, decode_works

log = logging.getLogger("ft.ranks")

T = TypeVar("T")
Head = Callable[[torch.Tensor], torch.Tensor]


def lead(ranks: RankGroup, works: list[SeqWork], forward: Callable[[list[SeqWork]], T]) -> T:
    """Rank 0: broadcast the step, then run `forward(works)` as every other rank does.

    Raises:
        RankFailure: a collective failed, or the forward failed on rank 0 (the other ranks may
            now wait in a collective this rank never reached: no sequence can be retried alone).
    """
    assert ranks.is_leader, "ranks other than 0 follow rank 0's steps"
    ranks.send_step(works)  # the other ranks run the same forward
    try:
        return forward(works)
    except RankFailure:
        raise
    except Exception as e:
        log.exception("a tensor-parallel step failed on rank 0")
        raise RankFailure(f"a tensor-parallel step failed on rank 0 ({type(e).__name__})") from e


def follow(ranks: RankGroup, forward: Callable[[list[SeqWork]], object]) -> None:
    """Ranks other than 0: run the steps rank 0 broadcasts until it sends "stop".

    Raises:
        RankFailure: rank 0 died or the group broke.
    """
    assert not ranks.is_leader
    while True:
        message = ranks.receive()
        if message["op"] == "stop":
            return
        if message["op"] != "step":
            raise ValueError(f"unexpected tensor-parallel message {message['op']!r}")
        forward(decode_works(message["works"]))


def stop_followers(ranks: RankGroup, lock: threading.Lock, timeout_s: float) -> None:
    """Rank 0: end the other ranks' step loops once no step runs (`lock` is held by a step).

    Raises:
        RankFailure: a step is still running after `timeout_s` (it hangs), or the ranks are gone.
    """
    if not ranks.is_leader:
        return
    if not lock.acquire(timeout=timeout_s):
        raise RankFailure(f"a step still runs after {timeout_s:g} s; the ranks are not stopped")
    try:
        ranks.send_stop()
    finally:
        lock.release()


def gathered_lm_head(ranks: RankGroup, head: Head, vocab_size: int) -> Head:
    """`head` over this rank's vocabulary slice, its logits gathered to the full vocabulary."""

    def run(rows: torch.Tensor) -> torch.Tensor:
        return ranks.all_gather_vocab(head(rows))[:, :vocab_size]  # [R, vocab]

    return run
