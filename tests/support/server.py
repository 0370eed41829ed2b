"""Servers for tests: the real app on hypercorn, on 127.0.0.1 port 0, and what to ask them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import fields, replace
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


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 5.0) -> dict[str, Any]:
    """Poll `/v1/stats` until no request is active and no page used; return the snapshot."""
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
    """
    latencies: list[float] = []
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
