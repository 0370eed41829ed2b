"""LangChain's `ChatOpenAI` (`langchain-openai`) on ft, through chat completions and through
Responses (`use_responses_api=True`): a reply, a forced tool call, structured output."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.support.clients import DUMMY_KEY, FtServe, assert_clean

ROUTES = {True: "/v1/responses", False: "/v1/chat/completions"}
APIS = [pytest.param(False, id="chat"), pytest.param(True, id="responses")]


class City(BaseModel):
    name: str
    country: str


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def _chat(server: FtServe, responses: bool) -> ChatOpenAI:
    return ChatOpenAI(
        model=server.model, base_url=server.api_base, api_key=DUMMY_KEY,  # type: ignore[arg-type]
        use_responses_api=responses, max_tokens=64, temperature=0, max_retries=0, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("responses", APIS)
def test_langchain_streams_a_reply(ft_serve: FtServe, env: dict[str, str], responses: bool) -> None:
    """`stream` yields message chunks that add up to one AI message with text."""
    mark = ft_serve.mark()
    chunks = list(_chat(ft_serve, responses).stream("Say hello."))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert isinstance(merged.text, str)
    assert_clean(ft_serve.requests_since(mark), ROUTES[responses])


@pytest.mark.parametrize("responses", APIS)
def test_langchain_parses_a_forced_tool_call(ft_serve: FtServe, env: dict[str, str], responses: bool) -> None:
    """`bind_tools(tool_choice=NAME)`: the reply carries at least one parsed call of that tool."""
    mark = ft_serve.mark()
    model = _chat(ft_serve, responses).bind_tools([get_weather], tool_choice="get_weather")
    reply = model.invoke("What is the weather in Paris?")
    assert isinstance(reply, AIMessage)
    assert reply.tool_calls and all(call["name"] == "get_weather" for call in reply.tool_calls)
    assert all(isinstance(call["args"], dict) for call in reply.tool_calls)
    assert_clean(ft_serve.requests_since(mark), ROUTES[responses])


@pytest.mark.parametrize(
    ("responses", "method"),
    [(False, "json_schema"), (False, "function_calling"), (True, "json_schema")],
    ids=["chat-json_schema", "chat-function_calling", "responses-json_schema"],
)
def test_langchain_returns_structured_output(
    ft_serve: FtServe, env: dict[str, str], responses: bool, method: str
) -> None:
    """`with_structured_output(Model, method=…)` returns a validated instance."""
    mark = ft_serve.mark()
    model = _chat(ft_serve, responses).with_structured_output(City, method=method)  # type: ignore[arg-type]
    assert isinstance(model.invoke("Name a city."), City)
    assert_clean(ft_serve.requests_since(mark), ROUTES[responses])
