"""Forced tool calls in Gemma 4's notation (`gemma4`): the grammar allows only calls of the allowed
tools with values of their parameters' schemas, and what it allows the parser reads back as
those values (values drawn by hypothesis, and what random models write under it)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.toolcalls import parse_tool_calls
from ft.errors import InvalidRequest
from ft.grammar import spec
from ft.params import SamplingParams
from tests.grammar.test_grammar import accepts
from tests.support.grammar import byte_matcher, byte_runner, byte_seq_matcher, generate, text_of

Q = '<|"|>'
PLACE = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"type": "integer"}},
         "required": ["city"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"},
    "where": {"$ref": "#/$defs/place"}, "tags": {"type": "array", "items": {"type": "string"}},
    "ratio": {"type": ["number", "null"]}, "extra": {"type": "object"}, "a key": {"type": "string"}},
    "required": ["city", "days"], "$defs": {"place": PLACE}}  # fmt: skip
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def written(value: Any) -> str:
    """`value` in Gemma 4's notation, as its template's `format_argument` writes an argument
    (keys bare and sorted; here delimited where a bare one would not read back)."""
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + members(value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(written(v) for v in value) + "]"
    return json.dumps(value)


def members(arguments: dict[str, Any]) -> str:
    return ",".join(
        f"{k if k.isidentifier() else Q + k + Q}:{written(v)}" for k, v in sorted(arguments.items())
    )


def call(name: str, **arguments: Any) -> str:
    return f"<|tool_call>call:{name}{{{members(arguments)}}}<tool_call|>"


ANY = byte_matcher(spec.tool_calls(TOOLS, name=None, parallel=True, parser="gemma4"))
WEATHER_CALL = call("get_weather", city="Paris", days=3, unit="celsius")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (WEATHER_CALL, True),
        (call("get_weather", city='a\n<tool_call|> } ] , "x"', days=3, metric=True), True),
        (call("get_weather", city="x", days=3, where={"city": "Oslo", "zip": 123}), True),
        (
            call("get_weather", city="x", days=3, tags=["a", "b"], ratio=None, extra={"k": [1, {"j": "v"}]}),
            True,
        ),
        (call("get_weather", **{"city": "x", "days": 3, "a key": "v"}), True),  # a key that must be delimited
        (call("get_time"), True),
        (WEATHER_CALL + call("get_time"), True),  # parallel: one after the other
        ("Sure! " + WEATHER_CALL, False),  # nothing but calls
        (WEATHER_CALL + "\n" + call("get_time"), False),  # nothing between them
        (call("get_weather", days=3), False),  # city is required
        ('<|tool_call>call:get_weather{days:3,city:<|"|>P<|"|>}<tool_call|>', False),  # keys sorted
        (call("get_weather", city="Paris", days="3"), False),  # an integer, not a string
        (call("get_weather", city="Paris", days=30), False),  # maximum 9
        (call("get_weather", city="Paris", days=3, unit="kelvin"), False),
        (call("get_weather", city="Paris", days=3, where={"city": "Rome"}), False),  # $ref followed
        (call("get_weather", city="Paris", days=3, undeclared=1), False),
        (call("get_time", x=1), False),  # `properties: {}` lists none
        (call("get_weather", city="a" + Q + "b", days=3), False),  # a string cannot hold its marker
        (call("rm_rf"), False),
    ],
)
def test_the_grammar_allows_only_valid_calls(text: str, ok: bool) -> None:
    """Calls of the allowed tools, each argument of its schema, required ones present, keys sorted."""
    assert accepts(ANY, text) is ok


def test_a_named_tool_is_exactly_one_call_of_it() -> None:
    one = byte_matcher(spec.tool_calls(TOOLS, name="get_time", parallel=False, parser="gemma4"))
    assert accepts(one, call("get_time"))
    assert not accepts(one, WEATHER_CALL)
    assert not accepts(one, call("get_time") + call("get_time"))


def test_auto_with_a_json_answer_allows_calls_or_the_answer() -> None:
    answer = spec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}}, "x")
    m = byte_matcher(spec.tool_calls(TOOLS, name=None, parallel=True, parser="gemma4", otherwise=answer))
    assert accepts(m, '{"ok": true}') and accepts(m, WEATHER_CALL) and not accepts(m, "hello")


texts = st.text(st.characters(codec="utf-8"), max_size=30).filter(lambda s: Q not in s)
leaves = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | texts
anything = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300)
@given(
    city=texts,
    days=st.integers(1, 9),
    metric=st.booleans(),
    unit=st.sampled_from(["celsius", "fahrenheit"]),
    tags=st.lists(texts, max_size=3),
    ratio=st.none() | st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-100, 100),
    extra=st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), anything, max_size=3),
)
def test_what_the_grammar_allows_the_parser_reads_back(
    city: str, days: int, metric: bool, unit: str, tags: list[str], ratio: float | None, extra: dict[str, Any]
) -> None:
    """Any call the grammar allows (strings with markers' pieces, braces, newlines; any value
    where the schema says only "object") reads back as written, each value as its type."""
    arguments = {"city": city, "days": days, "unit": unit, "metric": metric, "tags": tags, "ratio": ratio}
    arguments["extra"] = extra
    text = call("get_weather", **arguments)
    assert accepts(ANY, text)
    content, calls = parse_tool_calls(text, "gemma4", TOOLS)
    assert content == "" and [name for name, _ in calls] == ["get_weather"]
    assert json.loads(calls[0][1]) == arguments


BOUNDED = {"type": "object", "properties": {
    "days": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "metric": {"type": "boolean"}, "where": {"$ref": "#/$defs/place"},
    "stops": {"type": "array", "items": {"enum": ["a", "b", 3, None]}}},
    "required": ["days", "unit"],
    "$defs": {"place": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                         "near": {"type": "boolean"}},
                        "required": ["city"], "additionalProperties": False}}}  # fmt: skip
BOUNDED_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "forecast", "parameters": BOUNDED}}
]


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), temperature=st.floats(0.5, 2.0))
def test_random_models_forced_to_call_write_calls_that_parse(seed: int, temperature: float) -> None:
    """Whatever the weights and the seed, a forced call parses to a call whose arguments follow
    the tool's schema (every value here is bounded, so the grammar ends it within 300 tokens)."""
    runner = byte_runner(seed % 7)
    grammar = spec.tool_calls(BOUNDED_TOOLS, name="forecast", parallel=False, parser="gemma4")
    params = SamplingParams(temperature=temperature, seed=seed)
    [(tokens, ended)] = generate(runner, [byte_seq_matcher(grammar)], [params], 300)
    assert ended
    content, calls = parse_tool_calls(text_of(tokens), "gemma4", BOUNDED_TOOLS)
    assert content == "" and [name for name, _ in calls] == ["forecast"]
    jsonschema.validate(json.loads(calls[0][1]), BOUNDED)


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "function", "function": {"name": "get weather", "parameters": {}}}],
        [{"type": "function", "function": {"name": "f{x}", "parameters": {}}}],
        [{"type": "function", "function": {"name": "f" * 257, "parameters": {}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": {'a<|"|>b': {}}}}}],
    ],
    ids=["a space", "braces", "too long", "a quote in a key"],
)
def test_names_the_notation_cannot_carry_are_refused(tools: list[dict[str, Any]]) -> None:
    """A forced call of a name the parser would not read back as written is a 400 naming the
    tools, not a grammar whose calls come back as text."""
    with pytest.raises(InvalidRequest) as refused:
        spec.tool_calls(tools, name=None, parallel=False, parser="gemma4")
    assert refused.value.param == "tools" and "gemma4" in str(refused.value)
