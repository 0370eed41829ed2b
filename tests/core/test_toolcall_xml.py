"""Qwen3-Coder / Qwen3.5 XML tool calls (`qwen3_coder`): what a whole output parses to, that any
split of it parses the same, typing by the tools' schemas, cuts, and linear cost."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.toolcall_events import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, ToolEvent
from ft.core.toolcalls import make_tool_call_parser, parse_tool_calls
from tests.core.test_toolcalls import cuts_strategy, split, summarize

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "where": {"type": "object"}, "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}, "level": {"enum": [1, 2, 3]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
]  # fmt: skip


def call(name: str, **params: str) -> str:
    """A call as Qwen3.5's template writes one (each value raw, between newlines)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(chunks: list[str], *, is_cut: bool = False, tools: list[dict[str, Any]] = TOOLS) -> list[ToolEvent]:
    counter = itertools.count()
    parser = make_tool_call_parser("qwen3_coder", id_factory=lambda: f"call_{next(counter)}", tools=tools)
    events: list[ToolEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish(is_cut=is_cut)
    assert parser.has_tool_calls == any(isinstance(e, ToolCallStart) for e in events)
    return events


def parsed(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """(content, [(name, arguments as a value)]) of a whole output."""
    content, calls = parse_tool_calls(text, "qwen3_coder", TOOLS)
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


CODE = 'if a < b and "</parameter>" in s:\n    print("<tool_call>", "</function>")\n'
CASES: dict[str, tuple[str, str, list[tuple[str, Any]]]] = {
    "text only": ("Hello there, how can I help?", "Hello there, how can I help?", []),
    "angle brackets that are not tags": (
        "a < b, <tool, <function x, <tool_ca",
        "a < b, <tool, <function x, <tool_ca",
        [],
    ),
    "one call": (
        call("get_weather", city="Paris", days="3"),
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "text before and between calls": (
        "Let me check.\n\n" + call("get_weather", city="Paris") + "\n" + call("get_weather", city="Oslo"),
        "Let me check.\n\n",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})],
    ),
    "text after a call": (
        call("get_weather", city="Paris") + "\n\nDone.",
        "\n\nDone.",
        [("get_weather", {"city": "Paris"})],
    ),
    "a value with newlines, <, and what looks like tags": (
        call("write_file", path="a.py", content=CODE),
        "",
        [("write_file", {"path": "a.py", "content": CODE})],
    ),
    "a value whose own newlines frame it": (
        call("write_file", path="a", content="\n\nx\n\n"),
        "",
        [("write_file", {"path": "a", "content": "\n\nx\n\n"})],
    ),
    "an empty value": (
        call("write_file", path="a", content=""),
        "",
        [("write_file", {"path": "a", "content": ""})],
    ),
    "no parameters": (
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        "",
        [("get_weather", {})],
    ),
    "tags without newlines": (
        "<tool_call><function=get_weather><parameter=days>4</parameter></function></tool_call>",
        "",
        [("get_weather", {"days": 4})],
    ),
    "no <tool_call> around the function": (
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>",
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    "no </tool_call> after the function": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\nOk.",
        "\nOk.",
        [("get_weather", {"city": "Rome"})],
    ),
    "</tool_call> where </function> was due": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</tool_call>",
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    "unicode": (
        call("write_file", path="é", content="héllo 世界 🎉"),
        "",
        [("write_file", {"path": "é", "content": "héllo 世界 🎉"})],
    ),
    "an unknown tool: strings": (call("nope", n="5"), "", [("nope", {"n": "5"})]),
    "garbage inside <tool_call> is text": (
        "<tool_call>\n{oops}</tool_call>",
        "<tool_call>\n{oops}</tool_call>",
        [],
    ),
    "garbage between parameters is text": (
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nhmm\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nhmm\n</function>\n</tool_call>",
        [],
    ),
    "a name across lines is text, and the call after it parses": (
        "<function=get\nweather>" + call("get_weather", days="1"),
        "<function=get\nweather>",
        [("get_weather", {"days": 1})],
    ),
    "an empty name is text": ("<tool_call><function=></function>", "<tool_call><function=></function>", []),
    "a stray opening tag before a call": (
        "<tool_call>" + call("get_weather", days="2"),
        "<tool_call>",
        [("get_weather", {"days": 2})],
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cases_parse_as_expected(case: str) -> None:
    """Each case's whole output gives its content and calls."""
    text, content, calls = CASES[case]
    assert parsed(text) == (content, calls)


@settings(max_examples=300)
@given(case=st.sampled_from(sorted(CASES)), cuts=cuts_strategy)
def test_events_do_not_depend_on_split_points(case: str, cuts: list[int]) -> None:
    """However a case is split into deltas (token by token among them), it parses as whole."""
    text = CASES[case][0]
    whole = summarize(run([text]))
    assert summarize(run(split(text, cuts))) == whole
    assert summarize(run(list(text))) == whole


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=", "get_weather", "</function>", "<parameter=", "city",
    "days", ">", "</parameter>", "\n", " ", "3", "Paris", "<", "</", "<tool_", "</param", "<func",
    "null", "{", "}", "é🎉",
]  # fmt: skip
outputs = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=16).map("".join)


