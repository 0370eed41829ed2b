"""The step watchdog: fails the engine when work waits and nothing moves in time (no step
completes, and the step in flight makes no progress), or when the model says it can run no more
(a tensor-parallel rank process died).

One task in the engine's nursery, whatever the model runs on (one CPU process, CUDA, ranks):
it reads the runner actor's `step_started_at` / `num_steps` / `progress` and the scheduler
core's pending work every `period_s`, so it catches a step that stops moving (a hung kernel or
collective) and a scheduler that stops scheduling while requests wait alike. It decides; the
engine acts (`on_stall`: fail every request, turn to its error state, `ft serve` exits 1).

`progress` is the runner's heartbeat, beaten by the forward pass once a layer and once a block
of scored rows: a step that runs past the timeout while it beats (a long prompt on a loaded
machine) is slow, not hung, and is left to finish. Only a step whose heartbeat has not moved
for `step_timeout_s` is a stall. A runner without a heartbeat (progress stays 0) is judged by
whole steps alone.

NOTE: the step timeout measures time without progress inside steps (forward, collectives,
sampling and the grammar masks computed beside them), not time spent waiting for work. A
constrained step's masks have a deadline of their own, far below the default 60 s: a grammar
over it fails its own request inside the step, so a slow grammar is never taken for a hung
rank. Slow steps that each complete are progress, not a stall, however long a request takes.
On CUDA the layers beat as they are queued, ahead of the device: a kernel that hangs stops the
beats at the step's next wait on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import trio

log = logging.getLogger("ft.engine")

# Seconds between checks at most: a dead rank is noticed within this, whatever the timeout.
CHECK_PERIOD_S = 0.5


class StepClock(Protocol):
    """What the watchdog reads of the runner actor."""

    step_started_at: float | None
    num_steps: int

    @property
    def progress(self) -> int:
        """Heartbeat beats inside steps so far (0 when the runner has none)."""
        ...


class PendingWork(Protocol):
    """What the watchdog reads of the scheduler core."""

    @property
    def has_work(self) -> bool: ...

    @property
    def num_running_requests(self) -> int: ...

    @property
    def num_waiting_requests(self) -> int: ...


class Watchdog:
    """Reports a stall once: `on_stall(reason)` is called and the watch ends."""

    def __init__(
        self,
        runner: StepClock,
        core: PendingWork,
        *,
        step_timeout_s: float,
        on_stall: Callable[[str], None],
        model_failure: Callable[[], str | None] | None = None,
    ) -> None:
        self.runner = runner
        self.core = core
        self.step_timeout_s = step_timeout_s
        self.on_stall = on_stall
        self.model_failure = model_failure
        self.period_s = min(CHECK_PERIOD_S, step_timeout_s / 4)
        self._seen_steps = runner.num_steps
        self._seen_progress = runner.progress
        self._progress_at = trio.current_time()  # when work last moved (a step done or beating, or idle)
        self._checked_at = self._progress_at
        self._was_late = False  # the last check came late and did not judge

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check every `period_s` until a stall is reported (then return) or the task is cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self.period_s)
            reason = self.check(trio.current_time())
            if reason is not None:
                log.error("watchdog: %s", reason)
                self.on_stall(reason)
                return

    def check(self, now: float) -> str | None:
        """Why the engine cannot go on at `now` (None while it can). Synchronous."""
        # NOTE: a check far past its period means the event loop was blocked: a step may have
        # ended meanwhile with nobody to record it yet (the runner's task wakes with this one).
        # Judge one period later, once the loop has run; never skip two checks in a row.
        is_late = now - self._checked_at > 2 * self.period_s and not self._was_late
        self._checked_at, self._was_late = now, is_late
        if self.model_failure is not None and (failure := self.model_failure()) is not None:
            return failure
        started = self.runner.step_started_at
        if started is None and not self.core.has_work:
            self._progress_at = now  # idle: nothing to wait for
            return None
        num_steps, progress = self.runner.num_steps, self.runner.progress
        if num_steps != self._seen_steps or progress != self._seen_progress:
            self._seen_steps, self._seen_progress, self._progress_at = num_steps, progress, now
            return None
        if is_late:
            return None
        # The stall began at the last progress, or when the step in flight began if later.
        since = self._progress_at if started is None else max(self._progress_at, started)
        if now - since < self.step_timeout_s:
            return None
        num_requests = self.core.num_running_requests + self.core.num_waiting_requests
        if started is not None:
            why = (
                f"a step has run for {now - started:.1f} s, the last {now - since:.1f} s without "
                "progress: the model or a tensor-parallel rank hangs"
            )
        else:
            why = "none was scheduled: the scheduler is stuck"
        return f"no step completed for {self.step_timeout_s:g} s while {num_requests} requests wait ({why})"
