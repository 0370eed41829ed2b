"""RunnerActor: runs each batch's forward pass in a thread; isolates a failing sequence."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from ft.core.batch import (
    ConstraintError,
    Heartbeat,
    PoolSum,
    RowsFailed,
    Runner,
    RunnerFailure,
    Sampled,
    Scored,
    SeqWork,
    StateRunner,
    StepOutput,
)
from ft.core.prompt_cache import PageIO
from ft.errors import FtError, InvalidRequest, RequestFailed
from ft.messages import Batch, SchedulerIn, StepDone

if TYPE_CHECKING:
    from ft.core.prompt_cache import PromptCache

log = logging.getLogger("ft.runner")

StepHook = Callable[[list[SeqWork]], None]


class RunnerActor:
    """Owns the runner; one step at a time, off the event loop.

    A `RunnerFailure` is fatal: `on_fatal` is called once with the reason, that batch and every
    later one fail whole (the engine fails the requests, whose scopes free their pages), and no
    step runs again. `halt` is the same decision taken outside (the engine's watchdog: a step
    that never returns, a rank process that died): it also gives up the step in flight.
    `step_started_at`, `num_steps` and `progress` (the runner's `Heartbeat`, beaten inside a
    step) are what the watchdog reads.

    With a `prompt_cache` (the disk tier), a batch's page saves and loads run in a thread
    before its step: saves copy pages out before the step can write them, loads fill the
    pages of sequences the step does not compute. Neither can fail the step: a page that does
    not save is dropped, one that does not load is prefilled.
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[Batch],
        scheduler: trio.MemorySendChannel[SchedulerIn],
        runner: Runner,
        *,
        before_step: StepHook | None = None,
        on_fatal: Callable[[str], None] | None = None,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        self.inbox = inbox
        self.prompt_cache = prompt_cache
        self.scheduler = scheduler
        self.runner = runner
        self.before_step = before_step
        self.on_fatal = on_fatal
        self.fatal: str | None = None  # why the runner can run no more steps
        self.step_started_at: float | None = None  # trio time the step in flight began
        self.num_steps = 0  # steps done (each sent its StepDone)
        self._step_scope: trio.CancelScope | None = None

    @property
    def progress(self) -> int:
        """Beats of the runner's heartbeat so far (0 for a runner without one: only whole
        steps then count as progress)."""
        heartbeat: Heartbeat | None = getattr(self.runner, "heartbeat", None)
        return heartbeat.beats if heartbeat is not None else 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run batches until the inbox closes."""
        task_status.started()
        async for batch in self.inbox:
            self.scheduler.send_nowait(await self._run_batch(batch))
            self.num_steps += 1
            # Nothing of a finished step outlives it here: its works hold sequences' grammar
            # matchers, which must go with their request's scope, not at the next step.
            del batch

    async def _run_batch(self, batch: Batch) -> StepDone:
        started = time.perf_counter()
        works = list(batch.works)
        failed: list[tuple[int, FtError]] = []
        sampled: list[StepOutput] = []
        loaded: tuple[tuple[int, int], ...] = ()
        if self.fatal is None:
            self.step_started_at = trio.current_time()
            try:
                with trio.CancelScope() as self._step_scope:
                    if batch.saves or batch.loads:
                        loaded = await trio.to_thread.run_sync(
                            self._move_pages, batch, abandon_on_cancel=True
                        )
                    if batch.state_copies:
                        await trio.to_thread.run_sync(self._copy_states, batch, abandon_on_cancel=True)
                    if works:
                        sampled = await self._run_isolated(works, failed)
            except RunnerFailure as e:
                self._fail(f"the model runner failed: {e}")
            finally:
                self._step_scope = self.step_started_at = None
        if self.fatal is not None:  # failed, or halted mid-step
            sampled, failed = [], [(w.seq_id, RequestFailed(self.fatal)) for w in works]
        # A recompute after preemption feeds generated tokens in chunks: only single-token
        # works past the prompt (and their drafts) are decodes; a decode's tokens are those it
        # gave (several when drafts were accepted).
        decodes = [
            w for w in works if len(w.token_ids) - w.num_draft == 1 and w.start_pos >= w.num_prompt_tokens
        ]
        tokens = tuple(x for x in sampled if isinstance(x, Sampled))
        decode_ids = {w.seq_id for w in decodes}
        return StepDone(
            step=batch.step,
            sampled=tokens,
            failed=tuple(failed),
            scored=tuple(x for x in sampled if isinstance(x, Scored)),
            pooled=tuple(x for x in sampled if isinstance(x, PoolSum)),
            duration_s=time.perf_counter() - started,
            draft_s=float(getattr(self.runner, "last_draft_s", 0.0)),
            num_prefill_tokens=sum(len(w.token_ids) for w in works if w.seq_id not in decode_ids),
            num_decode_tokens=sum(1 for x in tokens if x.seq_id in decode_ids),
            loaded=loaded,
        )

    def _move_pages(self, batch: Batch) -> tuple[tuple[int, int], ...]:
        """The batch's disk-tier saves, then its loads (in the step's thread, before it)."""
        cache, io = self.prompt_cache, self.runner
        if cache is None or not isinstance(io, PageIO):
            return ()
        try:
            cache.save_pages(io, batch.saves)
        except Exception:  # a page not saved is only a page recomputed later
            log.exception("prompt cache: copying pages out failed")
        try:
            return cache.load_pages(io, batch.loads)
        except Exception:
            # NOTE: a load that raised midway may have written part of a page: none of these
            # pages is counted as loaded, so the step recomputes (overwrites) all of them.
            log.exception("prompt cache: loading pages failed")
            return ()

    def _copy_states(self, batch: Batch) -> None:
        """The batch's recurrent state copies (in the step's thread, before it). A copy that
        fails leaves states no sequence can trust: no further step can run."""
        runner = self.runner
        if not isinstance(runner, StateRunner):
            raise RunnerFailure("a batch copies recurrent states but the runner holds none")
        try:
            runner.copy_states(batch.state_copies)
        except Exception as e:
            raise RunnerFailure(f"copying recurrent states failed: {e}") from e

    async def _run_isolated(
        self, works: list[SeqWork], failed: list[tuple[int, FtError]]
    ) -> list[StepOutput]:
        try:
            return await self._run(works)
        except RunnerFailure:
            raise
        except RowsFailed as e:  # the step ran; only these rows' grammars failed (400s)
            failed.extend((seq_id, InvalidRequest(why)) for seq_id, why in e.failed)
            return e.sampled
        except Exception:
            # One bad sequence must not fail its neighbours: rerun each alone. Reruns
            # rewrite the same KV slots with the same values, so this is safe.
            sampled: list[StepOutput] = []
            for work in works:
                try:
                    sampled += await self._run([work])
                except RunnerFailure:
                    raise
                except ConstraintError as e:  # the request's grammar failed: a 400, not a 500
                    failed.append((work.seq_id, InvalidRequest(str(e))))
                except Exception as e:
                    failed.append((work.seq_id, RequestFailed(f"model step failed: {type(e).__name__}: {e}")))
            return sampled

    def halt(self, reason: str) -> None:
        """Run no more steps: the step in flight (if any) is given up and fails whole, as every
        later batch does. Synchronous and idempotent; `on_fatal` is not called (the caller
        decided). A step's thread cannot be interrupted: it is abandoned, still running."""
        if self.fatal is None:
            self.fatal = reason
        if self._step_scope is not None:
            self._step_scope.cancel()

    def _fail(self, reason: str) -> None:
        if self.fatal is None:
            self.fatal = reason
            if self.on_fatal is not None:
                self.on_fatal(reason)

    async def _run(self, works: list[SeqWork]) -> list[StepOutput]:
        astep = getattr(self.runner, "astep", None)
        if astep is not None:  # an async runner (the fake one) computes on the event loop
            if self.before_step is not None:
                self.before_step(works)
            result: list[StepOutput] = await astep(works)
            return result
        # NOTE: a thread cannot be interrupted: a step that never returns (a hung kernel, a
        # collective on a hung rank) is abandoned when halted or when the engine stops, so
        # neither waits for it; the process exits with the thread still blocked.
        return await trio.to_thread.run_sync(self._step, works, abandon_on_cancel=True)

    def _step(self, works: list[SeqWork]) -> list[StepOutput]:
        if self.before_step is not None:
            self.before_step(works)
        return self.runner.step(works)
