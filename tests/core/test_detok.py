"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.detok import IncrementalDecoder, SeqDetokenizer, StopMatcher
from ft.engine.fake import byte_token, byte_tokenizer_spec

TOKENIZER = byte_tokenizer_spec().build()


def decode(ids: list[int]) -> str:
    return str(TOKENIZER.decode(list(ids), skip_special_tokens=True))


def ids_of(text: str) -> list[int]:
    return [byte_token(b) for b in text.encode("utf-8")]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_deltas_concatenate_to_the_full_decode(text: str) -> None:
    """Incremental deltas add up to the decode of all the ids."""
    dec = IncrementalDecoder(decode)
    ids = ids_of(text)
    deltas = [dec.add(t) for t in ids] + [dec.flush()]
    assert "".join(deltas) == decode(ids) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_is_held_until_complete() -> None:
    """A character split across tokens is sent once complete."""
    dec = IncrementalDecoder(decode)
    ids = ids_of("é")  # two bytes
    assert dec.add(ids[0]) == ""
    assert dec.add(ids[1]) == "é"


def test_truncated_character_is_flushed_at_the_end() -> None:
    """A character cut off by the end of output is flushed as U+FFFD."""
    dec = IncrementalDecoder(decode)
    dec.add(ids_of("é")[0])
    assert dec.flush() == "\ufffd"


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abc", max_size=30),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    st.data(),
)
def test_stop_matcher_equals_a_whole_text_search(text: str, stops: list[str], data: st.DataObject) -> None:
    """Matching stop strings over streamed pieces finds what a search of the whole text finds."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    matcher = StopMatcher(stops)
    out, hit = "", None
    for piece in pieces:
        emitted, hit = matcher.feed(piece)
        out += emitted
        if hit is not None:
            break
    if hit is None:
        out += matcher.flush()
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        # The earliest end of a match wins in streaming; the text before it is emitted.
        assert hit is not None
        assert out == text[: text.find(hit)]
        assert hit in text
    else:
        assert hit is None and out == text


def test_stop_string_spanning_tokens_is_never_emitted() -> None:
    """A stop string spread over several tokens never reaches the output."""
    detok = SeqDetokenizer(decode, ["STOP"])
    out = ""
    for i, t in enumerate(ids_of("abSTOPcd")):
        text, stop = detok.add(t, is_last=False, is_hidden=False)
        out += text
        if stop:
            assert stop == "STOP" and i == 5
            break
    assert out == "ab"


def test_partial_stop_match_is_released_when_the_output_ends() -> None:
    """Text held as a possible stop string is released when the output ends."""
    detok = SeqDetokenizer(decode, ["STOP"])
    ids = ids_of("abST")
    out = "".join(detok.add(t, is_last=False, is_hidden=False)[0] for t in ids[:-1])
    text, stop = detok.add(ids[-1], is_last=True, is_hidden=False)
    assert stop is None and out + text == "abST"


def test_hidden_last_token_adds_no_text() -> None:
    """A hidden last token (eos) adds no text."""
    detok = SeqDetokenizer(decode, [])
    assert detok.add(ids_of("a")[0], is_last=False, is_hidden=False)[0] == "a"
    assert detok.add(0, is_last=True, is_hidden=True) == ("", None)


class CountingDecode:
    """The byte tokenizer's decode, counting the tokens it is given (the work it does)."""

    def __init__(self) -> None:
        self.tokens_decoded = 0

    def __call__(self, ids: list[int]) -> str:
        self.tokens_decoded += len(ids)
        return decode(ids)


REPLACEMENT_BYTES = "\ufffd".encode()
OUTPUTS = {
    "U+FFFD characters": REPLACEMENT_BYTES * 2000,
    "bytes that never complete": b"\x80" * 6000,
    "U+FFFD then a character split over bytes": (REPLACEMENT_BYTES + "😀".encode()) * 800,
    "plain text": b"hello world " * 500,
}


@pytest.mark.parametrize("name", OUTPUTS)
def test_detokenizing_is_linear_in_the_output(name: str) -> None:
    """Each token costs the decoder a bounded number of decoded tokens, whatever the text
    (issue 18: a tail ending in U+FFFD was re-decoded whole: quadratic)."""
    ids = [byte_token(b) for b in OUTPUTS[name]]
    counting = CountingDecode()
    dec = IncrementalDecoder(counting, context_ids=ids_of("ctx"))
    text = "".join(dec.add(t) for t in ids) + dec.flush()
    assert text == decode(ids)
    # A few decodes per token, each of a few tokens (~11 tokens decoded per token here); before
    # the fix, a tail ending in U+FFFD was decoded whole on every token: ~n / 2 per token.
    assert counting.tokens_decoded <= 32 * len(ids)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(min_size=1, max_size=4),
            st.text(min_size=1, max_size=3).map(lambda t: t.encode("utf-8")),
            st.just(REPLACEMENT_BYTES),
        ),
        max_size=30,
    )
)
def test_deltas_concatenate_to_the_full_decode_of_any_bytes(pieces: list[bytes]) -> None:
    """Any bytes, invalid UTF-8 and U+FFFD included, stream to the text of the whole decode."""
    ids = [byte_token(b) for b in b"".join(pieces)]
    dec = IncrementalDecoder(decode)
    assert "".join(dec.add(t) for t in ids) + dec.flush() == decode(ids)
