"""Streaming tool-call parsers: events are the same however the output is split into deltas."""

from __future__ import annotations

import itertools
import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.toolcall_events import (
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolEvent,
    new_tool_call_id,
)
from ft.core.toolcalls import TOOL_CALL_PARSERS, make_tool_call_parser, parse_tool_calls

Call = tuple[str, str, str]  # (id, name, arguments)


def run(name: str | None, chunks: list[str]) -> list[ToolEvent]:
    """Feed `chunks` to a fresh parser with deterministic ids; return all events."""
    counter = itertools.count()
    parser = make_tool_call_parser(name, id_factory=lambda: f"call_{next(counter)}")
    events: list[ToolEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.finish())
    assert parser.has_tool_calls == any(isinstance(e, ToolCallStart) for e in events)
    return events


def summarize(events: list[ToolEvent]) -> tuple[str, list[Call]]:
    """Merge events into (text, calls), checking each call is well formed and ordered."""
    text: list[str] = []
    calls: list[Call] = []
    args: list[str] = []
    is_open = False
    for event in events:
        match event:
            case TextDelta(chunk):
                assert chunk, "empty TextDelta"
                assert not is_open, "text inside a call"
                text.append(chunk)
            case ToolCallStart(index, call_id, name):
                assert not is_open and index == len(calls)
                calls.append((call_id, name, ""))
                args.append("")
                is_open = True
            case ToolCallArgsDelta(index, fragment):
                assert is_open and index == len(calls) - 1
                args[index] += fragment
            case ToolCallEnd(index, arguments):
                assert is_open and index == len(calls) - 1
                assert args[index] == arguments
                assert isinstance(json.loads(arguments), dict)
                calls[index] = (calls[index][0], calls[index][1], arguments)
                is_open = False
    assert not is_open, "call never ended"
    return "".join(text), calls


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted(c % (len(text) + 1) for c in cuts)
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def assert_split_invariant(name: str, text: str, cuts: list[int]) -> tuple[str, list[Call]]:
    whole = summarize(run(name, [text]))
    assert summarize(run(name, split(text, cuts))) == whole
    assert summarize(run(name, list(text))) == whole
    return whole


cuts_strategy = st.lists(st.integers(min_value=0, max_value=10_000), max_size=12)

HERMES_CASES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "text only": ("Hello there, how can I help?", []),
    "angle brackets that are not tags": (
        "a < b and <tool is not <tool_cal a tag <tool_call",
        [],
    ),
    "one call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [("get_weather", '{"city": "Paris"}')],
    ),
    "two calls": (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    "unicode in args": (
        '<tool_call>{"name": "say", "arguments": {"text": "héllo 世界 🎉"}}</tool_call>',
        [("say", '{"text": "héllo 世界 🎉"}')],
    ),
    "arguments as a JSON string": (
        '<tool_call>{"name": "f", "arguments": "{\\"k\\": [1, 2]}"}</tool_call>',
        [("f", '{"k": [1, 2]}')],
    ),
    "parameters key": (
        '<tool_call>{"name": "f", "parameters": {"k": null}}</tool_call>',
        [("f", '{"k": null}')],
    ),
    # a 135M model under a grammar wrote this: the tag inside a string does not end the call
    "closing tag inside an argument": (
        '<tool_call>\n{"name": "w", "arguments": {"city": "NY}}</tool_call>", "q": "\\"</tool_call>"}}'
        "\n</tool_call>",
        [("w", '{"city": "NY}}</tool_call>", "q": "\\"</tool_call>"}')],
    ),
}


@pytest.mark.parametrize("case", HERMES_CASES, ids=list(HERMES_CASES))
def test_hermes_cases_parse_as_expected(case: str) -> None:
    """Each Hermes case gives the expected text and calls."""
    text, expected = HERMES_CASES[case]
    content, calls = parse_tool_calls(text, "hermes")
    assert calls == expected
    if not expected:
        assert content == text


@given(case=st.sampled_from(sorted(HERMES_CASES)), cuts=cuts_strategy)
def test_hermes_events_do_not_depend_on_split_points(case: str, cuts: list[int]) -> None:
    """However the output is split into deltas, the Hermes events are the same."""
    assert_split_invariant("hermes", HERMES_CASES[case][0], cuts)


