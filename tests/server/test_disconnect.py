"""A client that leaves frees everything its request held (real sockets, fake model)."""

from __future__ import annotations

import httpx
import trio

from ft.engine.fake import FakeRunner, text_script
from tests.support.server import fake_server, parse_sse, wait_idle

USER = [{"role": "user", "content": "hi"}]
LONG = "lorem ipsum " * 200


async def test_disconnect_mid_stream_frees_the_request() -> None:
    """A client that closes a stream mid-way frees its request and pages; it counts as aborted."""
    runner = FakeRunner(script=text_script(LONG), step_s=0.02)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        body = {"messages": USER, "stream": True, "max_tokens": 1000}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 5:
                    break
            stats = (await c.get("/v1/stats")).json()
            assert stats["requests"]["active"] == 1 and stats["kv"]["used_pages"] > 0
        # leaving the block closed the connection mid-stream
        stats = await wait_idle(c)
        assert stats["requests"]["aborted"] == 1


async def test_disconnect_while_queued_frees_the_request() -> None:
    """A queued stream's client leaving frees its place; `: connected` came before the queue wait."""
    runner = FakeRunner(script=text_script(LONG), step_s=0.02)
    async with (
        fake_server(runner, max_running_requests=1) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        body = {"messages": USER, "stream": True, "max_tokens": 1000}
        async with c.stream("POST", "/v1/chat/completions", json=body) as first:
            lines = first.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            async with c.stream("POST", "/v1/chat/completions", json=body) as second:
                raw = second.aiter_raw()  # keep a reference: collecting it closes the stream
                assert (await raw.__anext__()).startswith(b": connected")
                with trio.fail_after(30):  # `: connected` goes out before the request opens
                    while (await c.get("/v1/stats")).json()["requests"]["waiting"] != 1:
                        await trio.sleep(0.01)
        await wait_idle(c)


async def test_disconnect_during_a_non_streamed_request_frees_it() -> None:
    """A client that gives up on a non-streamed request frees it too."""
    runner = FakeRunner(script=text_script(LONG), step_s=0.02)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        body = {"messages": USER, "max_tokens": 1000}
        with trio.move_on_after(0.3):
            await c.post("/v1/chat/completions", json=body)
        await wait_idle(c)


async def test_multi_prompt_stream_disconnect_frees_every_prompt() -> None:
    """Leaving a multi-prompt completions stream frees every prompt's request."""
    runner = FakeRunner(script=text_script(LONG), step_s=0.02)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        body = {"prompt": ["a", "b", "c"], "n": 2, "stream": True, "max_tokens": 100}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 12:
                    break
            assert (await c.get("/v1/stats")).json()["requests"]["active"] == 3
        await wait_idle(c)


async def test_heartbeat_while_waiting_for_the_first_token() -> None:
    """A slow prefill gets `: heartbeat` comments before the first token."""
    async with (
        fake_server(FakeRunner(step_s=0.7)) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        r = await c.post("/v1/chat/completions", json={"messages": USER, "stream": True, "max_tokens": 1})
        assert r.text.startswith(": connected\n\n: heartbeat\n\n")
        assert parse_sse(r.text)[-1] == "[DONE]"
