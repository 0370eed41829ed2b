"""pydantic-ai on ft (`OpenAIChatModel` and `OpenAIResponsesModel` with an `OpenAIProvider`
pointed at it): a reply, a tool the agent runs, and a typed output in tool and native modes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, NativeOutput, ToolOutput
from pydantic_ai.models import Model
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.support.clients import DUMMY_KEY, FtServe, assert_clean

ROUTES = {"responses": "/v1/responses", "chat": "/v1/chat/completions"}
SETTINGS = ModelSettings(max_tokens=128, temperature=0, timeout=120)


class City(BaseModel):
    name: str
    country: str


def _model(server: FtServe, api: str) -> Model:
    provider = OpenAIProvider(base_url=server.api_base, api_key=DUMMY_KEY)
    if api == "responses":
        return OpenAIResponsesModel(server.model, provider=provider)
    return OpenAIChatModel(server.model, provider=provider)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_says_hello(ft_serve: FtServe, env: dict[str, str], api: str) -> None:
    """`run_sync` ends with a string output."""
    mark = ft_serve.mark()
    result = Agent(_model(ft_serve, api), model_settings=SETTINGS).run_sync("Say hello.")
    assert isinstance(result.output, str)
    assert_clean(ft_serve.requests_since(mark), ROUTES[api])


def test_pydantic_ai_runs_a_tool(ft_serve: FtServe, env: dict[str, str]) -> None:
    """A tool registered with `tool_plain` is offered; the agent runs each call it parses and
    sends the results back (the model may also answer without calling it: the run must end)."""
    calls: list[str] = []
    agent = Agent(_model(ft_serve, "chat"), model_settings=SETTINGS, instructions="Use the tool.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    mark = ft_serve.mark()
    result = agent.run_sync("What is the weather in Paris? Call get_weather.")
    assert isinstance(result.output, str)
    logged = assert_clean(ft_serve.requests_since(mark), ROUTES["chat"])
    assert len(logged) >= 1 + bool(calls), logged  # each call's result went back to ft


@pytest.mark.parametrize(
    ("api", "mode"),
    [("chat", "tool"), ("chat", "native"), ("responses", "native")],
)
def test_pydantic_ai_returns_a_typed_output(
    ft_serve: FtServe, env: dict[str, str], api: str, mode: str
) -> None:
    """`output_type` as a forced output tool (`ToolOutput`, pydantic-ai's default) and as a
    JSON schema response format (`NativeOutput`) comes back as a validated instance."""
    output: Any = ToolOutput(City) if mode == "tool" else NativeOutput(City)
    mark = ft_serve.mark()
    agent = Agent(_model(ft_serve, api), output_type=output, model_settings=SETTINGS, retries=0)
    result = agent.run_sync("Name a city.")
    assert isinstance(result.output, City)
    assert_clean(ft_serve.requests_since(mark), ROUTES[api])