def test_hermes_text_before_a_call_is_content() -> None:
    """Text before a call is content, the call a call."""
    text = 'Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, "hermes") == ("Let me check.\n", [("f", "{}")])


def test_hermes_whitespace_between_and_after_calls_is_dropped() -> None:
    """Whitespace between and after calls is not content."""
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(f"\n{call}\n\n{call}\n", "hermes")
    assert content == ""
    assert len(calls) == 2


def test_hermes_text_after_a_call_is_content() -> None:
    """Text after a call is content."""
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(f"{call}\n\nDone.", "hermes") == ("\n\nDone.", [("f", "{}")])


def test_hermes_whitespace_only_output_is_kept() -> None:
    """Output that is only whitespace stays as it is."""
    assert parse_tool_calls(" \n", "hermes") == (" \n", [])


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {',
        "not json",
        '{"arguments": {}}',
        '{"name": "f", "arguments": 3}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '{"name": "f", "arguments": {"s": "\\ud800"}}',
    ],
)
def test_hermes_invalid_call_is_returned_as_raw_text(body: str) -> None:
    """A call whose JSON is invalid comes back as the raw text."""
    text = f"before <tool_call>{body}</tool_call> after"
    assert parse_tool_calls(text, "hermes") == (text, [])


def test_hermes_invalid_call_does_not_stop_later_calls() -> None:
    """An invalid call does not stop the next valid one from parsing."""
    bad = "<tool_call>{oops}</tool_call>"
    good = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(bad + good, "hermes") == (bad, [("f", "{}")])


def test_hermes_unterminated_call_at_finish_is_text() -> None:
    """A call left open at the end of output is text."""
    text = 'Sure <tool_call>\n{"name": "f", "arguments": {"a": '
    assert parse_tool_calls(text, "hermes") == (text, [])


