"""`/v1/responses` cut by `max_output_tokens` while the model writes a tool call: streamed and
non-streamed output agree on the items and on which one is incomplete."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from ft.engine.fake import FakeRunner, text_script
from tests.support.scripts import QUESTION, events_of
from tests.support.server import fake_server

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
JSON = {"content-type": "application/json"}
TEXT = "Let me look."
CALL_JSON = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        # Cut after the closing tag: the call was whole before the cut.
        (TEXT + CALL_JSON + "</tool_call>", [("message", "completed"), ("function_call", "completed")]),
        # Cut before the closing tag: the JSON is whole, so the call is kept, open at the cut.
        (TEXT + CALL_JSON, [("message", "completed"), ("function_call", "incomplete")]),
        # Cut inside the JSON: the call is dropped; the text before it was open at the cut.
        (TEXT + CALL_JSON[:-3], [("message", "incomplete")]),
    ],
)
async def test_cut_output_items_agree_streamed_and_not(output: str, expected: list[tuple[str, str]]) -> None:
    """Each item's status in the streamed `output_item.done` events is its status in the final
    response and in the non-streamed response: the item open at the cut is incomplete."""
    body = {"input": QUESTION, "tools": TOOLS, "max_output_tokens": len(output.encode())}
    runner = FakeRunner(script=text_script(output + " and more text after the cut"))
    with trio.fail_after(30):
        async with (
            fake_server(runner) as s,
            httpx.AsyncClient(base_url=s.base_url, timeout=30, headers=JSON) as c,
        ):
            whole = (await c.post("/v1/responses", content=json.dumps(body))).json()
            streamed = await c.post("/v1/responses", content=json.dumps(body | {"stream": True}))
    events = events_of(streamed.text)
    done = [e["item"] for name, e in events if name == "response.output_item.done"]
    (final,) = [e["response"] for name, e in events if name == "response.incomplete"]
    assert whole["status"] == final["status"] == "incomplete"

    def shape(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return [(i["type"], i["status"]) for i in items]

    assert shape(done) == shape(final["output"]) == shape(whole["output"]) == expected
