"""Phi-4-mini's and Granite's tool calls (a JSON array after a marker), streamed."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft.core.toolcall_events import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from ft.core.toolcalls import make_tool_call_parser, parse_tool_calls
from tests.core.test_toolcalls import assert_split_invariant, cuts_strategy

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CASES: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "phi4 one call": (
        "phi4_mini_json",
        f"<|tool_call|>[{WEATHER}]<|/tool_call|>",
        [("get_weather", '{"city": "Paris"}')],
    ),
    "phi4 two calls in one array": (
        "phi4_mini_json",
        '<|tool_call|>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]<|/tool_call|>',
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    "phi4 one object, no array": (
        "phi4_mini_json",
        f"<|tool_call|>{WEATHER}<|/tool_call|>",
        [("get_weather", '{"city": "Paris"}')],
    ),
    "phi4 vLLM's functools form": (
        "phi4_mini_json",
        f"functools[{WEATHER}]",
        [("get_weather", '{"city": "Paris"}')],
    ),
    "phi4 markers inside an argument": (
        "phi4_mini_json",
        '<|tool_call|>[{"name": "w", "arguments": {"q": "]<|/tool_call|> [{\\"x"}}]<|/tool_call|>',
        [("w", '{"q": "]<|/tool_call|> [{\\"x"}')],
    ),
    "granite one call": ("granite", f"<|tool_call|>[{WEATHER}]", [("get_weather", '{"city": "Paris"}')]),
    "granite parameters key, two calls": (
        "granite",
        '<|tool_call|>[{"name": "a", "parameters": {"k": null}}, {"name": "b", "arguments": "{\\"n\\": 2}"}]',
        [("a", '{"k": null}'), ("b", '{"n": 2}')],
    ),
    "granite hermes-style tag": (
        "granite",
        f"<tool_call>[{WEATHER}]</tool_call>",
        [("get_weather", '{"city": "Paris"}')],
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cases_parse_as_expected(case: str) -> None:
    name, text, expected = CASES[case]
    content, calls = parse_tool_calls(text, name)
    assert calls == expected and content == ""


@given(case=st.sampled_from(sorted(CASES)), cuts=cuts_strategy)
def test_events_do_not_depend_on_split_points(case: str, cuts: list[int]) -> None:
    name, text, _ = CASES[case]
    assert_split_invariant(name, "Sure. " + text + " Done.", cuts)


@pytest.mark.parametrize("name", ["phi4_mini_json", "granite"])
def test_text_around_calls_is_content(name: str) -> None:
    end = "<|/tool_call|>" if name == "phi4_mini_json" else ""
    text = f"Let me look.\n<|tool_call|>[{WEATHER}]{end}\nDone."
    assert parse_tool_calls(text, name) == ("Let me look.\n\nDone.", [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize(
    "text",
    [
        "I used Python's functools module to cache it.",  # the marker word in prose
        "functools [1, 2]",  # an array that is not calls
        "<|tool_call|>[]<|/tool_call|>",  # no calls at all
        '<|tool_call|>[{"name": "f", "arguments": 3}]<|/tool_call|>',  # arguments not an object
        '<|tool_call|>[{"name": "f", "arguments": {}}, "x"]<|/tool_call|>',  # one item is no call
        '<|tool_call|>[{"name": "f", "arguments": {"a": NaN}}]<|/tool_call|>',
        "<|tool_call|> not json",
    ],
)
def test_a_marker_not_followed_by_calls_is_text(text: str) -> None:
    assert parse_tool_calls(text, "phi4_mini_json") == (text, [])


def test_an_invalid_call_does_not_stop_the_next() -> None:
    bad = "<|tool_call|>[{oops}]"
    good = f"<|tool_call|>[{WEATHER}]"
    assert parse_tool_calls(bad + good, "granite") == (bad, [("get_weather", '{"city": "Paris"}')])


def test_a_complete_call_missing_its_closing_marker_is_accepted() -> None:
    assert parse_tool_calls(f"<|tool_call|>[{WEATHER}]\n", "phi4_mini_json") == (
        "",
        [("get_weather", '{"city": "Paris"}')],
    )


def test_an_unterminated_call_is_text_unless_cut() -> None:
    text = '<|tool_call|>[{"name": "f", "arguments": {"a": '
    assert parse_tool_calls(text, "granite") == (text, [])
    parser = make_tool_call_parser("granite")
    assert parser.feed("Hi " + text) + parser.finish(is_cut=True) == [TextDelta("Hi ")]


def test_only_a_partial_marker_is_held_back() -> None:
    parser = make_tool_call_parser("phi4_mini_json")
    assert parser.feed("a <|tool") == [TextDelta("a ")]
    assert parser.feed("box|> func") == [TextDelta("<|toolbox|> ")]
    assert parser.feed("tion") == [TextDelta("function")]
    assert parser.feed("<|tool_call|>[{") == []
    assert not parser.has_tool_calls


def test_the_closing_marker_is_awaited_not_taken_as_text() -> None:
    parser = make_tool_call_parser("phi4_mini_json")
    events = parser.feed(f"<|tool_call|>[{WEATHER}]<|/tool")
    assert events == []
    events = parser.feed("_call|>ok")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd, TextDelta]
    assert events[-1] == TextDelta("ok")


def test_brackets_inside_arguments_cost_linear_time() -> None:
    """The array is scanned once however it is streamed: thousands of quoted brackets, one per
    delta, parse in well under a second."""
    parser = make_tool_call_parser("granite")
    events = parser.feed('<|tool_call|>[{"name": "f", "arguments": {"a": "')
    started = time.thread_time()  # CPU: a neighbour's load is not the parser's
    for _ in range(4000):
        events += parser.feed("]}")
    events += parser.feed('"}}]') + parser.finish()
    assert time.thread_time() - started < 0.5
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
