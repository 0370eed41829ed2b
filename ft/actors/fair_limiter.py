"""FairLimiter: a capacity limiter whose next slot goes to the client that used the least.

The trio shell of `ft.core.fair_share.FairShare`: `slot(client)` waits for a turn, holds one
of `num_slots` for the block and charges the client the block's time (trio's clock), times the
failure weight when the block raised or marked its `Slot` failed. The tokenizer actor and the
grammars wrap their worker processes in one each, so one client's failures wait behind other
clients' work instead of ahead of it.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from ft.core.fair_share import FAILURE_WEIGHT, HALF_LIFE_S, FairShare, FairShareStatistics

UNNAMED = ""  # the client of callers that name none (an embedding program, a test)


@dataclass(slots=True)
class Slot:
    """One job's hold on a slot; set `failed` when the job was refused (it is charged more)."""

    client: str
    failed: bool = False


class FairLimiter:
    """At most `num_slots` blocks at once; waiting ones enter by their client's usage."""

    def __init__(
        self, num_slots: int, *, half_life_s: float = HALF_LIFE_S, failure_weight: float = FAILURE_WEIGHT
    ) -> None:
        self._share = FairShare(num_slots, half_life_s=half_life_s, failure_weight=failure_weight)
        self._ids = itertools.count()
        self._turns: dict[int, trio.Event] = {}  # every job waiting or holding a slot

    @property
    def num_slots(self) -> int:
        """How many blocks may hold a slot at once."""
        return self._share.num_slots

    def statistics(self) -> FairShareStatistics:
        """Slots, running and waiting jobs, clients remembered."""
        return self._share.statistics()

    def usage(self, client: str | None) -> float:
        """`client`'s recent worker time (seconds, decayed; failures weighted)."""
        return self._share.usage(client or UNNAMED, trio.current_time())

    @asynccontextmanager
    async def slot(self, client: str | None) -> AsyncIterator[Slot]:
        """Hold a slot for the block, once it is `client`'s turn (None: `UNNAMED`).

        A checkpoint even when a slot is free. Cancelled while waiting, the job leaves the
        queue; the release is synchronous, so leaving the block from a cancelled task is safe.
        An exception out of the block (not a cancellation) counts as a failure.
        """
        name = client or UNNAMED
        job = next(self._ids)
        turn = self._turns[job] = trio.Event()
        self._share.enqueue(job, name)
        self._dispatch()
        try:
            await turn.wait()
        except BaseException:
            del self._turns[job]
            if self._share.is_running(job):  # its turn came as it was cancelled: pass it on
                self._share.finish(job, trio.current_time())
            else:
                self._share.withdraw(job)
            self._dispatch()
            raise
        held = Slot(name)
        try:
            yield held
        except Exception:
            held.failed = True
            raise
        finally:
            del self._turns[job]
            self._share.finish(job, trio.current_time(), failed=held.failed)
            self._dispatch()

    def _dispatch(self) -> None:
        now = trio.current_time()
        while (job := self._share.start_next(now)) is not None:
            self._turns[job].set()
