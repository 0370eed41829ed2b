"""The one generation lifecycle (`ft.server.generation.lifecycle`), checked across all four APIs."""

from __future__ import annotations

import gc
from typing import Any

import httpx
import trio

from ft.engine.fake import FakeRunner, text_script
from ft.server.generation.context import ServerContext
from ft.server.generation.lifecycle import respond
from ft.server.openai.routes import ChatCompletion
from ft.server.openai.schemas import ChatCompletionRequest
from tests.support.server import fake_server, parse_sse, wait_idle

USER = [{"role": "user", "content": "hi"}]
LONG_TEXT = "lorem ipsum " * 200
TOO_LONG = "x" * 3000  # the fake model's context is 2048 tokens (one per byte)
# Long enough to fill several 16-token KV pages, so a repeat finds them in the prefix cache.
SHARED = "You are a careful assistant. " * 6

# One streamed body per API, and where its prompt goes.
APIS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 8}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 8}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 8}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 8}),
}


def with_prompt(api: str, text: str) -> dict[str, Any]:
    """API `api`'s body with `text` as its (user) prompt."""
    body = dict(APIS[api][1])
    if api == "completions":
        body["prompt"] = text
    elif api == "responses":
        body["input"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return body


async def test_streamed_prompt_too_long_is_a_400_before_any_stream_on_every_api() -> None:
    """Tokenizing and the context check run before the 200, for every API."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for api, (path, _) in APIS.items():
            r = await c.post(path, json=with_prompt(api, TOO_LONG) | {"stream": True})
            assert r.status_code == 400, (api, r.text)
            assert r.headers["content-type"].startswith("application/json"), api
            assert "context length" in r.text, api
        stats = await wait_idle(c)
        assert stats["requests"]["rejected"] == len(APIS)


async def test_streamed_n_above_max_running_requests_is_a_400_before_any_stream() -> None:
    """`n` choices that could never run side by side are refused before the 200."""
    async with fake_server(max_running_requests=2) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        for path, body in (APIS["chat"], APIS["completions"]):
            r = await c.post(path, json=body | {"n": 3, "stream": True})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "n"
        await wait_idle(c)


def streamed_cached_tokens(api: str, events: list[Any]) -> int:
    """The prefix-cache hits a stream's usage reports."""
    match api:
        case "chat" | "completions":
            return int(events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"])
        case "messages":
            (delta,) = [e for e in events if e["type"] == "message_delta"]
            return int(delta["usage"]["cache_read_input_tokens"])
        case _:
            return int(events[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"])


async def test_usage_reports_real_prefix_cache_hits_on_every_api() -> None:
    """A repeated prompt reads its leading pages from the prefix cache, and usage says so."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for api, (path, _) in APIS.items():
            body = with_prompt(api, api + SHARED)
            first = (await c.post(path, json=body)).json()["usage"]
            second = (await c.post(path, json=body)).json()["usage"]
            match api:
                case "chat" | "completions":
                    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
                    cached = second["prompt_tokens_details"]["cached_tokens"]
                    assert 0 < cached < second["prompt_tokens"] == first["prompt_tokens"]
                case "messages":
                    assert first["cache_read_input_tokens"] == first["cache_creation_input_tokens"] == 0
                    cached = second["cache_read_input_tokens"]
                    assert 0 < cached < second["input_tokens"] + cached == first["input_tokens"]
                case _:
                    assert first["input_tokens_details"] == {"cached_tokens": 0}
                    cached = second["input_tokens_details"]["cached_tokens"]
                    assert 0 < cached < second["input_tokens"] == first["input_tokens"]
            streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
            events = parse_sse((await c.post(path, json=streamed)).text)
            assert streamed_cached_tokens(api, events) == cached, api
        await wait_idle(c)


async def test_chat_continue_final_message_renders_the_last_turn_open() -> None:
    """`continue_final_message` (vLLM's): the prompt ends inside the assistant's turn."""
    prefix = [*USER, {"role": "assistant", "content": "The answer is"}]
    open_turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is"
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        expected = (await c.post("/v1/tokenize", json={"prompt": open_turn})).json()["count"]
        body = {"messages": prefix, "max_tokens": 4, "continue_final_message": True}
        r = await c.post("/v1/chat/completions", json=body | {"add_generation_prompt": False})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == expected
        for bad in (body, body | {"add_generation_prompt": False, "messages": USER}):
            r = await c.post("/v1/chat/completions", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


async def test_anthropic_final_assistant_turn_is_a_prefill() -> None:
    """A final assistant message is continued, not closed and followed by a new turn."""
    prefix = [*USER, {"role": "assistant", "content": "The answer is"}]
    open_turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is"
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        expected = (await c.post("/v1/tokenize", json={"prompt": open_turn})).json()["count"]
        r = await c.post("/v1/messages", json={"messages": prefix, "max_tokens": 4})
        usage = r.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == expected
        counted = await c.post("/v1/messages/count_tokens", json={"messages": prefix})
        assert counted.json()["input_tokens"] == expected


async def test_chat_honours_required_and_named_tool_choice() -> None:
    """Chat applies the shared tool_choice policy, as /v1/messages and /v1/responses do."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"messages": USER, "max_tokens": 2, "tools": tools}
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:

        async def prompt_tokens(choice: object) -> int:
            r = await c.post("/v1/chat/completions", json=body | {"tool_choice": choice})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens"])

        auto = await prompt_tokens("auto")
        assert await prompt_tokens("required") > auto  # the instruction to call a tool
        named = {"type": "function", "function": {"name": "get_weather"}}
        assert await prompt_tokens(named) > auto
        assert await prompt_tokens("none") < auto  # no tools in the prompt
        unknown = {"type": "function", "function": {"name": "nope"}}
        r = await c.post("/v1/chat/completions", json=body | {"tool_choice": unknown})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tool_choice")


async def test_closing_the_stream_body_exits_the_request_scope_at_once() -> None:
    """What Quart does when a client leaves (`aclose()` on the body) frees the request
    before it returns: nothing is left for the garbage collector."""
    runner = FakeRunner(script=text_script(LONG_TEXT), step_s=0.01)
    async with fake_server(runner) as s:
        ctx: ServerContext = s.app.extensions["ft"]
        req = ChatCompletionRequest.model_validate({"messages": USER, "stream": True, "max_tokens": 500})
        response = await respond(ctx, ChatCompletion(ctx, req))
        frames = 0
        async with response.response as body:
            async for frame in body:
                frames += frame.startswith(b"data: ")
                if frames == 5:
                    assert len(s.engine.registry) == 1
                    break
        assert len(s.engine.registry) == 0  # no checkpoint since the body closed


async def test_scope_exits_the_moment_the_client_leaves_without_the_gc() -> None:
    """Over real HTTP, with the garbage collector off: the request is gone within moments."""
    runner = FakeRunner(script=text_script(LONG_TEXT), step_s=0.01)
    gc.disable()
    try:
        async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
            for api, (path, body) in APIS.items():
                budget = "max_output_tokens" if api == "responses" else "max_tokens"
                async with c.stream("POST", path, json=body | {"stream": True, budget: 500}) as r:
                    lines = r.aiter_lines()
                    seen = 0
                    while seen < 4:
                        seen += (await lines.__anext__()).startswith("data: ")
                    assert len(s.engine.registry) == 1
                with trio.fail_after(30):  # without the GC's help: before, never:
                    while len(s.engine.registry):
                        await trio.sleep(0.005)
            await wait_idle(c)
    finally:
        gc.enable()
