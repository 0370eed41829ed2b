"""`/v1/messages` on the fake model: the official anthropic SDK, event order, tools, no leaks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest
import trio

from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner, text_script
from ft.server import RunningServer, ServerSettings
from tests.support.scripts import ANSWER, CALL, events_of, tool_then_answer
from tests.support.server import fake_server, wait_idle

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def sdk(server: RunningServer, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base_url, api_key=api_key, max_retries=0)


async def post(
    server: RunningServer, body: dict[str, Any] | str, headers: dict[str, str] | None = None
) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
        return await c.post(
            "/v1/messages", content=content, headers={"content-type": "application/json"} | (headers or {})
        )


# --- the SDK ---------------------------------------------------------------------------------


async def test_sdk_create_stream_and_count_tokens_agree(server: RunningServer) -> None:
    """The SDK's create, stream and count_tokens agree on text, stop reason and token counts."""
    async with sdk(server) as client:
        whole = await client.messages.create(model="fake", max_tokens=64, messages=USER)
        assert whole.id.startswith("msg_") and whole.type == "message"
        assert whole.role == "assistant" and whole.stop_reason == "end_turn"
        assert [b.type for b in whole.content] == ["text"]
        text = whole.content[0].text  # type: ignore[union-attr]
        assert text == "Hello from the fake model."
        async with client.messages.stream(model="fake", max_tokens=64, messages=USER) as stream:
            pieces = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(pieces) == text and len(pieces) > 1
        assert final.content[0].text == text  # type: ignore[union-attr]
        assert final.stop_reason == "end_turn"
        # The second request reads its prompt's leading pages from the prefix cache, which
        # Anthropic counts apart from input_tokens.
        prompt_tokens = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
        cached = final.usage.cache_read_input_tokens or 0
        assert final.usage.input_tokens + cached == prompt_tokens > 0 and cached > 0
        assert final.usage.output_tokens == whole.usage.output_tokens > 0
        counted = await client.messages.count_tokens(model="fake", messages=USER)
        assert counted.input_tokens == prompt_tokens


async def test_sdk_bad_parameter_is_bad_request(server: RunningServer) -> None:
    """A bad parameter raises the SDK's BadRequestError."""
    async with sdk(server) as client:
        with pytest.raises(anthropic.BadRequestError) as info:
            # NOTE: this SDK version has no `temperature` argument; the API still takes it.
            await client.messages.create(
                model="fake", max_tokens=8, messages=USER, extra_body={"temperature": 1.5}
            )
        assert info.value.body["type"] == "error"  # type: ignore[index]
        assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "temperature" in info.value.body["error"]["message"]  # type: ignore[index]


async def test_api_key_via_x_api_key_and_anthropic_error_shape() -> None:
    """The key may come as x-api-key; a wrong one is a 401 in Anthropic's error shape."""
    settings = ServerSettings(port=0, api_key="sekrit", graceful_timeout_s=0.5)
    async with fake_server(settings=settings) as s:
        async with sdk(s, api_key="sekrit") as client:
            done = await client.messages.create(model="fake", max_tokens=4, messages=USER)
            assert done.content
        async with sdk(s, api_key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await client.messages.create(model="fake", max_tokens=4, messages=USER)
        assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_system_blocks_metadata_and_thinking_are_accepted(server: RunningServer) -> None:
    """System text blocks, metadata and thinking are accepted."""
    r = await post(
        server,
        {
            "model": "fake",
            "max_tokens": 4,
            "messages": USER,
            "metadata": {"user_id": "u1"},
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "top_k": 5,
            "top_p": 0.9,
        },
        headers={"anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] == "max_tokens"


async def test_stop_sequence_is_reported(server: RunningServer) -> None:
    """A matched stop sequence is reported as stop_reason "stop_sequence" with the sequence."""
    async with sdk(server) as client:
        done = await client.messages.create(
            model="fake", max_tokens=64, messages=USER, stop_sequences=["fake"]
        )
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == "fake"
    assert done.content[0].text == "Hello from the "  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": USER}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "user or assistant turn"),
        ({"max_tokens": 4, "messages": USER, "top_k": -1}, "top_k"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}],
                    }
                ],
            },
            "text only",
        ),
        (
            {
                "max_tokens": 4,
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice",
        ),
    ],
)
async def test_invalid_requests_get_anthropic_400(
    server: RunningServer, body: dict[str, Any], field: str
) -> None:
    """Invalid bodies are 400s in Anthropic's shape, naming the field in the message."""
    r = await post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]


