"""The server on the default model with `--prompt-cache-dir`, over HTTP: a FIFO put in place of a
page's file after the start (the file was indexed, so the prompt's prefix is read from disk) is
a miss, and the request is answered (it waited until the step timeout and failed with a 500)."""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.model import kernels
from tests.support.server import running_server

pytestmark = [
    pytest.mark.slow,  # the real default model, started twice
    pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels"),
]

PROMPT = "Count along: " + " ".join(str(i) for i in range(60)) + "."  # ~190 tokens: 11 full pages
GREEDY: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
STEP_TIMEOUT_S = 20.0  # a step blocked on the FIFO fails every request after this


def config(directory: pathlib.Path) -> EngineConfig:
    return EngineConfig(prompt_cache_dir=str(directory), compute_threads=1, step_timeout_s=STEP_TIMEOUT_S)


async def disk_stats(client: httpx.AsyncClient) -> dict[str, Any]:
    stats: dict[str, Any] = (await client.get("/v1/stats")).json()["prompt_cache"]["disk"]
    return stats


def release(path: pathlib.Path) -> None:
    """Let a reader blocked opening the FIFO at `path` go (opening it to write needs a reader)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


async def test_a_fifo_in_place_of_a_cached_page_is_a_miss_and_the_request_answers(
    tmp_path: pathlib.Path,
) -> None:
    with trio.fail_after(300):
        async with running_server(config(tmp_path)) as s, httpx.AsyncClient(base_url=s.base_url) as client:
            assert (await client.post("/v1/completions", json=GREEDY, timeout=60)).status_code == 200
            while (await disk_stats(client))["writes"] < 4:
                await trio.sleep(0.05)
    pages = sorted(tmp_path.glob("v*-*/*.kv"))
    assert len(pages) >= 4
    async with running_server(config(tmp_path)) as s, httpx.AsyncClient(base_url=s.base_url) as client:
        assert (await disk_stats(client))["files"] == len(pages)  # indexed at the start
        for path in pages:
            path.unlink()
            os.mkfifo(path)
        try:
            with trio.fail_after(2 * STEP_TIMEOUT_S + 20):
                response = await client.post("/v1/completions", json=GREEDY, timeout=2 * STEP_TIMEOUT_S + 20)
        finally:
            for path in pages:
                release(path)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        disk = await disk_stats(client)
        assert disk["corrupt"] >= 1 and disk["hits"] == 0
        assert (await client.get("/health")).status_code == 200
