"""Streaming reasoning parser: `<think>` blocks and Gemma 4 channels split from content, whatever the
delta split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.reasoning import (
    REASONING_PARSERS,
    ContentDelta,
    ReasoningDelta,
    ReasoningEvent,
    make_reasoning_parser,
    reasoning_left_open,
)


def run(name: str | None, chunks: list[str], starts_in_reasoning: bool | None = None) -> list[ReasoningEvent]:
    parser = make_reasoning_parser(name, starts_in_reasoning=starts_in_reasoning)
    events: list[ReasoningEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.finish())
    return events


def summarize(events: list[ReasoningEvent]) -> tuple[str, str]:
    """(reasoning, content), checking that no event is empty."""
    reasoning: list[str] = []
    content: list[str] = []
    for event in events:
        assert event.text, "empty delta"
        match event:
            case ReasoningDelta(text):
                reasoning.append(text)
            case ContentDelta(text):
                content.append(text)
    return "".join(reasoning), "".join(content)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted(c % (len(text) + 1) for c in cuts)
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def parse(name: str | None, text: str, starts_in_reasoning: bool | None = None) -> tuple[str, str]:
    return summarize(run(name, [text], starts_in_reasoning))


cuts_strategy = st.lists(st.integers(min_value=0, max_value=10_000), max_size=12)

CASES: dict[str, tuple[str, bool, tuple[str, str]]] = {
    "qwen3 style": (
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        False,
        ("Let me think.", "The answer is 4."),
    ),
    "no tags": (
        "Just an answer with a < and </thin.",
        False,
        ("", "Just an answer with a < and </thin."),
    ),
    "missing opening tag": ("Hmm, 2+2.\n</think>\n\n4", True, ("Hmm, 2+2.", "4")),
    "opening tag written anyway": ("<think>\nHmm.</think>4", True, ("Hmm.", "4")),
    "empty reasoning": ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),
    "unterminated reasoning": ("<think>\nstill going <", False, ("still going <", "")),
    "tags inside reasoning text": (
        "<think>a <b> </thinking> c</think>d",
        False,
        ("a <b> </thinking> c", "d"),
    ),
    "unicode": ("<think>思考 🎉</think>答案", False, ("思考 🎉", "答案")),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cases_split_as_expected(case: str) -> None:
    """Each case splits into the expected reasoning and content."""
    text, starts_in_reasoning, expected = CASES[case]
    assert parse("think", text, starts_in_reasoning) == expected


@given(case=st.sampled_from(sorted(CASES)), cuts=cuts_strategy)
def test_events_do_not_depend_on_split_points(case: str, cuts: list[int]) -> None:
    """However the output is split into deltas, the split is the same."""
    text, starts_in_reasoning, expected = CASES[case]
    assert summarize(run("think", split(text, cuts), starts_in_reasoning)) == expected
    assert summarize(run("think", list(text), starts_in_reasoning)) == expected


GEMMA4_CASES: dict[str, tuple[str, bool, tuple[str, str]]] = {
    "a thought channel": (
        "<|channel>thought\nThe user wants 2+2.\n<channel|>The answer is 4.",
        False,
        ("The user wants 2+2.", "The answer is 4."),
    ),
    "an empty channel": ("<|channel>thought\n<channel|>Hi", False, ("", "Hi")),
    "an empty channel without its newline": ("<|channel>thought<channel|>Hi", False, ("", "Hi")),
    "no channel": (
        "A <|chan and a channel|> <think>x</think>",
        False,
        ("", "A <|chan and a channel|> <think>x</think>"),
    ),
    "text before the channel": ("Sure.<|channel>thought\nok<channel|>Done", False, ("ok", "Sure.Done")),
    "a word that begins like the label": (
        "<|channel>thoughtful words<channel|>x",
        False,
        ("thoughtful words", "x"),
    ),
    "another channel name stays": ("<|channel>plan\nsteps<channel|>x", False, ("plan\nsteps", "x")),
    "left open by the prompt": ("Hmm.\n<channel|>4", True, ("Hmm.", "4")),
    "opened again after the prompt opened it": ("<|channel>thought\nHmm.<channel|>4", True, ("Hmm.", "4")),
    "unterminated": ("<|channel>thought\nstill <chan", False, ("still <chan", "")),
    "cut inside the label": ("<|channel>thou", False, ("", "")),
}


@pytest.mark.parametrize("case", GEMMA4_CASES, ids=list(GEMMA4_CASES))
def test_gemma4_channels_split_as_expected(case: str) -> None:
    """Gemma 4's `<|channel>thought\n…<channel|>`: the label and the markers are not reasoning."""
    text, starts_in_reasoning, expected = GEMMA4_CASES[case]
    assert parse("gemma4", text, starts_in_reasoning) == expected


