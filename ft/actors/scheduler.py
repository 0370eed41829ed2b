"""SchedulerActor: applies commands to the scheduler core and keeps one batch in flight."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import assert_never

import trio

from ft.actors.registry import Registry
from ft.core.scheduler import Scheduler
from ft.core.sequence import SeqStatus, Sequence
from ft.errors import FtError, Overloaded
from ft.messages import (
    Abort,
    Batch,
    DetokenizerIn,
    EmbeddingOut,
    Enqueue,
    FinishSeq,
    SchedulerIn,
    SeqFailed,
    StepDone,
    TokenOut,
)

log = logging.getLogger("ft.scheduler")


class SchedulerActor:
    """`async for msg in inbox`: update the core, then launch the next batch if idle."""

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[SchedulerIn],
        runner: trio.MemorySendChannel[Batch],
        detokenizer: trio.MemorySendChannel[DetokenizerIn],
        core: Scheduler,
        registry: Registry,
        on_step: Callable[[StepDone], None] | None = None,
        max_queue_wait_s: float | None = None,
    ) -> None:
        self.max_queue_wait_s = max_queue_wait_s
        self.inbox = inbox
        self.runner = runner
        self.detokenizer = detokenizer
        self.core = core
        self.registry = registry
        self.in_flight: Batch | None = None
        self.on_step = on_step

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve commands until the inbox closes."""
        task_status.started()
        async for msg in self.inbox:
            match msg:
                case Enqueue(uid=uid, prompt_ids=ids, params=params, grammar=grammar, cache_partition=part):
                    entry = self.registry.get(uid)
                    if entry is not None:
                        try:
                            self.core.add(uid, list(ids), params, grammar, cache_partition=part)
                        except FtError as e:
                            log.debug("uid %d: refused: %s", uid, e, extra=entry.log_extra)
                            self.registry.fail(uid, e)
                        else:
                            log.debug("uid %d: queued, %d tokens", uid, len(ids), extra=entry.log_extra)
                case Abort(uid=uid):
                    self._abort(uid)
                case FinishSeq(seq_id=seq_id):
                    self._finish_seq(seq_id)
                case StepDone():
                    assert self.in_flight is not None and self.in_flight.step == msg.step
                    outs = self._step_done(self.in_flight, msg)
                    self.in_flight = None
                    if self.on_step is not None:
                        self.on_step(msg)
                    if outs:
                        self.detokenizer.send_nowait(tuple(outs))
                case _:
                    assert_never(msg)
            if self.max_queue_wait_s is not None:
                self._refuse_stale(self.max_queue_wait_s)
            if self.in_flight is None:
                batch = self.core.schedule()
                if batch is not None:
                    self.in_flight = batch
                    self.runner.send_nowait(batch)
                    self._mark_scheduled(batch)

    # NOTE: these hold sequences only in their own frames: a local of `run` would keep a
    # finished request's sequences (and grammar matchers) alive until the next message.

    def _abort(self, uid: int) -> None:
        live = [seq for seq in self.core.running.values() if seq.uid == uid]
        if self.core.abort(uid):
            for seq in live:
                self._log_speculation(seq)

    def _finish_seq(self, seq_id: int) -> None:
        seq = self.core.running.get(seq_id)
        if self.core.finish_seq(seq_id) and seq is not None:
            self._log_speculation(seq)

    def _step_done(self, batch: Batch, done: StepDone) -> list[TokenOut | EmbeddingOut | SeqFailed]:
        sampling = [self.core.running.get(w.seq_id) for w in batch.works if w.sample]
        outs = self.core.on_step_done(batch, done)
        for seq in sampling:
            if seq is not None and seq.status is SeqStatus.FINISHED:
                self._log_speculation(seq)
        return outs

    def _log_speculation(self, seq: Sequence) -> None:
        """DEBUG: what speculation gave a sequence that ended (drafted, accepted)."""
        if not seq.num_drafted:
            return
        # NOTE: the request's scope may have closed already (its last choice ended by a stop
        # string, the client gone): the line is logged without its request id then.
        entry = self.registry.get(seq.uid)
        log.debug(
            "uid %d: choice %d speculative: %d drafted, %d accepted (%.0f%%)",
            seq.uid,
            seq.index,
            seq.num_drafted,
            seq.num_accepted,
            100 * seq.num_accepted / seq.num_drafted,
            extra=entry.log_extra if entry is not None else None,
        )

    def _refuse_stale(self, max_wait_s: float) -> None:
        """Refuse (503) the queued requests that have waited `max_wait_s` for their first step.

        Checked on every message: while anything waits something runs (or it would have been
        admitted), so steps keep the messages coming. A preempted request already streamed
        tokens and is never refused.
        """
        oldest = trio.current_time() - max_wait_s
        for group in list(self.core.waiting):
            uid = group[0].uid
            entry = self.registry.get(uid)
            if entry is None or entry.scheduled_at is not None or entry.created_at > oldest:
                continue
            self.core.abort(uid)
            log.debug("uid %d: refused after %.3g s in the queue", uid, max_wait_s, extra=entry.log_extra)
            self.registry.fail(
                uid, Overloaded(f"the request waited {max_wait_s:g} s in the queue; retry later")
            )

    def _mark_scheduled(self, batch: Batch) -> None:
        """Stamp the requests whose first step this is (their queue time ends here)."""
        now = trio.current_time()
        for work in batch.works:
            seq = self.core.running.get(work.seq_id)
            entry = self.registry.get(seq.uid) if seq is not None else None
            if entry is not None and entry.scheduled_at is None:
                entry.scheduled_at = now
                log.debug(
                    "uid %d: scheduled after %.3f s",
                    entry.uid,
                    now - entry.created_at,
                    extra=entry.log_extra,
                )