def test_hermes_complete_call_missing_its_closing_tag_is_accepted() -> None:
    """A complete call without its closing tag is still a call."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    assert parse_tool_calls(text, "hermes") == ("", [("f", '{"a": 1}')])


def test_hermes_closing_tags_inside_an_argument_cost_linear_time() -> None:
    """Each closing tag quoted inside an argument is checked without rereading the call from
    its start: thousands of them, streamed one by one, parse in well under a second."""
    parser = make_tool_call_parser("hermes")
    events = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": "')
    started = time.thread_time()  # CPU: a neighbour's load is not the parser's
    for _ in range(4000):
        events += parser.feed("</tool_call>")
    events += parser.feed('"}}\n</tool_call>') + parser.finish()
    assert time.thread_time() - started < 0.5
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd]


def test_hermes_partial_tag_at_finish_is_text() -> None:
    """A partial opening tag at the end of output is text."""
    assert parse_tool_calls("see <tool_ca", "hermes") == ("see <tool_ca", [])


def test_hermes_holds_back_only_a_partial_tag() -> None:
    """Only text that may still become `<tool_call>` is held back."""
    parser = make_tool_call_parser("hermes")
    assert parser.feed("a < b <tool") == [TextDelta("a < b ")]
    assert parser.feed("box") == [TextDelta("<toolbox")]
    assert parser.feed("<tool_call>{") == []
    assert not parser.has_tool_calls


def test_hermes_streams_a_call_as_start_args_end() -> None:
    """A call streams as start, one arguments delta, end, once its JSON is complete."""
    parser = make_tool_call_parser("hermes", id_factory=lambda: "call_x")
    assert parser.feed('<tool_call>{"name": "f", "arguments": {"b":') == []
    assert parser.feed(" 2}}</tool_call>") == [
        ToolCallStart(0, "call_x", "f"),
        ToolCallArgsDelta(0, '{"b": 2}'),
        ToolCallEnd(0, '{"b": 2}'),
    ]
    assert parser.has_tool_calls
    assert parser.finish() == []


LLAMA3_CASES: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "plain JSON call": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    "python tag": (
        '<|python_tag|>{"name": "f", "arguments": {"q": "ü"}}',
        "",
        [("f", '{"q": "ü"}')],
    ),
    "semicolon separated calls": (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}',
        "",
        [("a", "{}"), ("b", '{"n": 2}')],
    ),
    "leading whitespace and string parameters": (
        '\n {"name": "f", "parameters": "{\\"x\\": \\"}{\\"}"}',
        "",
        [("f", '{"x": "}{"}')],
    ),
    "plain text": ("The answer is {42}.", "The answer is {42}.", []),
    "text starting with a brace": ("{this is not json} at all", "{this is not json} at all", []),
    "JSON that is not a call": ('{"answer": 42} done', '{"answer": 42} done', []),
    "unterminated call": (
        '{"name": "f", "parameters": {"a": ',
        '{"name": "f", "parameters": {"a": ',
        [],
    ),
    "text after a call": (
        '{"name": "f", "parameters": {}}; and then prose',
        "and then prose",
        [("f", "{}")],
    ),
    "python tag with code": ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    "less-than text": ("<|pyth not a tag", "<|pyth not a tag", []),
}


@pytest.mark.parametrize("case", LLAMA3_CASES, ids=list(LLAMA3_CASES))
def test_llama3_cases_parse_as_expected(case: str) -> None:
    """Each Llama 3 JSON case gives the expected text and calls."""
    text, content, calls = LLAMA3_CASES[case]
    assert parse_tool_calls(text, "llama3_json") == (content, calls)


@given(case=st.sampled_from(sorted(LLAMA3_CASES)), cuts=cuts_strategy)
def test_llama3_events_do_not_depend_on_split_points(case: str, cuts: list[int]) -> None:
    """However the output is split, the Llama 3 events are the same."""
    assert_split_invariant("llama3_json", LLAMA3_CASES[case][0], cuts)


def test_llama3_plain_text_streams_without_delay() -> None:
    """Plain text streams at once; only leading whitespace waits."""
    parser = make_tool_call_parser("llama3_json")
    assert parser.feed("  ") == []
    assert parser.feed("Hi") == [TextDelta("  Hi")]
    assert parser.feed(" there") == [TextDelta(" there")]


def test_llama3_brace_prose_is_rejected_before_it_ends() -> None:
    """Prose that starts with a brace is released as text as soon as it cannot be a call."""
    parser = make_tool_call_parser("llama3_json")
    assert parser.feed("{") == []
    assert parser.feed(" x") == [TextDelta("{ x")]


def test_llama3_trailing_semicolon_is_dropped() -> None:
    """A trailing semicolon after a call is dropped."""
    assert parse_tool_calls('{"name": "f", "parameters": {}};\n', "llama3_json") == (
        "",
        [("f", "{}")],
    )


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "<",
    "_call>",
    "\n",
    " ",
    ";",
    "{",
    "}",
    '"',
    "\\",
    '{"name": "f", "arguments": {"a": [1, "x"]}}',
    '"name"',
    ": ",
    "<|python_tag|>",
    "<|py",
    "<|tool_call>",
    "<tool_call|>",
    'call:f{a:<|"|>x<|"|>}',
    '{"name": "g", "parameters": "{}"}',
    "hello",
    "é🎉",
]
outputs = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), max_size=12).map("".join)


@settings(max_examples=300)
@given(name=st.sampled_from(TOOL_CALL_PARSERS), text=outputs, cuts=cuts_strategy)
def test_arbitrary_output_never_raises_and_does_not_depend_on_split_points(
    name: str, text: str, cuts: list[int]
) -> None:
    """Any output, however split, parses without raising and to the same result."""
    content, calls = assert_split_invariant(name, text, cuts)
    if not calls:
        assert content == text


@given(text=st.text(), cuts=cuts_strategy)
def test_passthrough_returns_all_text(text: str, cuts: list[int]) -> None:
    """Without a parser, every character comes back as text."""
    assert summarize(run(None, split(text, cuts))) == (text, [])


def test_unknown_parser_name_lists_the_known_ones() -> None:
    """An unknown parser name is refused with the list of known ones."""
    with pytest.raises(ValueError, match=r"hermes.*llama3_json"):
        make_tool_call_parser("nope")


def test_call_ids_are_call_and_24_alphanumerics() -> None:
    """Call ids are `call_` and 24 alphanumerics, and distinct."""
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


@pytest.mark.parametrize("name", TOOL_CALL_PARSERS)
def test_deeply_nested_arguments_are_text_not_an_error(name: str) -> None:
    """Arguments nested past the JSON parser's depth are text, not an error."""
    nested = "[" * 100_000 + "]" * 100_000
    call = f'{{"name": "f", "arguments": {{"a": {nested}}}}}'
    text = f"<tool_call>{call}</tool_call>" if name == "hermes" else call
    assert parse_tool_calls(text, name) == (text, [])


