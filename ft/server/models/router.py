"""`ModelRouter`: the models of one server, their engines' tasks, loading on demand, eviction
and the idle sweeper (see the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import trio

from ft.config import DEFAULT_ABORT_TIMEOUT_S, EngineConfig
from ft.engine.engine import Engine, EngineState, open_engine
from ft.engine.loading import EngineHooks
from ft.errors import EngineStopping
from ft.logs import REQUEST_ID
from ft.server.edge.http_errors import HttpError
from ft.server.models import slot as slots
from ft.server.models.options import RouterSettings
from ft.server.models.slot import Lease, ModelSlot, ModelStatus, model_not_found, rss_bytes

log = logging.getLogger("ft.server")

SWEEP_PERIOD_S = 1.0  # the idle sweeper's longest sleep (shorter for a shorter idle time)


class ModelRouter:
    """The models of one server and their engines; run it with `run` in a nursery."""

    def __init__(
        self,
        base: EngineConfig,
        settings: RouterSettings,
        *,
        hooks: EngineHooks | None = None,
        on_engine: Callable[[Engine], None] = lambda engine: None,
    ) -> None:
        self.settings = settings
        self.hooks = hooks
        self.on_engine = on_engine  # called with each engine as it starts (the metrics watch it)
        self.slots = [
            ModelSlot(m, replace(base, model=m.path, served_model_name=(m.name,))) for m in settings.models
        ]
        self.is_stopping = False
        self._nursery: trio.Nursery | None = None
        self._load_lock = trio.Lock()  # one load (and its eviction) at a time
        self._changed = trio.Event()  # any slot's status or leases changed

    # --- lookup -------------------------------------------------------------------------------

    @property
    def default(self) -> ModelSlot:
        """The first model: what a request without `model` gets."""
        return self.slots[0]

    def find(self, model: str | None) -> ModelSlot:
        """The slot a request's `model` names (None or "": the default). Raises 404."""
        if not model:
            return self.default
        for slot in self.slots:
            if slot.name == model:
                return slot
        for slot in self.slots:
            if slot.names.accepts(model):
                return slot
        raise model_not_found(model, [s.name for s in self.slots])

    def engines(self) -> Iterator[Engine]:
        """The engines that exist now (loading, loaded or unloading)."""
        return (s.engine for s in self.slots if s.engine is not None)

    def lease(self, slot: ModelSlot) -> Lease:
        """Hold `slot` busy (never evicted) until the lease is released."""
        return Lease(self, slot)

    def notify(self) -> None:
        """Wake whoever waits for room (a lease ended, a status changed)."""
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    # --- the router's lifetime ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the models' engines (and the idle sweeper) until cancelled; then close them all."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.settings.sleep_idle_s is not None:
                nursery.start_soon(self._sweep_idle, self.settings.sleep_idle_s)
            task_status.started()
            await trio.sleep_forever()

    def begin_stop(self, drain_timeout_s: float, abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S) -> None:
        """Stop every engine (each drains as `Engine.begin_stop` does); no model loads again."""
        self.is_stopping = True
        for slot in self.slots:
            if slot.engine is not None:
                slot.engine.begin_stop(drain_timeout_s, abort_timeout_s)
            if slot._stop is not None:
                slot._stop.set()
        self.notify()

    async def wait_stopped(self) -> None:
        """Wait until no model holds an engine."""
        while any(s.is_resident for s in self.slots):
            await self._wait_any_change()

    async def _wait_any_change(self) -> None:
        changed = self._changed
        await changed.wait()

    # --- loading ------------------------------------------------------------------------------

    def deadlines(self) -> tuple[float, float]:
        """A request's deadlines from now (trio time): for its model's load, and for room."""
        now = trio.current_time()
        return now + self.settings.load_timeout_s, now + self.settings.busy_timeout_s

    async def acquire(
        self, slot: ModelSlot, deadline: float | None = None, busy_deadline: float | None = None
    ) -> Engine:
        """The slot's engine, loaded first when it is not (the caller holds a lease on it).

        Waits at most until `deadline` (trio time; default `load_timeout_s` from now), and for
        room at most until `busy_deadline` (default `busy_timeout_s` from now): a caller that
        retries (a stream between heartbeats) passes the same ones each time.

        Raises:
            EngineStopping: the model failed to load (its error), the load timed out, or the
                server is stopping (503).
            HttpError: every loaded model is busy past `busy_timeout_s` (503 `models_busy`).
        """
        load_by, room_by = self.deadlines()
        deadline = load_by if deadline is None else deadline
        busy_deadline = room_by if busy_deadline is None else busy_deadline
        with trio.move_on_at(deadline):
            while True:
                engine = slot.ready_engine()
                if engine is not None:
                    return engine
                if self.is_stopping:
                    raise EngineStopping("the server is stopping and admits no new requests")
                if slot.status == ModelStatus.FAILED:
                    raise slot.refusal()
                if slot.status == ModelStatus.UNLOADED:
                    await self._load(slot, busy_deadline)
                    continue
                closing = slot.engine
                if closing is not None and closing.has_failed:  # its runner failed: FAILED once closed
                    raise EngineStopping(
                        f"the model '{slot.name}' failed: {closing.error}", code="engine_error"
                    )
                await slot.wait_changed()  # loading or unloading
        raise EngineStopping(
            f"the model '{slot.name}' did not load within {self.settings.load_timeout_s:g} s; retry later",
            code="model_loading",
        )

    def check_loadable(self, slot: ModelSlot) -> None:
        """Raise what `acquire` would raise at once: the model failed, or the server stops."""
        if self.is_stopping:
            raise EngineStopping("the server is stopping and admits no new requests")
        if slot.status == ModelStatus.FAILED:
            raise slot.refusal()

    async def load(self, slot: ModelSlot) -> None:
        """Load `slot` now (an admin's `/v1/models/load`): a failed model is tried again.

        Returns once it is loaded. Raises as `acquire` does.
        """
        lease = self.lease(slot)
        try:
            if slot.status == ModelStatus.FAILED:
                slot.set_status(ModelStatus.UNLOADED)
            await self.acquire(slot)
        finally:
            lease.release()

    async def _load(self, slot: ModelSlot, busy_deadline: float) -> None:
        """Make room for `slot` (by `busy_deadline`) and start its engine task; return once it
        has loaded or failed."""
        async with self._load_lock:
            if slot.status != ModelStatus.UNLOADED or self.is_stopping:
                return
            await self._make_room(slot, busy_deadline)
            assert self._nursery is not None, "the router is not running"
            slot.rss_before_load = rss_bytes()
            await self._nursery.start(self._serve_model, slot)
            # One load at a time (their measured growth is theirs alone): wait for this one.
            await slot.wait_loading_done()

    def _needs_room(self, slot: ModelSlot) -> bool:
        """Whether loading `slot` now would pass `max_loaded` or `memory_bytes`."""
        others = [s for s in self.slots if s is not slot and s.is_resident]
        if not others:
            return False  # alone it loads, even past the budget: nothing else could make room
        s = self.settings
        if s.max_loaded is not None and len(others) + 1 > s.max_loaded:
            return True
        return s.memory_bytes is not None and sum(o.cost for o in others) + slot.cost > s.memory_bytes

    async def _make_room(self, slot: ModelSlot, busy_deadline: float) -> None:
        """Unload the least recently used idle models until `slot` fits.

        Raises:
            HttpError: 503 `models_busy` when every model in the way stays busy past
                `busy_deadline`.
        """
        with trio.move_on_at(busy_deadline):
            while self._needs_room(slot):
                idle = [
                    s
                    for s in self.slots
                    if s is not slot and s.status == ModelStatus.LOADED and not s.is_busy
                ]
                if idle:
                    victim = min(idle, key=lambda s: s.last_used)
                    log.info("unloading model %r (least recently used) to load %r", victim.name, slot.name)
                    self.unload(victim)
                await self._wait_any_change()
            return
        if not self._needs_room(slot):
            return
        raise HttpError(
            503,
            f"every loaded model is busy; '{slot.name}' cannot be loaded until one is idle (retry later)",
            type="overloaded_error",
            code="models_busy",
            headers={"Retry-After": "5"},
        )

    def unload(self, slot: ModelSlot) -> None:
        """Begin unloading `slot` (idempotent; nothing happens to a model not loaded)."""
        if slot._stop is not None:
            slot._stop.set()

    async def wait_unloaded(self, slot: ModelSlot) -> None:
        """Wait until `slot` holds no engine."""
        while slot.is_resident:
            await slot.wait_changed()

    async def _serve_model(self, slot: ModelSlot, *, task_status: trio.TaskStatus[None]) -> None:
        """The slot's engine for as long as it is loaded: load, serve, drain, close, free."""
        REQUEST_ID.set(None)  # started by a request, but the model's life is not that request's
        slot._stop = stop = trio.Event()
        slot.set_status(ModelStatus.LOADING)
        self.notify()
        task_status.started()
        failure: str | None = None
        try:
            failure = await self._run_engine(slot, stop)
        except Exception as e:  # noqa: BLE001 - this model's failure, kept as its error
            failure = f"{type(e).__name__}: {e}"
        finally:
            slot.engine = None
            slot._stop = None
            # NOTE: the engine's frame is gone (`_run_engine` returned), so its tensors are
            # only cycles now: collected here, and the heap trimmed.
            slots.release_memory()  # looked up when called: a measuring tool may swap it
            if failure is not None:
                log.error("model %r failed: %s", slot.name, failure)
                slot.set_status(ModelStatus.FAILED, failure)
            else:
                log.info("model %r unloaded", slot.name)
                slot.set_status(ModelStatus.UNLOADED)
            self.notify()

    async def _run_engine(self, slot: ModelSlot, stop: trio.Event) -> str | None:
        """Open the slot's engine, serve until `stop` (then drain it) or its failure; the error."""
        async with open_engine(slot.config, hooks=self.hooks, wait_ready=False) as engine:
            slot.engine = engine
            self.on_engine(engine)
            failure = await self._wait_loaded(engine, stop)
            if failure is not None:
                return failure
            if not stop.is_set():
                slot.loaded_bytes = max(0, rss_bytes() - slot.rss_before_load)
                slot.kv_bytes = engine.kv_cache_bytes
                slot.max_model_len = engine.max_model_len
                slot.pooling = engine.pooling
                slot.set_status(ModelStatus.LOADED)
                log.info("model %r loaded (%.1f MiB resident more)", slot.name, slot.loaded_bytes / 2**20)
                self.notify()
                failure = await self._wait_stop_or_failure(engine, stop)
                if failure is not None:
                    return failure
            slot.set_status(ModelStatus.UNLOADING)
            self.notify()
            why = "the server is stopping" if self.is_stopping else f"the model '{slot.name}' is unloading"
            engine.begin_stop(self.settings.unload_timeout_s, DEFAULT_ABORT_TIMEOUT_S, why=why)
            await engine.wait_stopped()
        return None

    async def _wait_loaded(self, engine: Engine, stop: trio.Event) -> str | None:
        """Wait for the engine's load (bounded by `load_timeout_s`) or an unload; the error."""
        with trio.move_on_after(self.settings.load_timeout_s) as scope:
            async with trio.open_nursery() as nursery:

                async def on_stop() -> None:
                    await stop.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(on_stop)
                await engine._ready.wait()
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            return f"the model did not load within {self.settings.load_timeout_s:g} s"
        if engine.state == EngineState.ERROR:
            return engine.error or "the model failed to load"
        return None

    async def _wait_stop_or_failure(self, engine: Engine, stop: trio.Event) -> str | None:
        """Wait until an unload is asked for (None) or the engine fails for good (why)."""
        outcome: list[str | None] = []
        async with trio.open_nursery() as nursery:

            async def on_stop() -> None:
                await stop.wait()
                outcome.append(None)
                nursery.cancel_scope.cancel()

            async def on_failure() -> None:
                outcome.append(await engine.wait_failed())
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_stop)
            nursery.start_soon(on_failure)
        return outcome[0]

    async def _sweep_idle(self, sleep_idle_s: float) -> None:
        """Unload each loaded model that nobody used for `sleep_idle_s`."""
        period = min(SWEEP_PERIOD_S, sleep_idle_s / 4)
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            for slot in self.slots:
                is_idle = slot.status == ModelStatus.LOADED and not slot.is_busy
                if is_idle and now - slot.last_used >= sleep_idle_s:
                    log.info("model %r idle for %.0f s: unloading", slot.name, now - slot.last_used)
                    self.unload(slot)