@settings(max_examples=500)
@given(text=outputs, cuts=cuts_strategy, is_cut=st.booleans())
def test_arbitrary_output_never_raises_and_does_not_depend_on_split_points(
    text: str, cuts: list[int], is_cut: bool
) -> None:
    """Any output, however split, parses without raising and to the same result; with no call
    in it, all of it comes back as text (unless cut, which may only drop its end)."""
    whole = summarize(run([text], is_cut=is_cut))
    assert summarize(run(split(text, cuts), is_cut=is_cut)) == whole
    assert summarize(run(list(text), is_cut=is_cut)) == whole
    content, calls = whole
    if not calls:
        assert text.startswith(content) if is_cut else content == text


TYPED = {
    "string stays text": ("city", " 42 ", " 42 "),
    "integer": ("days", "7", 7),
    "integer, not one: the text": ("days", "seven", "seven"),
    "boolean": ("metric", "True", True),
    "boolean, not one: the text": ("metric", "yes", "yes"),
    "number": ("ratio", "0.25", 0.25),
    "number that overflows: the text": ("ratio", "1e400", "1e400"),
    "object as JSON": ("where", '{"lat": 1, "lon": [2]}', {"lat": 1, "lon": [2]}),
    "object as a Python literal": ("where", "{'lat': 1, 'ok': True}", {"lat": 1, "ok": True}),
    "object, not one: the text": ("where", "[1, 2]", "[1, 2]"),
    "array": ("tags", '["a", "b"]', ["a", "b"]),
    "array, broken JSON: the text": ("tags", '["a", ', '["a", '),
    "nullable string: null": ("note", "null", None),
    "nullable string: text": ("note", "nothing", "nothing"),
    "string-only null stays text": ("city", "null", "null"),
    "integer null": ("days", "null", None),
    "enum of integers": ("level", "2", 2),
    "anyOf: the integer first": ("either", "5", 5),
    "anyOf: else the text": ("either", "five", "five"),
    "undescribed parameter: text": ("extra", "5", "5"),
    "deeply nested JSON: the text": ("where", "[" * 5000 + "]" * 5000, "[" * 5000 + "]" * 5000),
}


@pytest.mark.parametrize("case", TYPED, ids=list(TYPED))
def test_values_are_typed_by_the_tools_schema(case: str) -> None:
    """A value is read as its parameter's schema type; one that does not read so stays text."""
    param, raw, value = TYPED[case]
    _, calls = parsed(call("get_weather", **{param: raw}))
    assert calls == [("get_weather", {param: value})]


def test_without_tools_every_value_is_a_string() -> None:
    """No schema, no types: the values are the text."""
    content, calls = summarize(run([call("get_weather", days="3")], tools=[]))
    assert [json.loads(c[2]) for c in calls] == [{"days": "3"}]


