"""Gemma 4's tool calls (`gemma4`): what a whole output parses to, that any split of it parses the
same, typing by the tools' schemas, cuts, and linear cost."""

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

Q = '<|"|>'
PLACE = {"type": "object", "properties": {"zip": {"type": "string"}, "lat": {"type": "number"}}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "where": {"$ref": "#/$defs/place"}, "tags": {"type": "array",
        "items": {"type": "string"}}, "note": {"type": ["string", "null"]}, "level": {"enum": [1, 2, 3]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "raw": {"type": "object"}},
        "$defs": {"place": PLACE}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
]  # fmt: skip


def call(name: str, arguments: str) -> str:
    """A call as Gemma 4 writes one: `arguments` in its notation, between the braces."""
    return f"<|tool_call>call:{name}{{{arguments}}}<tool_call|>"


def run(chunks: list[str], *, is_cut: bool = False, tools: list[dict[str, Any]] = TOOLS) -> list[ToolEvent]:
    counter = itertools.count()
    parser = make_tool_call_parser("gemma4", id_factory=lambda: f"call_{next(counter)}", tools=tools)
    events: list[ToolEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish(is_cut=is_cut)
    assert parser.has_tool_calls == any(isinstance(e, ToolCallStart) for e in events)
    return events


def parsed(text: str, tools: list[dict[str, Any]] = TOOLS) -> tuple[str, list[tuple[str, Any]]]:
    """(content, [(name, arguments as a value)]) of a whole output."""
    content, calls = parse_tool_calls(text, "gemma4", tools)
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


CODE = f'if a < b and "{Q}" not in s:\n    print("<tool_call|>", "}}", "]", ",")\n'.replace(Q, "'")
CASES: dict[str, tuple[str, str, list[tuple[str, Any]]]] = {
    "text only": ("Hello there, how can I help?", "Hello there, how can I help?", []),
    "markers' look-alikes": ("a <| b, <|tool_ca, <tool_call|> c", "a <| b, <|tool_ca, <tool_call|> c", []),
    "one call": (
        call("get_weather", f"city:{Q}Paris{Q},days:3"),
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "text, then calls one after the other": (
        "Checking.\n" + call("get_weather", f"city:{Q}Oslo{Q}") + call("write_file", f"path:{Q}a{Q}"),
        "Checking.\n",
        [("get_weather", {"city": "Oslo"}), ("write_file", {"path": "a"})],
    ),
    "whitespace between calls is dropped": (
        "\n" + call("write_file", "") + "\n\n" + call("write_file", "") + "\n",
        "",
        [("write_file", {}), ("write_file", {})],
    ),
    "a string holds markers, braces and newlines": (
        call("write_file", f"path:{Q}x.py{Q},content:{Q}{CODE}{Q}"),
        "",
        [("write_file", {"path": "x.py", "content": CODE})],
    ),
    "nested objects and arrays, spaces around": (
        call("f", f" a : {{ b : [ 1 , true , null , {Q}x{Q} ] , c : {{}} }} , d : [ ] "),
        "",
        [("f", {"a": {"b": [1, True, None, "x"], "c": {}}, "d": []})],
    ),
    "delimited keys": (call("f", f"{Q}a key{Q}:1,{Q}b:c{Q}:{Q}v{Q}"), "", [("f", {"a key": 1, "b:c": "v"})]),
    "a trailing comma": (call("f", "a:1,"), "", [("f", {"a": 1})]),
    "an unclosed call before another": (
        "<|tool_call>call:f{a:1}" + call("g", ""),
        "",
        [("f", {"a": 1}), ("g", {})],
    ),
    "a complete call whose close never came": ("<|tool_call>call:f{a:1}", "", [("f", {"a": 1})]),
    "an unfinished call at the end is text": ("So <|tool_call>call:f{a:1", "So <|tool_call>call:f{a:1", []),
    "no `call:` is text": (
        "<|tool_call>get_weather{}<tool_call|>",
        "<|tool_call>get_weather{}<tool_call|>",
        [],
    ),
    "a missing value is text, the next call read": (
        call("f", "a:") + call("g", "b:2"),
        call("f", "a:"),
        [("g", {"b": 2})],
    ),
    "a name with a space is text": (call("get weather", ""), call("get weather", ""), []),
    "an unclosed string is text": (call("f", f"a:{Q}x"), call("f", f"a:{Q}x"), []),
    "text after the braces is text": (call("f", "a:1}x"), call("f", "a:1}x"), []),
    "too deep is text": (call("f", "a:" + "[" * 70 + "]" * 70), call("f", "a:" + "[" * 70 + "]" * 70), []),
    "unicode": (call("f", f"t:{Q}héllo 世界 🎉{Q}"), "", [("f", {"t": "héllo 世界 🎉"})]),
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
    "<|tool_call>", "<tool_call|>", "call:", "get_weather", "f", "{", "}", "[", "]", ":", ",", Q, "<|",
    '"|>', "<|tool", "call|>", "city", "3", "true", "None", " ", "\n", "é🎉",
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
    "string": ("city", f"{Q}Paris{Q}", "Paris"),
    "string written bare: the text": ("city", "02134", "02134"),
    "string written bare true: the text": ("city", "true", "true"),
    "integer": ("days", "7", 7),
    "integer delimited: read as one": ("days", f"{Q}7{Q}", 7),
    "integer, not one: the text": ("days", f"{Q}seven{Q}", "seven"),
    "boolean": ("metric", "true", True),
    "boolean as Python writes it": ("metric", "True", True),
    "number": ("ratio", "0.25", 0.25),
    "number that overflows: the text": ("ratio", "1e400", "1e400"),
    "nested properties typed, through $ref": (
        "where",
        f"{{zip:02134,lat:{Q}1.5{Q}}}",
        {"zip": "02134", "lat": 1.5},
    ),
    "array items typed": ("tags", f"[{Q}a{Q},7]", ["a", "7"]),
    "nullable string: null": ("note", "null", None),
    "nullable string: None as the template writes it": ("note", "None", None),
    "string-only null stays text": ("city", "null", "null"),
    "enum of integers": ("level", "2", 2),
    "anyOf: the integer first": ("either", "5", 5),
    "anyOf: else the text": ("either", f"{Q}five{Q}", "five"),
    "object as JSON text": ("raw", f'{Q}{{"a": [1]}}{Q}', {"a": [1]}),
    "undescribed parameter: a literal": ("extra", "5", 5),
    "undescribed parameter: text": ("extra", "five", "five"),
}


@pytest.mark.parametrize("case", TYPED, ids=list(TYPED))
def test_values_are_typed_by_the_tools_schema(case: str) -> None:
    """Where the notation is ambiguous, a value is read as its parameter's schema type; one
    that does not read so stays text."""
    param, raw, value = TYPED[case]
    assert parsed(call("get_weather", f"{param}:{raw}")) == ("", [("get_weather", {param: value})])


def test_without_tools_bare_tokens_are_literals_and_strings_text() -> None:
    """No schema: a bare token is a JSON literal when it reads as one, a string stays text."""
    text = call("get_weather", f"days:3,ok:false,n:None,city:{Q}3{Q},zip:02134")
    assert parsed(text, tools=[]) == (
        "",
        [("get_weather", {"days": 3, "ok": False, "n": None, "city": "3", "zip": "02134"})],
    )


def test_a_call_streams_whole_once_closed() -> None:
    """Nothing of a call goes out before `<tool_call|>`; then start, arguments, end."""
    parser = make_tool_call_parser("gemma4", id_factory=lambda: "call_x", tools=TOOLS)
    text = call("get_weather", "days:3")
    assert parser.feed(text[:-1]) == []
    assert parser.feed(text[-1:]) == [
        ToolCallStart(0, "call_x", "get_weather"),
        ToolCallArgsDelta(0, '{"days": 3}'),
        ToolCallEnd(0, '{"days": 3}'),
    ]
    assert parser.finish() == []


def test_text_streams_as_soon_as_it_cannot_be_a_marker() -> None:
    """Only what may still become `<|tool_call>` is held back."""
    parser = make_tool_call_parser("gemma4")
    assert parser.feed("a < b <|tool") == [TextDelta("a < b ")]
    assert parser.feed("box <|") == [TextDelta("<|toolbox ")]
    assert parser.feed("x") == [TextDelta("<|x")]


CALLS = [
    call("get_weather", f"city:{Q}Paris{Q},days:3"),
    call("write_file", f"path:{Q}a{Q},content:{Q}{CODE}{Q}"),
]


@settings(max_examples=400)
@given(cut=st.integers(min_value=0), cuts=cuts_strategy)
def test_a_call_cut_short_is_dropped_never_text(cut: int, cuts: list[int]) -> None:
    """For any cut point of valid calls, however streamed, the content holds no marker: the
    calls closed before the cut come back, the one it cut is dropped (or read, if it was
    complete but for its `<tool_call|>`)."""
    before = "Checking. "
    whole = before + "".join(CALLS)
    cut_text = whole[: cut % (len(whole) + 1)]
    content, calls = summarize(run(split(cut_text, cuts), is_cut=True))
    assert "<|tool_call>" not in content and "<|" not in content
    assert before.startswith(content)
    ends = [len(before + "".join(CALLS[: i + 1])) - len("<tool_call|>") for i in range(len(CALLS))]
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
        # 20k quoted `<tool_call|>` in one string, one token each
        [f"<|tool_call>call:write_file{{content:{Q}"] + ["<tool_call|>x"] * 20_000 + [f"{Q}}}<tool_call|>"],
        # a 400 KB string, one character at a time
        [f"<|tool_call>call:write_file{{content:{Q}"] + list("ab<|\n" * 80_000) + [f"{Q}}}<tool_call|>"],
        # 5000 calls in one delta
        [call("get_weather", "days:1") * 5000],
        # 20k strings of one argument array, one token each
        ["<|tool_call>call:f{a:["] + [f"{Q}x{Q},"] * 20_000 + ["]}<tool_call|>"],
        # a flood of whitespace inside a call, one character at a time, then after it
        ["<|tool_call>call:f{a:1"] + [" "] * 100_000 + ["}<tool_call|>"] + ["\n"] * 100_000,
        # 30k stray opening markers, each one failing
        ["<|tool_call>x"] * 30_000,
    ],
    ids=[
        "quoted closing markers",
        "long string",
        "many calls",
        "many strings",
        "whitespace flood",
        "failing calls",
    ],
)
def test_parsing_costs_linear_cpu_time(chunks: list[str]) -> None:
    """Each input is 0.2-0.5 MB: linear work parses it in a fraction of a second of CPU, where
    rereading the buffer or the call at each delta would take minutes."""
    spent, events = cpu_seconds(chunks)
    assert spent < 3.0, spent
    assert events
