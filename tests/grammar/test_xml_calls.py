"""Forced tool calls in Qwen3-Coder's XML (`qwen3_coder`): the grammar allows only calls of the
allowed tools with values of their parameters' types, and what it allows the parser reads back
as those values, on random models too."""

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

PLACE = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"type": "integer"}},
         "required": ["city"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"},
    "where": {"$ref": "#/$defs/place"}},
    "required": ["city", "days"], "$defs": {"place": PLACE}}  # fmt: skip
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


ANY = byte_matcher(spec.tool_calls(TOOLS, name=None, parallel=True, parser="qwen3_coder"))
WEATHER_CALL = call("get_weather", city="Paris", days="3", unit="celsius")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (WEATHER_CALL, True),
        (call("get_weather", city="a\n<b>\n</function>", days="3", metric="true"), True),
        (call("get_weather", city="x", days="3", where='{"city": "Oslo", "zip": 123}'), True),
        (call("get_time"), True),
        (WEATHER_CALL + "\n" + call("get_time"), True),  # parallel
        ("Sure! " + WEATHER_CALL, False),  # nothing but calls
        (call("get_weather", days="3"), False),  # city is required
        (call("get_weather", days="3", city="Paris"), False),  # in the schema's order
        (call("get_weather", city="Paris", days="three"), False),
        (call("get_weather", city="Paris", days="30"), False),  # maximum 9
        (call("get_weather", city="Paris", days="3", unit="kelvin"), False),
        (call("get_weather", city="Paris", days="3", where='{"city": "Rome"}'), False),  # $ref followed
        (call("get_weather", city="a</parameter>b", days="3"), False),  # a value cannot hold its close
        (call("rm_rf"), False),
    ],
)
def test_the_grammar_allows_only_valid_calls(text: str, ok: bool) -> None:
    """Calls of the allowed tools, each parameter of its type, required ones present, in order."""
    assert accepts(ANY, text) is ok


def test_a_named_tool_is_exactly_one_call_of_it() -> None:
    one = byte_matcher(spec.tool_calls(TOOLS, name="get_time", parallel=False, parser="qwen3_coder"))
    assert accepts(one, call("get_time"))
    assert not accepts(one, WEATHER_CALL)
    assert not accepts(one, call("get_time") + "\n" + call("get_time"))


def test_auto_with_a_json_answer_allows_calls_or_the_answer() -> None:
    answer = spec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}}, "x")
    m = byte_matcher(spec.tool_calls(TOOLS, name=None, parallel=True, parser="qwen3_coder", otherwise=answer))
    assert accepts(m, '{"ok": true}') and accepts(m, WEATHER_CALL) and not accepts(m, "hello")


texts = st.text(st.characters(codec="utf-8"), max_size=40).filter(lambda s: "</parameter>" not in s)


@settings(max_examples=200)
@given(
    city=texts, days=st.integers(1, 9), metric=st.booleans(), unit=st.sampled_from(["celsius", "fahrenheit"])
)
def test_what_the_grammar_allows_the_parser_reads_back(city: str, days: int, metric: bool, unit: str) -> None:
    """Any text the grammar writes (a string with newlines, tags, `<`), reads back as written,
    and each typed value as its type."""
    text = call("get_weather", city=city, days=str(days), unit=unit, metric=json.dumps(metric))
    assert accepts(ANY, text)
    assert parse_tool_calls(text, "qwen3_coder", TOOLS) == (
        "",
        [
            (
                "get_weather",
                json.dumps({"city": city, "days": days, "unit": unit, "metric": metric}, ensure_ascii=False),
            )
        ],
    )


BOUNDED = {"type": "object", "properties": {
    "days": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "metric": {"type": "boolean"}, "where": {"$ref": "#/$defs/place"}},
    "required": ["days", "unit"],
    "$defs": {"place": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                        "required": ["city"], "additionalProperties": False}}}  # fmt: skip
BOUNDED_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "forecast", "parameters": BOUNDED}}
]


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), temperature=st.floats(0.5, 2.0))
def test_random_models_forced_to_call_write_calls_that_parse(seed: int, temperature: float) -> None:
    """Whatever the weights and the seed, a forced call parses to a call whose arguments follow
    the tool's schema (every value here is bounded, so the grammar ends it within 250 tokens)."""
    runner = byte_runner(seed % 7)
    grammar = spec.tool_calls(BOUNDED_TOOLS, name="forecast", parallel=False, parser="qwen3_coder")
    params = SamplingParams(temperature=temperature, seed=seed)
    [(tokens, ended)] = generate(runner, [byte_seq_matcher(grammar)], [params], 250)
    assert ended
    content, calls = parse_tool_calls(text_of(tokens), "qwen3_coder", BOUNDED_TOOLS)
    assert content == "" and [name for name, _ in calls] == ["forecast"]
    jsonschema.validate(json.loads(calls[0][1]), BOUNDED)


@pytest.mark.parametrize("bad", ["a>b", "a<b", "a\nb", "a\tb", " a", "a ", "", "x" * 257])
@pytest.mark.parametrize("where", ["function", "parameter"])
def test_a_forced_call_whose_names_the_format_cannot_carry_is_refused(bad: str, where: str) -> None:
    """The parser reads a name up to its `>` and refuses `<`, line breaks and tabs in it (and
    strips spaces): a grammar forcing such a name forced text read back as plain text, or as a
    call with the wrong argument (`a>b`: the value of `a`, "b>..."). A 400 naming it instead."""
    function, parameter = ("f", bad) if where == "parameter" else (bad, "p")
    params = {"type": "object", "properties": {parameter: {"type": "string"}}, "required": [parameter]}
    tools = [{"type": "function", "function": {"name": function, "parameters": params}}]
    with pytest.raises(InvalidRequest, match=f"{where} name"):
        spec.tool_calls(tools, name=None, parallel=False, parser="qwen3_coder")


def test_names_the_format_carries_are_forced_and_read_back() -> None:
    name = "n" * 256
    tools = [{"type": "function", "function": {"name": "get-x.y_z", "parameters": {
        "type": "object", "properties": {name: {"type": "string"}, "a b": {"type": "integer"}},
        "required": [name, "a b"]}}}]  # fmt: skip
    matcher = byte_matcher(spec.tool_calls(tools, name=None, parallel=False, parser="qwen3_coder"))
    text = call("get-x.y_z", **{name: "hi", "a b": "3"})
    assert accepts(matcher, text)
    assert parse_tool_calls(text, "qwen3_coder", tools=tools)[1] == [
        ("get-x.y_z", json.dumps({name: "hi", "a b": 3}))
    ]
