"""Tool calls and reasoning on /v1/chat/completions, with scripted model output."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from ft.engine.fake import FakeRunner, text_script
from ft.server import RunningServer
from ft.tokenizer.job import SAMPLE_TOOLS
from tests.support.scripts import ANSWER, CALL, QUESTION, tool_then_answer
from tests.support.server import fake_server

TOOLS: list[Any] = list(SAMPLE_TOOLS)  # get_weather(city), the load check's sample tool


def sdk(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


async def test_tool_call_round_trip() -> None:
    """A parsed tool call and the tool's answer make a round trip through the chat SDK."""
    async with fake_server(FakeRunner(script=tool_then_answer())) as s, sdk(s) as client:
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        first = await client.chat.completions.create(model="fake", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ]
        second = await client.chat.completions.create(model="fake", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == ANSWER
        assert second.choices[0].finish_reason == "stop"


async def test_streamed_tool_call_deltas() -> None:
    """A streamed tool call arrives as one delta.tool_calls entry with finish_reason tool_calls."""
    async with fake_server(FakeRunner(script=text_script(CALL))) as s, sdk(s) as client:
        stream = await client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": QUESTION}],
            tools=TOOLS,
            stream=True,
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in stream:
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function and tc.function.name:
                        entry["name"] = tc.function.name
                    if tc.function and tc.function.arguments:
                        entry["arguments"] += tc.function.arguments
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        assert calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


async def test_without_tools_the_text_is_left_alone() -> None:
    """Without tools, call-shaped output stays plain text."""
    async with fake_server(FakeRunner(script=text_script(CALL))) as s, sdk(s) as client:
        r = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": QUESTION}]
        )
        assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"


async def test_reasoning_content_with_a_reasoning_parser() -> None:
    """With a reasoning parser, <think> output becomes reasoning_content."""
    runner = FakeRunner(script=text_script("<think>Ponder.</think>Done."))
    async with fake_server(runner, reasoning_parser="think") as s, sdk(s) as client:
        r = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Think."}]
        )
        message = r.choices[0].message
        assert message.content == "Done."
        assert getattr(message, "reasoning_content", None) == "Ponder."


async def test_malformed_tool_calls_are_400_not_500() -> None:
    """Malformed assistant tool_calls are 400s, never 500s."""
    async with fake_server() as s:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
            for calls in (
                [{"id": "x"}],
                [{"function": "str"}],
                [{"function": {"name": 3}}],
                [{"function": {"name": "f", "arguments": 5}}],
            ):
                body = {
                    "messages": [
                        {"role": "assistant", "content": None, "tool_calls": calls},
                        {"role": "user", "content": "hi"},
                    ],
                    "tools": TOOLS,
                }
                for path in ("/v1/chat/completions", "/v1/tokenize"):
                    r = await c.post(path, json=body)
                    assert r.status_code == 400, (path, calls, r.text)
                    assert "tool_calls" in r.json()["error"]["param"]