def test_arguments_that_overflow_to_infinity_are_not_a_call() -> None:
    """Arguments with a number that overflows to infinity are not a call."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1e400}}</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert calls == [] and content == text


# --- an output cut short (max_tokens) --------------------------------------------------------

# Per format: text before the calls, the calls as the model writes them, and the opening
# markers no cut may surface as text.
CUT_FORMATS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "hermes": (
        "Let me check. ",
        [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            '\n<tool_call>\n{"name": "b", "arguments": {"q": "</tool_call>"}}\n</tool_call>',
        ],
        ("<tool_call>", '{"name"'),
    ),
    "llama3_json": (
        "",
        [
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
            '; {"name": "b", "parameters": {}}',
        ],
        ("<|python_tag|>", '{"name"'),
    ),
    "phi4_mini_json": (
        "Checking. ",
        [
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>',
            '<|tool_call|>[{"name": "b", "arguments": {"q": "]<|/tool_call|>"}}]<|/tool_call|>',
        ],
        ("<|tool_call|>", '{"name"'),
    ),
    "granite": (
        "",
        [
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            '<|tool_call|>[{"name": "b", "arguments": {}}]',
        ],
        ("<|tool_call|>", '{"name"'),
    ),
    "gemma4": (
        "Checking. ",
        [
            '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
            '<|tool_call>call:b{q:<|"|><tool_call|>}<|"|>}<tool_call|>',
        ],
        ("<|tool_call>", "call:"),
    ),
}


def run_cut(name: str, chunks: list[str]) -> list[ToolEvent]:
    counter = itertools.count()
    parser = make_tool_call_parser(name, id_factory=lambda: f"call_{next(counter)}")
    events: list[ToolEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.finish(is_cut=True))
    return events


@settings(max_examples=400)
@given(name=st.sampled_from(sorted(CUT_FORMATS)), cut=st.integers(min_value=0), cuts=cuts_strategy)
def test_a_call_cut_short_is_never_surfaced_as_text(name: str, cut: int, cuts: list[int]) -> None:
    """For any cut point of valid calls, however streamed, no content holds a call's opening
    marker: the calls complete before the cut come back, the one it cut is dropped."""
    before, calls, markers = CUT_FORMATS[name]
    whole = before + "".join(calls)
    cut_text = whole[: cut % (len(whole) + 1)]
    content, parsed = summarize(run_cut(name, split(cut_text, cuts)))
    assert not any(marker in content for marker in markers)
    assert before.startswith(content)  # only the text before the calls, maybe held back at the cut
    complete = len([i for i in range(len(calls)) if len(before + "".join(calls[: i + 1])) <= len(cut_text)])
    assert len(parsed) in (complete, complete + 1)  # the last may parse before its closing tag


@pytest.mark.parametrize("name", sorted(CUT_FORMATS))
def test_an_output_that_ends_without_a_cut_still_returns_an_unfinished_call_as_text(name: str) -> None:
    """Only a cut drops an unfinished call: a model that stopped inside one gets it back as text."""
    before, calls, _ = CUT_FORMATS[name]
    fragment = before + calls[0][: len(calls[0]) // 2]
    assert summarize(run(name, [fragment])) == (fragment, [])
    assert summarize(run_cut(name, [fragment])) == (before, [])


@pytest.mark.parametrize(
    ("fragment", "kept"),
    [
        ('{"answer": "Paris is the capital of', True),  # a JSON answer, not a call: stays text
        ('{"answer": 1, "name": "f", "parameters": {', False),  # a "name" key: may be a call
        ('{"name": "get_w', False),
        ('{"na', False),
        ("{", False),
        ('<|python_tag|>{"answer": 1', False),  # the tag says a call follows
    ],
)
def test_a_cut_llama3_json_answer_that_cannot_be_a_call_stays_text(fragment: str, kept: bool) -> None:
    """With the `llama3_json` parser, a JSON answer cut by `max_tokens` (structured output with
    tools offered) is returned as text; an object that may be a call is dropped."""
    parser = make_tool_call_parser("llama3_json")
    events = parser.feed(fragment) + parser.finish(is_cut=True)
    assert events == ([TextDelta(fragment)] if kept else [])
