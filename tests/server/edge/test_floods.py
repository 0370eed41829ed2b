"""Floods of large bodies leave the event loop free: `/health` answers while they arrive (issue 18)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from ft.server import RunningServer
from tests.support.engine import fake_hooks
from tests.support.server import fake_server, frozen_heap, running_server, wait_idle

NUM_BODIES = 100
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# ~0.9 MB each: a list of 300,000 small integers costs the most per byte to walk in Python.
UNKNOWN_FIELD = json.dumps(CHAT | {"zzz": [7] * 300_000}).encode()
TEMPLATE_KWARGS = json.dumps(CHAT | {"chat_template_kwargs": {"zzz": [7] * 300_000}}).encode()


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def flood(server: RunningServer, body: bytes, tmp_path: Path) -> list[float]:
    """POST `NUM_BODIES` copies of `body` at once from another process (`tests.support.flood`);
    return the `/health` latencies it saw meanwhile."""
    body_file = tmp_path / "body.json"
    body_file.write_bytes(body)
    url = urlsplit(server.base_url)
    argv = [sys.executable, "-m", "tests.support.flood"]
    argv += [str(url.hostname), str(url.port), "/v1/chat/completions", str(body_file), str(NUM_BODIES)]
    with trio.fail_after(180), frozen_heap():  # as `ft serve` runs
        done = await trio.run_process(argv, capture_stdout=True, cwd=Path(__file__).parents[3])
    result = json.loads(done.stdout)
    assert result["statuses"] == [200] * NUM_BODIES, result["statuses"]
    return list(result["latencies"])


def assert_loop_free(latencies: list[float]) -> None:
    # NOTE: p99, not the maximum: the first probe races 100 connections opening at once, which
    # costs the loop what 100 tiny requests cost (0.3-0.5 s on a loaded 2-core machine). Before
    # the fix p99 was 6.7-29.8 s there; 2 s leaves a slower CPU room and still tells.
    assert p99(latencies) < 2.0, (p99(latencies), max(latencies))


@pytest.mark.slow  # ~30 s: 100 MB through the server
async def test_health_answers_while_100_large_bodies_arrive(tmp_path: Path) -> None:
    """100 concurrent ~1 MB bodies with an unknown field keep `/health` p99 under 2 s."""
    async with fake_server() as s:
        assert_loop_free(await flood(s, UNKNOWN_FIELD, tmp_path))
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            await wait_idle(c)


@pytest.mark.slow
async def test_health_answers_while_100_large_template_kwargs_are_tokenized(tmp_path: Path) -> None:
    """100 concurrent ~1 MB `chat_template_kwargs` (encoded for the tokenizer's worker processes)
    keep `/health` p99 under 2 s."""
    async with running_server(hooks=fake_hooks(executor=None)) as s:
        assert_loop_free(await flood(s, TEMPLATE_KWARGS, tmp_path))
