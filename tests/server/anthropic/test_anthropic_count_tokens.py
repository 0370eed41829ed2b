"""`/v1/messages/count_tokens` counts the prompt generation renders, whatever the request holds:
tools under each `tool_choice`, system turns mid-conversation, the billing header, thinking."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from ft.server import RunningServer

TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
]
CONVERSATION: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}]},
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "Go on."},
]
JSON = {"content-type": "application/json"}
SYSTEM: list[Any] = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=sdk-cli;"},
    {"type": "text", "text": "You are a weather bot."},
]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": {"type": "auto"}},
        {"tools": TOOLS, "tool_choice": {"type": "none"}},
        {"tools": TOOLS, "tool_choice": {"type": "any"}},
        {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}},
        {"tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    ],
)
async def test_count_tokens_is_the_generated_prompt(server: RunningServer, extra: dict[str, Any]) -> None:
    """count_tokens equals the prompt tokens generation reports for the same request."""
    body = {"model": "fake", "system": SYSTEM, "messages": CONVERSATION} | extra
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30, headers=JSON) as c:
            counted = await c.post("/v1/messages/count_tokens", content=json.dumps(body))
            assert counted.status_code == 200, counted.text
            made = await c.post("/v1/messages", content=json.dumps(body | {"max_tokens": 8}))
            assert made.status_code == 200, made.text
    u = made.json()["usage"]
    assert counted.json()["input_tokens"] == u["input_tokens"] + u["cache_read_input_tokens"]
