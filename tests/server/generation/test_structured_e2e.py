"""Structured output on the real default model (SmolLM2-135M), through the real SDKs.

A 135M-parameter model at temperature 1 writes what the grammar allows and nothing else: every
generation parses and validates, every forced tool choice is a valid call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anthropic
import jsonschema
import openai
import pydantic
import pytest
import trio

from ft.config import EngineConfig
from ft.server import RunningServer
from tests.support.server import running_server

pytestmark = pytest.mark.slow  # the real default model

GENERATIONS = 30
PER_REQUEST = 15  # n: two requests of 15 choices make the 30 generations of each schema
MAX_TOKENS = 400

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 30},
                "address": {"type": "object", "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
                "required": ["name", "address"], "additionalProperties": False},
        },
        "required": ["user"], "additionalProperties": False,
    },
    "arrays with bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False,
    },
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
              "size": {"enum": ["S", "M", "L", 42, None]}}, "required": ["color", "size"],
              "additionalProperties": False},
    "numbers with ranges": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                       "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["age", "score", "count"], "additionalProperties": False,
    },
    "strings with patterns": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["phone", "code"], "additionalProperties": False,
    },
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "boolean"},
        {"type": "string", "maxLength": 20}]}}, "required": ["value"], "additionalProperties": False},
    "$ref": {
        "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False,
    },
}  # fmt: skip

UNBOUNDED_SCHEMAS = {"numbers with ranges"}  # "score" is a number: its digits have no bound

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
           "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
           "additionalProperties": False}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
OPENAI_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}},
]  # fmt: skip
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}


@asynccontextmanager
async def server() -> AsyncIterator[RunningServer]:
    async with running_server(EngineConfig()) as s:
        yield s


def oai(s: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key="x", max_retries=0, timeout=300)


async def test_every_schema_validates_thirty_times_at_temperature_one() -> None:
    """For nested objects, bounded arrays, enums, ranged numbers, patterned strings, anyOf and
    $ref, 30 generations each at temperature 1 parse and validate; all whose answer is bounded
    finish."""
    async with server() as s:
        client = oai(s)
        outputs: dict[str, list[tuple[str | None, str | None]]] = {name: [] for name in SCHEMAS}

        async def generate(name: str, seed: int) -> None:
            r = await client.chat.completions.create(
                model=s.engine.model_id,
                messages=[{"role": "user", "content": f"Write an example of {name} as JSON."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMAS[name]},
                },
                temperature=1.0,
                seed=seed,
                n=PER_REQUEST,
                max_tokens=MAX_TOKENS,
            )
            outputs[name] += [(c.message.content, c.finish_reason) for c in r.choices]

        async with trio.open_nursery() as nursery:
            for name in SCHEMAS:
                for seed in range(GENERATIONS // PER_REQUEST):
                    nursery.start_soon(generate, name, seed)
        for name, outs in outputs.items():
            assert len(outs) == GENERATIONS
            for content, reason in outs:
                # NOTE: by construction, not by seed: every string and array of these schemas is
                # bounded, so an answer is far shorter than MAX_TOKENS tokens and must end; a
                # `number` has no bound on its digits, so that answer may be cut (`length`).
                if reason == "length" and name in UNBOUNDED_SCHEMAS:
                    continue
                assert reason == "stop", (name, content)
                assert content is not None
                jsonschema.validate(json.loads(content), SCHEMAS[name])


def assert_stop_means_a_json_object(choices: list[Any]) -> None:
    """Every answer that says `stop` is a JSON object; every other one says `length` (cut)."""
    for c in choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content or ""), dict), c.message.content
        else:
            assert c.finish_reason == "length", c


async def test_json_mode_answers_that_end_parse() -> None:
    """`response_format: json_object` at temperature 1: every answer that ends is a JSON object,
    and one cut by `max_tokens` says `length`, never `stop`.

    Asserted by construction, not by what a seed writes: free JSON need not end (a 135M model
    asked for prose in JSON sometimes writes a string that never closes, 5-25% of answers at
    temperature 0.7-1 for open prompts), and which seeded answers do differs between CPUs (the
    packed kernels round differently under another `-march`).
    """
    person = 'Return a JSON object with keys "name" and "age" for a fictional person.'
    async with server() as s:
        client, model = oai(s), s.engine.model_id
        for seed, prompt in ((0, person), (1, person), (2, "Describe your favourite city in JSON.")):
            r = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                response_format={"type": "json_object"},
                temperature=1.0,
                seed=seed,
                n=PER_REQUEST,
                max_tokens=MAX_TOKENS,
                extra_body={"min_p": 0.05},
            )
            assert_stop_means_a_json_object(r.choices)
        cut = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": person}],
            response_format={"type": "json_object"},
            max_tokens=4,
            n=4,
        )
        assert_stop_means_a_json_object(cut.choices)
        # A bounded answer ends by construction: this grammar allows `{"a": 1}` or `{"a": 2}`.
        bounded = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
                   "additionalProperties": False}  # fmt: skip
        r = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": person}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bounded}},
            temperature=1.0,
            n=4,
            max_tokens=MAX_TOKENS,
        )
        assert [c.finish_reason for c in r.choices] == ["stop"] * 4
        assert all(json.loads(c.message.content or "")["a"] in (1, 2) for c in r.choices)


class Person(pydantic.BaseModel):
    # NOTE: every string bounded, so any answer the grammar allows closes within max_tokens (an
    # unbounded hobby once ran a sampled answer past 400 tokens).
    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=120)
    hobbies: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=3)


async def test_openai_sdk_parse_with_a_pydantic_model() -> None:
    """`client.chat.completions.parse(response_format=Model)` returns a parsed model instance."""
    async with server() as s:
        r = await oai(s).chat.completions.parse(
            model=s.engine.model_id,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format=Person,
            max_tokens=1024,  # 40 + 3 * 20 characters, each at most a 6-character escape, and the rest
        )
        assert isinstance(r.choices[0].message.parsed, Person)


def check_call(name: str, arguments: str | dict[str, Any]) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMA_OF[name])


async def test_required_tool_choice_yields_a_valid_call_on_all_three_apis() -> None:
    """`required` / named / `any` / `tool` on chat, responses and messages: each answer is tool
    calls only, to the allowed tools, with arguments valid against their schemas."""
    chat_prompt = [{"role": "user", "content": "Hello! How are you today?"}]  # nothing asks for a tool
    async with server() as s:
        client, model = oai(s), s.engine.model_id
        named: Any = {"type": "function", "function": {"name": "get_time"}}
        for choice, allowed in [("required", {"get_weather", "get_time"}), (named, {"get_time"})]:
            for parallel in (False, True):
                r = await client.chat.completions.create(
                    model=model, messages=chat_prompt, tools=OPENAI_TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                    parallel_tool_calls=parallel, temperature=1.0, n=8, max_tokens=MAX_TOKENS,
                )  # fmt: skip
                for c in r.choices:
                    calls = c.message.tool_calls or []
                    assert calls, c.message
                    for call in calls:  # every complete call is valid
                        assert call.function.name in allowed  # type: ignore[union-attr]
                        check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
                    if parallel and c.finish_reason == "length":
                        continue  # it kept calling until max_tokens cut the last call short
                    assert c.finish_reason == "tool_calls" and not c.message.content, c.message
                    assert parallel or len(calls) == 1

        responses_tools: list[Any] = [
            {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in OPENAI_TOOLS
        ]
        named = {"type": "function", "name": "get_weather"}
        for choice, allowed in [("required", {"get_weather", "get_time"}), (named, {"get_weather"})]:
            for _ in range(4):
                resp = await client.responses.create(
                    model=model, input="Hello!", tools=responses_tools, tool_choice=choice,  # type: ignore[arg-type]
                    parallel_tool_calls=False, temperature=1.0, max_output_tokens=MAX_TOKENS,
                )  # fmt: skip
                [item] = resp.output
                assert item.type == "function_call" and item.name in allowed
                check_call(item.name, item.arguments)

        a = anthropic.AsyncAnthropic(base_url=s.base_url, api_key="x", max_retries=0, timeout=300)
        anthropic_tools: list[Any] = [
            {"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]}
            for t in OPENAI_TOOLS
        ]
        any_tool = {"type": "any", "disable_parallel_tool_use": True}
        one_tool = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
        for choice, allowed in [(any_tool, {"get_weather", "get_time"}), (one_tool, {"get_weather"})]:
            for _ in range(4):
                m = await a.messages.create(
                    model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "Hi!"}],
                    tools=anthropic_tools, tool_choice=choice,  # type: ignore[arg-type]
                )  # fmt: skip
                assert m.stop_reason == "tool_use"
                [block] = m.content
                assert block.type == "tool_use" and block.name in allowed
                check_call(block.name, block.input)  # type: ignore[arg-type]


async def test_a_named_tool_choice_yields_exactly_one_call_with_parallel_calls_on() -> None:
    """A named `tool_choice` is one call of that tool on every API, even with parallel calls on
    (the default) and a prompt that asks for several: instructor, the agent SDKs and the
    Anthropic SDK's forced tool round trip run each call, so a second one ran the tool twice."""
    prompt = "What is the weather in Paris, in London, in Tokyo and in Rome?"
    async with server() as s:
        client, model = oai(s), s.engine.model_id
        named: Any = {"type": "function", "function": {"name": "get_weather"}}
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], tools=OPENAI_TOOLS,
            tool_choice=named, temperature=1.0, n=8, max_tokens=MAX_TOKENS,
        )  # fmt: skip
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c.message
            [call] = c.message.tool_calls or []
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]

        responses_tools: list[Any] = [
            {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in OPENAI_TOOLS
        ]
        for _ in range(4):
            resp = await client.responses.create(
                model=model, input=prompt, tools=responses_tools,
                tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0,
                max_output_tokens=MAX_TOKENS,
            )  # fmt: skip
            [item] = resp.output
            assert item.type == "function_call" and item.name == "get_weather"

        a = anthropic.AsyncAnthropic(base_url=s.base_url, api_key="x", max_retries=0, timeout=300)
        anthropic_tools: list[Any] = [
            {"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]}
            for t in OPENAI_TOOLS
        ]
        for _ in range(4):
            m = await a.messages.create(
                model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}],
                tools=anthropic_tools, tool_choice={"type": "tool", "name": "get_weather"},
            )  # fmt: skip
            assert m.stop_reason == "tool_use"
            [block] = m.content
            assert block.type == "tool_use" and block.name == "get_weather"
