"""RunnerActor: runs each batch's forward pass in a thread; isolates a failing sequence."""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from ft.core.batch import ConstraintError, RowsFailed, Runner, RunnerFailure, Sampled, SeqWork
from ft.errors import FtError, InvalidRequest, RequestFailed
from ft.messages import Batch, SchedulerIn, StepDone

StepHook = Callable[[list[SeqWork]], None]


class RunnerActor:
    """Owns the runner; one step at a time, off the event loop.

    A `RunnerFailure` (or a step past `step_timeout_s`) is fatal: `on_fatal` is called once
    with the reason, that batch and every later one fail whole (the engine fails the requests,
    whose scopes free their pages), and no step runs again.
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[Batch],
        scheduler: trio.MemorySendChannel[SchedulerIn],
        runner: Runner,
        *,
        before_step: StepHook | None = None,
        step_timeout_s: float | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.inbox = inbox
        self.scheduler = scheduler
        self.runner = runner
        self.before_step = before_step
        self.step_timeout_s = step_timeout_s
        self.on_fatal = on_fatal
        self.fatal: str | None = None  # why the runner can run no more steps

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run batches until the inbox closes."""
        task_status.started()
        async for batch in self.inbox:
            self.scheduler.send_nowait(await self._run_batch(batch))
            # Nothing of a finished step outlives it here: its works hold sequences' grammar
            # matchers, which must go with their request's scope, not at the next step.
            del batch

    async def _run_batch(self, batch: Batch) -> StepDone:
        started = time.perf_counter()
        works = list(batch.works)
        failed: list[tuple[int, FtError]] = []
        sampled: list[Sampled] = []
        if self.fatal is None:
            try:
                sampled = await self._run_isolated(works, failed)
            except RunnerFailure as e:
                self._fail(f"the model runner failed: {e}")
        if self.fatal is not None:
            sampled, failed = [], [(w.seq_id, RequestFailed(self.fatal)) for w in works]
        # A recompute after preemption feeds generated tokens in chunks: only single-token
        # works past the prompt are decodes.
        decodes = [w for w in works if len(w.token_ids) == 1 and w.start_pos >= w.num_prompt_tokens]
        return StepDone(
            step=batch.step,
            sampled=tuple(sampled),
            failed=tuple(failed),
            duration_s=time.perf_counter() - started,
            num_prefill_tokens=sum(len(w.token_ids) for w in works) - len(decodes),
            num_decode_tokens=len(decodes),
        )

    async def _run_isolated(self, works: list[SeqWork], failed: list[tuple[int, FtError]]) -> list[Sampled]:
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
            sampled: list[Sampled] = []
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

    def _fail(self, reason: str) -> None:
        if self.fatal is None:
            self.fatal = reason
            if self.on_fatal is not None:
                self.on_fatal(reason)

    async def _run(self, works: list[SeqWork]) -> list[Sampled]:
        astep = getattr(self.runner, "astep", None)
        if astep is not None:  # an async runner (the fake one) computes on the event loop
            if self.before_step is not None:
                self.before_step(works)
            result: list[Sampled] = await astep(works)
            return result
        if self.step_timeout_s is None:
            return await trio.to_thread.run_sync(self._step, works)
        with trio.move_on_after(self.step_timeout_s):
            # NOTE: a thread cannot be interrupted: past the deadline it is left behind (blocked
            # in a collective on a hung rank) and the engine fails over to its error state.
            return await trio.to_thread.run_sync(self._step, works, abandon_on_cancel=True)
        raise RunnerFailure(f"a step took longer than {self.step_timeout_s:g} s (a rank hangs)")

    def _step(self, works: list[SeqWork]) -> list[Sampled]:
        if self.before_step is not None:
            self.before_step(works)
        return self.runner.step(works)
