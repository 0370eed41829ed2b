"""Issue 3's "done when" checks, written against a base URL so they run on any model.

`test_openai_sdk.py` runs them on the fake model; `test_openai_e2e.py` on the real default one.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import trio

from tests.support.server import frozen_heap, parse_sse, wait_idle

CHAT = [{"role": "user", "content": "Name three colours."}]


async def served_model(base_url: str) -> str:
    """The id `/v1/models` lists first."""
    async with httpx.AsyncClient(base_url=base_url) as c:
        return str((await c.get("/v1/models")).json()["data"][0]["id"])


async def sdk_chat_streamed_equals_unstreamed(base_url: str) -> None:
    """The openai SDK: chat at temperature 0 gives the same text streamed and not."""
    model = await served_model(base_url)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with client:
        whole = await client.chat.completions.create(
            model=model,
            messages=CHAT,
            temperature=0,
            max_tokens=24,  # type: ignore[arg-type]
        )
        text = whole.choices[0].message.content
        assert whole.id.startswith("chatcmpl-")
        assert whole.choices[0].finish_reason in ("stop", "length")
        assert whole.usage is not None and whole.usage.completion_tokens > 0
        chunks = await client.chat.completions.create(
            model=model,
            messages=CHAT,
            temperature=0,
            max_tokens=24,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
        pieces, ids, reasons, roles, usage = [], set(), [], [], None
        async for chunk in chunks:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
            for c in chunk.choices:
                if c.delta.role:
                    roles.append(c.delta.role)
                pieces.append(c.delta.content or "")
                if c.finish_reason:
                    reasons.append(c.finish_reason)
    assert "".join(pieces) == text
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert roles == ["assistant"] and len(reasons) == 1
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


async def sdk_completions(base_url: str) -> None:
    """The openai SDK: a text completion, and several prompts in one request."""
    model = await served_model(base_url)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with client:
        done = await client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert done.id.startswith("cmpl-") and done.object == "text_completion"
        assert done.choices[0].text and done.choices[0].finish_reason in ("stop", "length")
        many = await client.completions.create(
            model=model, prompt=["One", "Two"], max_tokens=4, temperature=0, n=2
        )
        assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
        streamed = await client.completions.create(
            model=model,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text = "".join([c.choices[0].text async for c in streamed if c.choices])
        assert text == done.choices[0].text


async def sdk_bad_parameter(base_url: str) -> None:
    """The openai SDK raises `BadRequestError` naming the bad parameter."""
    model = await served_model(base_url)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=model,
                messages=CHAT,
                temperature=-1,  # type: ignore[arg-type]
            )
        assert info.value.body["param"] == "temperature"  # type: ignore[index]
        # Another name is served by the one model, and the answer names it (only
        # `--strict-model-names` makes it a 404).
        other = await client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
        assert other.model == model


async def connected_before_slow_prefill(base_url: str, prompt: str) -> None:
    """A streamed request gets `: connected` on its own, before its prefill ends: the first
    bytes hold no token, and they come in well under half the time the first token takes (two
    times of one run, slowed alike by a loaded machine; a stream that waited for the prefill
    would have them together)."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 4}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
        start = time.monotonic()
        with frozen_heap():  # as `ft serve` runs: no full collection of this process's heap
            async with c.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                chunks = response.aiter_raw()
                first = await chunks.__anext__()
                connected_s = time.monotonic() - start
                seen = first
                while b"data: " not in seen:
                    seen += await chunks.__anext__()
                first_token_s = time.monotonic() - start
            assert first.startswith(b": connected\n\n") and b"data: " not in first
            assert connected_s < first_token_s / 2, (connected_s, first_token_s)
        await wait_idle(c)


async def control_plane_answers_while_streaming(base_url: str) -> None:
    """`/health` and `/v1/models` answer while a generation streams, not after it: each answer
    comes while the stream is still giving tokens (an order, which a loaded machine keeps)."""
    body = {"messages": CHAT, "stream": True, "max_tokens": 200, "ignore_eos": True}
    ended = trio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass  # generation is under way

            async def read_to_the_end() -> None:
                async for line in lines:
                    if line == "data: [DONE]":
                        ended.set()

            with frozen_heap():  # as `ft serve` runs: no full collection of this process's heap
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_to_the_end)
                    for path in ("/health", "/v1/models", "/health", "/v1/models"):
                        r = await c.get(path)
                        assert r.status_code == 200
                        assert not ended.is_set(), f"{path} answered only once the stream had ended"
        await wait_idle(c)


async def two_requests_one_slot(base_url: str) -> None:
    """With `--max-running-requests 1`, two concurrent requests both complete."""
    results: list[httpx.Response] = []

    async def one(c: httpx.AsyncClient, stream: bool) -> None:
        body = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": stream}
        results.append(await c.post("/v1/chat/completions", json=body))

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, c, False)
            nursery.start_soon(one, c, True)
        assert [r.status_code for r in results] == [200, 200]
        for r in results:
            if r.headers["content-type"].startswith("text/event-stream"):
                events = parse_sse(r.text)
                assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            else:
                assert r.json()["choices"][0]["message"]["content"]
        await wait_idle(c)