# --- issue 4: unpackable fields leak nothing -------------------------------------------------


async def test_unpackable_fields_are_400_and_leak_nothing(server: RunningServer) -> None:
    """Values the engine cannot carry are 400s, streamed or not, and leave nothing registered."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as c:
        baseline = (await wait_idle(c))["requests"]["active"]
        base = '{"model":"fake","max_tokens":4,"messages":[{"role":"user","content":"hi"}]'
        shapes = [
            ("top_k", base + ',"top_k":' + str(2**64) + "}", base + ',"top_k":40}'),
            ("stop_sequences", base + ',"stop_sequences":["\\ud800"]}', base + ',"stop_sequences":["x"]}'),
        ]
        for field, hostile, sane in shapes:
            for stream in ("", ',"stream":true'):
                r = await post(server, hostile[:-1] + stream + "}")
                assert r.status_code == 400, (field, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and field in error["message"]
                assert (await wait_idle(c))["requests"]["active"] == baseline
                ok = await post(server, sane[:-1] + stream + "}")
                assert ok.status_code == 200, (field, ok.text)
        assert (await wait_idle(c))["requests"]["active"] == baseline


# --- streaming -------------------------------------------------------------------------------


async def test_stream_event_order_for_text(server: RunningServer) -> None:
    """A stream follows Anthropic's order: message_start, block events, message_delta, message_stop."""
    r = await post(server, {"model": "fake", "max_tokens": 64, "messages": USER, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    names = [n for n, _ in events if n != "ping"]
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    delta = dict(events)["message_delta"]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


async def test_ping_while_prefill_is_slow() -> None:
    """A slow prefill gets ping events before the first content block."""
    async with fake_server(FakeRunner(script=text_script("Hi"), step_s=0.7)) as s:
        r = await post(s, {"model": "fake", "max_tokens": 8, "messages": USER, "stream": True})
        names = [n for n, _ in events_of(r.text)]
        first_block = names.index("content_block_start")
        assert "ping" in names[:first_block], names
        assert names[0] in ("ping", "message_start") and names[-1] == "message_stop"


def fail_after(num_generated: int) -> Callable[[list[SeqWork]], None]:
    def hook(works: list[SeqWork]) -> None:
        if any(w.num_generated >= num_generated for w in works):
            raise RuntimeError("injected fault")

    return hook


async def test_error_mid_stream_is_an_error_event() -> None:
    """A fault after the headers ends the stream with an error event; the SDK raises."""
    async with fake_server(before_step=fail_after(3)) as s:
        r = await post(s, {"model": "fake", "max_tokens": 64, "messages": USER, "stream": True})
        assert r.status_code == 200
        events = events_of(r.text)
        names = [n for n, _ in events]
        assert "content_block_delta" in names and names[-1] == "error"
        error = events[-1][1]
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert error["error"]["message"]
        async with sdk(s) as client:
            with pytest.raises(anthropic.APIStatusError):
                async with client.messages.stream(model="fake", max_tokens=64, messages=USER) as stream:
                    await stream.get_final_message()
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            await wait_idle(c)


async def test_streamed_context_too_long_is_a_400_before_the_stream(server: RunningServer) -> None:
    """The prompt is tokenized and checked before the 200, so the error has Anthropic's shape."""
    long = [{"role": "user", "content": "x" * 3000}]  # the fake model's context is 2048
    r = await post(server, {"model": "fake", "max_tokens": 5, "messages": long, "stream": True})
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "context length" in error["error"]["message"]


# --- tools and thinking ----------------------------------------------------------------------


async def test_tool_call_round_trip() -> None:
    """A tool_use block and its tool_result make a round trip through the SDK."""
    async with fake_server(FakeRunner(script=tool_then_answer())) as s, sdk(s) as client:
        first = await client.messages.create(model="fake", max_tokens=200, messages=USER, tools=TOOLS)
        assert first.stop_reason == "tool_use"
        (call,) = first.content
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        assert call.name == "get_weather" and call.input == {"city": "Paris"}
        followup: list[Any] = [
            *USER,
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
            },
        ]
        second = await client.messages.create(model="fake", max_tokens=200, messages=followup, tools=TOOLS)
        assert second.stop_reason == "end_turn"
        assert second.content[0].text == ANSWER  # type: ignore[union-attr]


async def test_streamed_tool_call_uses_input_json_delta() -> None:
    """A streamed tool call is a tool_use block with input_json_delta."""
    async with fake_server(FakeRunner(script=text_script("Checking. " + CALL))) as s:
        r = await post(
            s, {"model": "fake", "max_tokens": 200, "messages": USER, "tools": TOOLS, "stream": True}
        )
        events = [(n, d) for n, d in events_of(r.text) if n != "ping"]
        names = [n for n, _ in events]
        assert names == (
            ["message_start", "content_block_start"]
            + ["content_block_delta"] * len("Checking. ")
            + [
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        )
        tool_start = events[len("Checking. ") + 3][1]
        assert tool_start["index"] == 1
        assert tool_start["content_block"]["type"] == "tool_use"
        assert tool_start["content_block"]["input"] == {}
        json_delta = events[len("Checking. ") + 4][1]["delta"]
        assert json_delta["type"] == "input_json_delta"
        assert json.loads(json_delta["partial_json"]) == {"city": "Paris"}
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
        async with (
            sdk(s) as client,
            client.messages.stream(model="fake", max_tokens=200, messages=USER, tools=TOOLS) as stream,
        ):
            final = await stream.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]


async def test_tool_choice_none_sends_no_tools_and_parses_nothing() -> None:
    """tool_choice none hides the tools and leaves call-shaped text as text; any, tool and auto parse it."""
    async with fake_server(FakeRunner(script=text_script(CALL))) as s, sdk(s) as client:
        done = await client.messages.create(
            model="fake", max_tokens=200, messages=USER, tools=TOOLS, tool_choice={"type": "none"}
        )
        assert done.stop_reason == "end_turn"
        assert done.content[0].text == CALL  # type: ignore[union-attr]
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}):
            forced = await client.messages.create(
                model="fake", max_tokens=200, messages=USER, tools=TOOLS, tool_choice=choice
            )  # type: ignore[arg-type]
            assert forced.stop_reason == "tool_use"