def test_a_call_streams_whole_once_complete() -> None:
    """Nothing of a call goes out before `</function>`; then start, arguments, end."""
    parser = make_tool_call_parser("qwen3_coder", id_factory=lambda: "call_x", tools=TOOLS)
    text = call("get_weather", days="3")
    closed = text.index("</function>") + len("</function>")
    assert parser.feed(text[: closed - 1]) == []
    assert parser.feed(text[closed - 1 :]) == [
        ToolCallStart(0, "call_x", "get_weather"),
        ToolCallArgsDelta(0, '{"days": 3}'),
        ToolCallEnd(0, '{"days": 3}'),
    ]
    assert parser.finish() == []


def test_text_streams_as_soon_as_it_cannot_be_a_tag() -> None:
    """Only what may still become `<tool_call>` or `<function=` is held back."""
    parser = make_tool_call_parser("qwen3_coder")
    assert parser.feed("a < b <tool") == [TextDelta("a < b ")]
    assert parser.feed("box <func") == [TextDelta("<toolbox ")]
    assert parser.feed("tion") == []  # `<function=` may follow
    assert parser.feed(" x") == [TextDelta("<function x")]


CALLS = [call("get_weather", city="Paris", days="3"), call("write_file", path="a", content=CODE)]


@settings(max_examples=400)
@given(cut=st.integers(min_value=0), cuts=cuts_strategy)
def test_a_call_cut_short_is_dropped_never_text(cut: int, cuts: list[int]) -> None:
    """For any cut point of valid calls, however streamed, the content holds no tag: the calls
    completed before the cut come back, the one it cut is dropped."""
    before = "Checking. "
    whole = before + "\n".join(CALLS)
    cut_text = whole[: cut % (len(whole) + 1)]
    content, calls = summarize(run(split(cut_text, cuts), is_cut=True))
    assert "<tool_call>" not in content and "<function=" not in content
    assert before.startswith(content)
    ends = [len(before + "\n".join(CALLS[: i + 1])) - len("\n</tool_call>") for i in range(len(CALLS))]
    assert len(calls) == sum(end <= len(cut_text) for end in ends)


def test_an_unfinished_call_at_the_end_is_text_unless_cut() -> None:
    """A model that stopped inside a call gets it back as text; a cut drops it."""
    fragment = "Sure. " + CALLS[1][: len(CALLS[1]) // 2]
    assert summarize(run([fragment])) == (fragment, [])
    assert summarize(run([fragment], is_cut=True)) == ("Sure. ", [])


def cpu_seconds(chunks: list[str]) -> tuple[float, list[ToolEvent]]:
    started = time.thread_time()  # CPU: a neighbour's load is not the parser's
    events = run(chunks)
    return time.thread_time() - started, events


@pytest.mark.parametrize(
    "chunks",
    [
        # 20k quoted `</parameter>` in one value, one token each
        ["<tool_call>\n<function=write_file>\n<parameter=content>\n"]
        + ["</parameter>x"] * 20_000
        + ["\n</parameter>\n</function>\n</tool_call>"],
        # a 400 KB value, one character at a time
        ["<tool_call>\n<function=write_file>\n<parameter=content>\n"]
        + list("ab<\n" * 100_000)
        + ["\n</parameter>\n</function>"],
        # 5000 calls in one delta
        ["\n".join([call("get_weather", days="1")] * 5000)],
        # a flood of whitespace where a tag may follow, one character at a time
        ["<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>"]
        + [" "] * 100_000
        + ["</function>"]
        + ["\n"] * 100_000,
        # 30k stray opening tags, each one failing
        ["<tool_call>x"] * 30_000,
    ],
    ids=["quoted closing tags", "long value", "many calls", "whitespace flood", "failing calls"],
)
def test_parsing_costs_linear_cpu_time(chunks: list[str]) -> None:
    """Each input is 0.3-0.6 MB: linear work parses it in a fraction of a second of CPU, where
    rereading the buffer or the value at each delta would take minutes."""
    spent, events = cpu_seconds(chunks)
    assert spent < 3.0, spent
    assert events
