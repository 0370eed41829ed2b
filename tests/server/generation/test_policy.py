"""The output policy every API shares: a named tool choice is exactly one call of that tool;
`required` / `any` may be several unless the request turns parallel calls off."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from ft.core.toolcalls import TOOL_CALL_PARSERS
from ft.server.anthropic.routes import tool_choice as anthropic_tool_choice
from ft.server.anthropic.schemas import MessagesRequest
from ft.server.generation.tools import ToolChoice, output_grammar
from ft.server.openai.routes import chat_tool_choice
from ft.server.openai.schemas import ChatCompletionRequest
from ft.server.responses.routes import responses_tool_choice
from ft.server.responses.schemas import ResponsesRequest
from tests.support.grammar import byte_matcher
from tests.support.server import fake_server

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}},
]  # fmt: skip
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = WEATHER + "\n" + WEATHER
USER = [{"role": "user", "content": "Weather in Paris, London and Tokyo?"}]
JSON = {"content-type": "application/json"}


def chat(**fields: Any) -> ToolChoice:
    return chat_tool_choice(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS} | fields))


def responses(**fields: Any) -> ToolChoice:
    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
        for t in TOOLS
    ]
    return responses_tool_choice(ResponsesRequest.model_validate({"input": "hi", "tools": tools} | fields))


def anthropic(**fields: Any) -> ToolChoice:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {"messages": USER, "max_tokens": 10, "tools": tools} | fields
    return anthropic_tool_choice(MessagesRequest.model_validate(body))


def accepts(choice: ToolChoice, text: str) -> bool:
    """Whether the output grammar of `choice` (hermes calls) accepts `text` whole."""
    grammar = output_grammar(TOOLS, choice, "hermes", None)
    assert grammar is not None
    m = byte_matcher(grammar)
    return m.consume_tokens([3 + b for b in text.encode()]) and m.is_accepting()


NAMED = [
    chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=True),
    responses(tool_choice={"type": "function", "name": "get_weather"}),
    responses(tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=True),
    anthropic(tool_choice={"type": "tool", "name": "get_weather"}),
]


@pytest.mark.parametrize(
    "choice", NAMED, ids=["chat", "chat-parallel", "responses", "responses-parallel", "anthropic"]
)
def test_a_named_tool_choice_is_exactly_one_call_in_every_dialect(choice: ToolChoice) -> None:
    """OpenAI's named function and Anthropic's `tool` mean one call, whatever `parallel_tool_calls` says."""
    assert accepts(choice, WEATHER)
    assert not accepts(choice, TWO_CALLS)
    assert not accepts(choice, "Sure! " + WEATHER)


@pytest.mark.parametrize(
    ("choice", "several"),
    [
        (chat(tool_choice="required"), True),
        (chat(tool_choice="required", parallel_tool_calls=False), False),
        (responses(tool_choice="required"), True),
        (responses(tool_choice="required", parallel_tool_calls=False), False),
        (anthropic(tool_choice={"type": "any"}), True),
        (anthropic(tool_choice={"type": "any", "disable_parallel_tool_use": True}), False),
    ],
    ids=["chat", "chat-serial", "responses", "responses-serial", "anthropic", "anthropic-serial"],
)
def test_required_and_any_are_several_calls_unless_parallel_calls_are_off(
    choice: ToolChoice, several: bool
) -> None:
    """`required` / `any` force calls; a second one only while parallel calls are on."""
    assert accepts(choice, WEATHER)
    assert accepts(choice, TWO_CALLS) == several


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_every_tool_call_format_can_be_forced(parser: str) -> None:
    """A forced choice is a grammar in whichever format the output is parsed in: none is left
    to an instruction the model may ignore."""
    assert output_grammar(TOOLS, chat(tool_choice="required"), parser, None) is not None


async def test_a_named_tool_choice_without_that_tool_is_a_400_in_every_dialect() -> None:
    """A named choice when the request defines no tools is refused (as chat's schema refuses it),
    not ignored: ignored, the answer would be free text, not the one call the client asked for."""
    user = [{"role": "user", "content": "hi"}]
    named, function = {"type": "function", "name": "x"}, {"type": "function", "function": {"name": "x"}}
    requests = [
        ("/v1/messages", {"messages": user, "max_tokens": 8, "tool_choice": {"type": "tool", "name": "x"}}),
        ("/v1/messages/count_tokens", {"messages": user, "tool_choice": {"type": "tool", "name": "x"}}),
        ("/v1/responses", {"input": "hi", "tool_choice": named}),
        # Only hosted tools, which the model is not offered: still no tool named x.
        ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": named}),
        ("/v1/chat/completions", {"messages": user, "tool_choice": function}),
    ]  # fmt: skip
    with trio.fail_after(30):
        async with (
            fake_server() as s,
            httpx.AsyncClient(
                base_url=s.base_url, timeout=30, headers={"content-type": "application/json"}
            ) as c,
        ):
            for path, body in requests:
                r = await c.post(path, content=json.dumps({"model": "fake"} | body))
                assert r.status_code == 400, (path, r.text)
                assert "tool_choice" in r.text and "'x'" in r.text, (path, r.text)