async def test_thinking_blocks_with_a_reasoning_parser() -> None:
    """With a reasoning parser, <think> output becomes a thinking block."""
    runner = FakeRunner(script=text_script("<think>\nPonder.\n</think>\n\nDone."))
    async with fake_server(runner, reasoning_parser="think") as s, sdk(s) as client:
        done = await client.messages.create(model="fake", max_tokens=64, messages=USER)
        assert [b.type for b in done.content] == ["thinking", "text"]
        assert done.content[0].thinking == "Ponder."  # type: ignore[union-attr]
        assert done.content[1].text == "Done."  # type: ignore[union-attr]
        async with client.messages.stream(model="fake", max_tokens=64, messages=USER) as stream:
            kinds = {e.delta.type async for e in stream if e.type == "content_block_delta"}
            final = await stream.get_final_message()
        assert kinds == {"thinking_delta", "text_delta"}
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in done.content]


async def test_disconnect_mid_stream_frees_everything() -> None:
    """A client leaving a Messages stream frees its request and pages."""
    runner = FakeRunner(script=text_script("x" * 500), step_s=0.01)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        body = {"model": "fake", "max_tokens": 400, "messages": USER, "stream": True}
        async with c.stream("POST", "/v1/messages", json=body) as r:
            async for line in r.aiter_lines():
                if "content_block_delta" in line:
                    break
        with trio.fail_after(30):
            await wait_idle(c)


async def test_max_tokens_beyond_the_context_means_up_to_the_context(server: RunningServer) -> None:
    """A max_tokens at or past the context means "up to the context" (agents send 32000)."""
    # Agents send max_tokens far beyond a small model's context (Claude Code: 32000).
    r = await post(server, {"model": "fake", "max_tokens": 32000, "messages": USER})
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn"
    async with (
        sdk(server) as client,
        client.messages.stream(model="fake", max_tokens=32000, messages=USER) as stream,
    ):
        assert (await stream.get_final_message()).stop_reason == "end_turn"
