"""The drain: stop admitting, wait for what is in flight, abort the rest, then stop.

It runs in the engine's nursery, so it completes whoever asked for it and whether they wait.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from ft.engine.lifetime import EngineState
from ft.engine.observe import EngineSnapshot
from ft.errors import RequestAborted
from ft.messages import Abort

if TYPE_CHECKING:
    from ft.engine.engine import Engine


class Drain:
    """One engine's drain: begun once (`begin`), shortened by later calls, awaited by many."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._scope: trio.CancelScope | None = None
        self._abort_timeout_s = 0.0
        self._stop_snapshot: EngineSnapshot | None = None
        self._why = "the server is stopping"  # what the aborted requests are told
        self._stopped = trio.Event()
        self.has_aborted = False  # the rest was aborted: an admission not yet open is refused too

    def begin(self, drain_timeout_s: float, abort_timeout_s: float, why: str | None = None) -> None:
        """Stop admitting now and start the drain in the engine's nursery (see `Engine.begin_stop`)."""
        engine = self._engine
        if why is not None and self._scope is None and self._stop_snapshot is None:
            self._why = why
        now = trio.current_time()
        if self._scope is not None:
            self._scope.deadline = min(self._scope.deadline, now + drain_timeout_s)
            self._abort_timeout_s = min(self._abort_timeout_s, abort_timeout_s)
            return
        if self._stop_snapshot is not None:
            return
        assert engine._nursery is not None, "the engine is not running (use open_engine)"
        if not engine.has_failed:  # a failed engine stays in ERROR: /health keeps saying why
            engine.state = EngineState.STOPPING
        self._scope = trio.CancelScope(deadline=now + drain_timeout_s)
        self._abort_timeout_s = abort_timeout_s
        engine._nursery.start_soon(self._run, self._scope)

    async def _run(self, drain_scope: trio.CancelScope) -> None:
        engine = self._engine
        with drain_scope:
            await self._wait_idle()
        self._abort_all()
        with trio.move_on_after(self._abort_timeout_s):
            await self._wait_idle()
        engine.jobs.kill_all()  # a request still in a worker holds nothing up any longer
        self._stop_snapshot = replace(engine.snapshot(), drain_complete=True)
        if not engine.has_failed:
            engine.state = EngineState.STOPPED
        self._stopped.set()

    def _abort_all(self) -> None:
        """Fail every live request with `RequestAborted` and free what it holds (synchronous)."""
        engine = self._engine
        self.has_aborted = True
        for uid in engine.registry.uids():
            engine.registry.fail(uid, RequestAborted(f"{self._why}; request aborted"))
            if engine._running is not None:
                engine._running.scheduler_inbox.send_nowait(Abort(uid))

    async def _wait_idle(self) -> None:
        """Wait until no request scope is open and no admission held (woken by each, no polling)."""
        registry, admissions = self._engine.registry, self._engine.admissions
        while len(registry) or admissions.num_admissions:
            await registry.wait_empty()
            await admissions.wait_all_released()

    async def wait(self) -> EngineSnapshot:
        """Wait for the drain `begin` started; return its final snapshot."""
        await self._stopped.wait()
        assert self._stop_snapshot is not None
        return self._stop_snapshot
