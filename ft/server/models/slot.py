"""One served model (`ModelSlot`: its status, engine, users and cost), a request's hold on it
(`Lease`), and the memory a model's unload gives back (`rss_bytes`, `release_memory`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import gc
import os
from typing import TYPE_CHECKING

import trio

from ft.config import EngineConfig
from ft.engine.engine import Engine, EngineState
from ft.errors import EngineStopping, FtError
from ft.model_names import model_names
from ft.server.edge.http_errors import HttpError
from ft.server.models.options import ServedModel, file_bytes

if TYPE_CHECKING:
    from ft.server.models.router import ModelRouter


class ModelStatus(enum.StrEnum):
    """Where a served model is (a `str`: `/v1/models` sends its value)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    UNLOADING = "unloading"


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
        self.pooling: str | None = None  # how it pooled at its last load (None: never loaded)
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
