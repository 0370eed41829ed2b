"""Several models in one server: the router (`ModelRouter`) and what it routes by.

Router mode is on when `ft serve` is given several `--model`s, a `--models-dir`, or any of
`--models-max`, `--models-memory`, `--sleep-idle-seconds` (`RouterSettings`). Each model is a
`ModelSlot`: its own `open_engine` scope, run as a task in the router's nursery when it loads,
with its own scopes, workers and KV pool. A slot is `unloaded`, `loading`, `loaded`, `failed`
(the load's error kept until an admin load retries it) or `unloading`.

A request names its model (`find`, the `ModelNames.accepts` rules per model; none: the first
model) and holds a `Lease` on its slot until the HTTP request ends: a leased slot is busy, and
a busy slot is never evicted. `acquire` loads an unloaded model on demand, first making room
under `max_loaded` and `memory_bytes` by unloading the least recently used idle models (one
load at a time); when every loaded model is busy it waits up to `busy_timeout_s`, then refuses
with 503 `models_busy` and `Retry-After`. An idle model unused for `sleep_idle_s` is unloaded
by the sweeper; probes, metrics, `/v1/models` and `/v1/stats` take no lease, so they neither
count as use nor wake a model.

Unloading is the engine's drain (`Engine.begin_stop`): new requests for the model wait for it
to finish unloading (and then load it again), live ones get `unload_timeout_s` and are then
aborted with an in-stream error; the engine's scope closes, and the process gives the freed
memory back (`gc.collect`, then glibc's `malloc_trim(0)`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import gc
import logging
import os
import pathlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import trio

from ft.config import DEFAULT_ABORT_TIMEOUT_S, DEFAULT_DRAIN_TIMEOUT_S, EngineConfig
from ft.engine.engine import Engine, EngineState, open_engine
from ft.engine.loading import EngineHooks
from ft.errors import EngineStopping, FtError
from ft.logs import REQUEST_ID
from ft.model_names import model_names, name_key
from ft.server.edge.http_errors import HttpError

log = logging.getLogger("ft.server")

# Split GGUF shards (`name-00001-of-00003.gguf`): one model, named without the suffix.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})$")
SWEEP_PERIOD_S = 1.0  # the idle sweeper's longest sleep (shorter for a shorter idle time)


class ModelStatus(enum.StrEnum):
    """Where a served model is (a `str`: `/v1/models` sends its value)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model the router serves: its name (the id it is listed and answers under) and path."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The models of a router-mode server and the rules for loading and unloading them.

    `max_loaded`: the most models loaded at once (None: no limit). `memory_bytes`: the most the
    loaded models may cost together (`ModelSlot.cost`; None: no budget). `sleep_idle_s`: a
    model nobody used for that long is unloaded (None: never). `load_timeout_s` bounds a
    request's wait for its model's load (and the load itself), `busy_timeout_s` its wait for
    room when every loaded model is busy, `unload_timeout_s` the wait for a model's requests
    before an unload aborts them.
    """

    models: tuple[ServedModel, ...]
    max_loaded: int | None = None
    memory_bytes: int | None = None
    sleep_idle_s: float | None = None
    load_timeout_s: float = 600.0
    busy_timeout_s: float = 30.0
    unload_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("router mode needs at least one model (--model or --models-dir)")
        keys: dict[str, str] = {}
        for m in self.models:
            if not m.name or len(m.name) > 256 or not m.name.isprintable():
                raise ValueError(f"a model name must be 1..256 printable characters, got {m.name!r}")
            key = name_key(m.name)
            if key in keys:
                raise ValueError(f"two models are named {keys[key]!r} and {m.name!r}; name one NAME=PATH")
            keys[key] = m.name
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError(f"models_max must be at least 1, got {self.max_loaded}")
        if self.memory_bytes is not None and self.memory_bytes < 1 << 20:
            raise ValueError(f"models_memory must be at least 1 MiB, got {self.memory_bytes}")
        if self.sleep_idle_s is not None and not 0 < self.sleep_idle_s <= 7 * 86400:
            raise ValueError(f"sleep_idle_seconds must be in (0, 604800], got {self.sleep_idle_s}")
        for name in ("load_timeout_s", "busy_timeout_s", "unload_timeout_s"):
            if not 0 <= getattr(self, name) <= 86400:
                raise ValueError(f"{name} must be in 0..86400, got {getattr(self, name)}")


def parse_model_option(text: str) -> ServedModel:
    """`--model PATH` or `--model NAME=PATH` (a name has no `/`; an existing path wins)."""
    name, sep, path = text.partition("=")
    if sep and name and path and "/" not in name and "\\" not in name and not os.path.exists(text):
        return ServedModel(name, path)
    return ServedModel(model_names(text).id, text)


def discover_models(directory: str) -> list[ServedModel]:
    """Every model in `directory`, by name: each `*.gguf` file (a split GGUF's shards are one
    model, its first shard loaded) and each folder holding a Hugging Face `config.json`.

    Raises:
        ValueError: `directory` is not a folder, or holds no model.
    """
    root = pathlib.Path(directory)
    if not root.is_dir():
        raise ValueError(f"--models-dir {directory!r} is not a folder")
    found: list[ServedModel] = []
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix.lower() == ".gguf":
            shard = _SHARD.match(entry.stem)
            if shard is None:
                found.append(ServedModel(entry.stem, str(entry)))
            elif int(shard["part"]) == 1:
                found.append(ServedModel(shard["stem"], str(entry)))
        elif entry.is_dir() and (entry / "config.json").is_file():
            found.append(ServedModel(entry.name, str(entry)))
    if not found:
        raise ValueError(f"--models-dir {directory!r} holds no *.gguf file and no model folder")
    return found


def file_bytes(path: str) -> int:
    """The bytes of a model's weights on disk: the file, every shard of a split GGUF, or a
    folder's weight files (0 where none can be read)."""
    p = pathlib.Path(path)
    try:
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
        shard = _SHARD.match(p.stem)
        if shard is not None:
            return sum(f.stat().st_size for f in p.parent.glob(f"{shard['stem']}-*-of-{shard['count']}.gguf"))
        return p.stat().st_size
    except OSError:
        return 0


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory() -> None:
    """Give freed memory back: collect cycles (the engine's tensors), then ask glibc to return
    its free heap pages to the system (`malloc_trim(0)`; nothing elsewhere)."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    try:
        libc = ctypes.CDLL(libc_name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return  # not glibc
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def model_not_found(model: str, served: list[str]) -> HttpError:
    """The 404 for a `model` no slot serves (OpenAI's `model_not_found`; Anthropic's dialect
    renders it as `not_found_error`)."""
    shown = ", ".join(f"'{n}'" for n in served[:16])
    return HttpError(
        404,
        f"the model '{model[:256]}' does not exist; this server serves {shown}",
        param="model",
        code="model_not_found",
    )


class ModelSlot:
    """One served model: its config and names, its status, its engine while it has one, and
    who uses it (leases; the last use's time)."""

    def __init__(self, model: ServedModel, config: EngineConfig) -> None:
        self.name = model.name
        self.path = model.path
        self.config = config
        self.names = model_names(model.path, (model.name,))
        self.status = ModelStatus.UNLOADED
        self.error: str | None = None
        self.engine: Engine | None = None
        self.num_users = 0  # leases held: HTTP requests using (or waiting for) this model
        self.last_used = trio.current_time()
        self.file_bytes = file_bytes(model.path)
        self.loaded_bytes = 0  # weights' cost measured at its last load (RSS growth, >= file)
        self.kv_bytes = 0  # the KV pool's bytes, as its engine reported them at its last load
        self.max_model_len = 0  # its context at its last load (0: never loaded)
        self.rss_before_load = 0
        self._changed = trio.Event()
        self._stop: trio.Event | None = None  # set: unload now (the engine task drains and exits)

    @property
    def cost(self) -> int:
        """What the model costs loaded, against `--models-memory`: its weights (the RSS growth
        its load measured, at least its file size; the file size before its first load) plus
        its KV pool as the engine sized it (before its first load: `--kv-cache-memory`)."""
        return max(self.loaded_bytes, self.file_bytes) + (self.kv_bytes or self.config.kv_cache_memory)

    @property
    def is_resident(self) -> bool:
        """Whether it holds (or is acquiring, or still releasing) an engine's memory."""
        return self.status in (ModelStatus.LOADING, ModelStatus.LOADED, ModelStatus.UNLOADING)

    @property
    def is_busy(self) -> bool:
        """Whether a request holds it (or its engine still has requests)."""
        engine = self.engine
        return self.num_users > 0 or (engine is not None and len(engine.registry) > 0)

    def ready_engine(self) -> Engine | None:
        """Its engine when it is loaded and admitting, else None."""
        engine = self.engine
        if self.status == ModelStatus.LOADED and engine is not None and engine.state == EngineState.READY:
            return engine
        return None

    def set_status(self, status: ModelStatus, error: str | None = None) -> None:
        """Change the status and wake whoever waits for a change (synchronous)."""
        self.status, self.error = status, error
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def wait_changed(self) -> None:
        """Wait for the next status change."""
        await self._changed.wait()

    async def wait_loading_done(self) -> None:
        """Wait until it is no longer loading (loaded, failed, or unloading already)."""
        while self.status == ModelStatus.LOADING:
            await self.wait_changed()

    def refusal(self) -> FtError:
        """The error a request for this failed model gets: the load's error, as a 503."""
        return EngineStopping(
            f"the model '{self.name}' failed to load: {self.error}", code="model_load_failed"
        )


class Lease:
    """A request's hold on a slot: the slot is busy until `release` (idempotent, synchronous)."""

    def __init__(self, router: ModelRouter, slot: ModelSlot) -> None:
        self.router, self.slot = router, slot
        self.is_released = False
        slot.num_users += 1
        slot.last_used = trio.current_time()

    def release(self) -> None:
        """Let the slot go (it counts as used now); safe to call from a cancelled task."""
        if self.is_released:
            return
        self.is_released = True
        self.slot.num_users -= 1
        self.slot.last_used = trio.current_time()
        self.router.notify()


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
            release_memory()
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
