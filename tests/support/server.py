"""Servers for tests: the real app on hypercorn, on 127.0.0.1 port 0, and what to ask them."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

import httpx
import trio

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner
from ft.engine.loading import EngineHooks
from ft.server import RunningServer, ServerSettings, open_server
from tests.support.engine import fake_hooks

TEST_SETTINGS = ServerSettings(port=0, sse_heartbeat_s=0.2, graceful_timeout_s=0.5)
SERVER_FIELDS = frozenset(f.name for f in fields(ServerSettings))


@asynccontextmanager
async def running_server(
    engine_config: EngineConfig | None = None,
    *,
    hooks: EngineHooks | None = None,
    settings: ServerSettings | None = None,
    wait_ready: bool = True,
) -> AsyncIterator[RunningServer]:
    """The whole server in-process with real HTTP on 127.0.0.1:0; `.base_url` says where."""
    async with open_server(engine_config, settings or TEST_SETTINGS, hooks=hooks) as server:
        if wait_ready:
            with trio.fail_after(60):
                await server.engine.wait_ready()
        yield server


@asynccontextmanager
async def fake_server(
    runner: FakeRunner | None = None,
    *,
    settings: ServerSettings | None = None,
    before_step: Callable[[list[SeqWork]], None] | None = None,
    context_length: int = 2048,
    **options: Any,
) -> AsyncIterator[RunningServer]:
    """`running_server` on the fake model (byte tokenizer, scripted runner, inline tokenize),
    served as "fake"; `options` are `EngineConfig` or `ServerSettings` fields, by name."""
    server_options = {k: options.pop(k) for k in list(options) if k in SERVER_FIELDS}
    if server_options:
        settings = replace(settings or TEST_SETTINGS, **server_options)
    cfg = replace(EngineConfig(num_pages=256, served_model_name="fake"), **options)
    hooks = fake_hooks(runner, before_step=before_step, context_length=context_length)
    async with running_server(cfg, hooks=hooks, settings=settings) as server:
        yield server


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll `/v1/stats` until no request is active and no page used; return the snapshot
    (`timeout_s` only stops a test whose engine never goes idle)."""
    with trio.fail_after(timeout_s):
        while True:
            stats = (await client.get("/v1/stats")).json()
            if stats["requests"]["active"] == 0 and stats["kv"]["used_pages"] == 0:
                return dict(stats)
            await trio.sleep(0.02)


def parse_sse(text: str) -> list[Any]:
    """The `data:` payloads of an event stream, JSON-decoded (`[DONE]` kept as a string)."""
    out: list[Any] = []
    for frame in text.split("\n\n"):
        for line in frame.split("\n"):
            if line.startswith("data: "):
                payload = line[6:]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@asynccontextmanager
async def health_watch(base_url: str, period_s: float = 0.02) -> AsyncIterator[list[float]]:
    """Poll `/health` in the background while the block runs; yield the latencies (seconds).

    On leaving, waits for two more answers, so a poll stuck behind a blocked loop is counted.
    The block runs with the heap frozen (`frozen_heap`), as `ft serve` runs once its model
    has loaded.
    """
    latencies: list[float] = []
    with frozen_heap():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as c, trio.open_nursery() as nursery:

            async def poll() -> None:
                while True:
                    started = trio.current_time()
                    assert (await c.get("/health")).status_code == 200
                    latencies.append(trio.current_time() - started)
                    await trio.sleep(period_s)

            nursery.start_soon(poll)
            while not latencies:
                await trio.sleep(0.005)
            yield latencies
            seen = len(latencies)
            while len(latencies) < seen + 2:
                await trio.sleep(0.005)
            nursery.cancel_scope.cancel()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The block runs with the objects alive at its start (garbage among them) in the
    collector's permanent generation (`gc.freeze`), as `ft serve` freezes its heap once loaded:
    a full collection of this test process's heap (torch, transformers and a thousand tests:
    0.3-0.7 s) would stall the loop a latency test measures, where a server's collections scan
    only what it made since. Unfrozen on leaving, unless something outside had frozen it."""
    was_frozen = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not was_frozen:
            gc.unfreeze()


ENGINE_TASKS = "ft.actors."  # the fake engine's actors: they step on the loop (its runner too)


@dataclass
class LoopLoad:
    """CPU time (seconds) of a block: each task's longest step on the event loop's thread, and
    what the process's other threads (the workers) did meanwhile."""

    longest_steps: dict[str, float] = field(default_factory=dict)  # by task name
    off_loop_s: float = 0.0

    @property
    def longest_step_s(self) -> float:
        """The longest step of a task outside the engine (the fake engine's steps grow with the
        request too, and are not what a route does on the loop)."""
        return max(
            (t for name, t in self.longest_steps.items() if not name.startswith(ENGINE_TASKS)), default=0.0
        )


class _StepTimer(trio.abc.Instrument):
    """Measures each task step's CPU time on the loop's thread (waiting for the GIL is not CPU:
    a step that waits on a worker holding it is not charged for the worker's work)."""

    def __init__(self, load: LoopLoad) -> None:
        self.load = load
        self.started = time.thread_time()  # the step that adds the instrument started before it

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        spent = time.thread_time() - self.started
        steps = self.load.longest_steps
        steps[task.name] = max(spent, steps.get(task.name, 0.0))


@asynccontextmanager
async def loop_load() -> AsyncIterator[LoopLoad]:
    """Measure the block's work on and off the event loop (filled in on leaving).

    "Built off the loop" is then a ratio: the longest step of a task on the loop is a small part
    of what the workers did, where a body built on the loop is one step as long as the build.
    (A wall-clock bound on /health cannot tell: here a 112k-entry body takes 0.1 s to build,
    within any bound a noisy CI machine leaves room for, and a poll sees a stall only when it
    is in flight.)
    """
    load = LoopLoad()
    timer = _StepTimer(load)
    process_started, loop_started = time.process_time(), time.thread_time()
    trio.lowlevel.add_instrument(timer)
    try:
        yield load
    finally:
        trio.lowlevel.remove_instrument(timer)
        load.off_loop_s = (time.process_time() - process_started) - (time.thread_time() - loop_started)
