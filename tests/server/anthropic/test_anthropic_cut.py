"""`/v1/messages` cut by `max_tokens` while the model writes a tool call: the unfinished call is
dropped, never sent as text, streamed or not (the route passes the cut to the assembler)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from ft.engine.fake import FakeRunner, text_script
from tests.support.scripts import QUESTION, events_of
from tests.support.server import fake_server

JSON = {"content-type": "application/json"}
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
TEXT = "Let me look."
CUT = TEXT + '<tool_call>{"name": "get_weather", "arguments": {"ci'


async def test_a_cut_tool_call_is_dropped_streamed_and_not() -> None:
    """The body and the stream both hold only the text before the call, and say max_tokens."""
    body = {
        "model": "fake",
        "max_tokens": len(CUT.encode()),
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": TOOLS,
    }
    runner = FakeRunner(script=text_script(CUT + 'ty": "Paris"}}</tool_call>'))
    with trio.fail_after(30):
        async with (
            fake_server(runner) as s,
            httpx.AsyncClient(base_url=s.base_url, timeout=30, headers=JSON) as c,
        ):
            whole = (await c.post("/v1/messages", content=json.dumps(body))).json()
            streamed = await c.post("/v1/messages", content=json.dumps(body | {"stream": True}))
    assert whole["content"] == [{"type": "text", "text": TEXT}]
    assert whole["stop_reason"] == "max_tokens"
    events = events_of(streamed.text)
    starts = [e["content_block"]["type"] for n, e in events if n == "content_block_start"]
    text = "".join(e["delta"].get("text", "") for n, e in events if n == "content_block_delta")
    (delta,) = [e["delta"] for n, e in events if n == "message_delta"]
    assert starts == ["text"] and text == TEXT and delta["stop_reason"] == "max_tokens"