@given(case=st.sampled_from(sorted(GEMMA4_CASES)), cuts=cuts_strategy)
def test_gemma4_events_do_not_depend_on_split_points(case: str, cuts: list[int]) -> None:
    """However a Gemma 4 output is split into deltas (token by token among them), it splits so."""
    text, starts_in_reasoning, expected = GEMMA4_CASES[case]
    assert summarize(run("gemma4", split(text, cuts), starts_in_reasoning)) == expected
    assert summarize(run("gemma4", list(text), starts_in_reasoning)) == expected


FRAGMENTS = ["<think>", "</think>", "<th", "</", "<", ">", "\n", "\n\n", " ", "think", "é🎉", "ok"]
FRAGMENTS += ["<|channel>", "<channel|>", "thought", "thought\n", "<|chan", "nel|>", "thou"]
outputs = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=12).map("".join)


@settings(max_examples=300)
@given(
    name=st.sampled_from([*REASONING_PARSERS, None]),
    starts_in_reasoning=st.booleans(),
    text=outputs,
    cuts=cuts_strategy,
)
def test_arbitrary_output_does_not_depend_on_split_points(
    name: str | None, starts_in_reasoning: bool, text: str, cuts: list[int]
) -> None:
    """Any output, however split, gives the same reasoning and content."""
    whole = parse(name, text, starts_in_reasoning)
    assert summarize(run(name, split(text, cuts), starts_in_reasoning)) == whole
    assert summarize(run(name, list(text), starts_in_reasoning)) == whole


@given(text=st.text().filter(lambda t: "<think>" not in t))
def test_output_without_an_opening_tag_is_all_content(text: str) -> None:
    """Output without `<think>` is all content."""
    assert parse("think", text) == ("", text)


@given(text=st.text())
def test_no_parser_passes_everything_through_as_content(text: str) -> None:
    """Without a parser everything is content."""
    assert parse(None, text) == ("", text)


def test_deepseek_r1_starts_in_reasoning_by_default() -> None:
    """deepseek_r1 starts in reasoning (its template wrote `<think>`)."""
    assert parse("deepseek_r1", "Okay, so.\n</think>\n\nAnswer") == ("Okay, so.", "Answer")
    assert parse("deepseek_r1", "Answer only", starts_in_reasoning=False) == ("", "Answer only")


def test_only_one_newline_block_after_close_tag_is_stripped_not_inner_text() -> None:
    """Only the newlines right after `</think>` are stripped, not those inside the answer."""
    assert parse("think", "<think>r</think>\n\nline one\n\nline two\n") == (
        "r",
        "line one\n\nline two\n",
    )


def test_partial_tags_are_held_back_and_text_streams_otherwise() -> None:
    """A partial tag is held back; other text streams at once."""
    parser = make_reasoning_parser("think")
    assert parser.feed("Hi <th") == [ContentDelta("Hi ")]
    assert parser.feed("ink>x") == [ReasoningDelta("x")]
    assert parser.feed("y </thi") == [ReasoningDelta("y ")]
    assert parser.feed("nk>z") == [ContentDelta("z")]
    assert parser.feed("<think>w") == [ContentDelta("<think>w")]
    assert parser.finish() == []


def test_unknown_parser_name_lists_the_known_ones() -> None:
    """An unknown parser name is refused with the list of known ones."""
    with pytest.raises(ValueError, match=r"think.*deepseek_r1"):
        make_reasoning_parser("nope")


@pytest.mark.parametrize(
    ("prompt_end", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", "think"),  # Qwen3.5, thinking on
        ("<｜Assistant｜><think>", "think"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # thinking off: closed
        ("<|im_start|>assistant\n", None),  # Qwen3: the model opens it itself
        ("user\nWhat is <think> for?<|im_end|>\n<|im_start|>assistant\n", None),  # a tag in a question
        ("<|turn>model\n<|channel>thought\n", "gemma4"),  # Gemma 4's channel, left open
        ("<|turn>model\n<|channel>thought\n<channel|>", None),  # Gemma 4, thinking off: closed
        ("<|turn>model\n", None),  # Gemma 4, thinking on: the model opens its channel
    ],
)
def test_a_prompt_leaves_reasoning_open_when_it_ends_with_an_opening(
    prompt_end: str, opened: str | None
) -> None:
    """Only a prompt that ends with an opening (`<think>`, `<|channel>thought`, and whitespace)
    starts the output in reasoning, in that opening's format."""
    assert reasoning_left_open(prompt_end) == opened


def test_output_after_an_open_think_is_reasoning_until_it_closes() -> None:
    """Started in reasoning (the prompt opened it), the text up to `</think>` is reasoning."""
    events = run("think", list("Ponder.\n</think>\n\nDone."), starts_in_reasoning=True)
    assert summarize(events) == ("Ponder.", "Done.")
