"""Forced calls on a vocabulary that holds its format's markers as tokens of their own (Qwen's
`<tool_call>`, Phi-4-mini's and Granite's `<|tool_call|>`, Gemma 4's): llguidance takes such a
token for a special one, so the grammar writes the marker as that token, and a call so written
is allowed from the first step (a text literal of it was refused there)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from ft.core.toolcalls import parse_tool_calls
from ft.grammar import spec
from ft.grammar.compiled import compile_matcher, grammar_text, grammar_tokenizer, token_lengths, walk
from ft.tokenizer.spec import byte_level_bpe_from_gguf, tokenizer_json_of
from tests.support.gguf_files import tiny_tokens

A = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": A}}]
Q = '<|"|>'
JSON = '{"name": "f", "arguments": {"a": 3}}'
XML = "\n<function=f>\n<parameter=a>\n3\n</parameter>\n</function>\n"
# Per format: the markers its vocabularies hold as tokens, and a call written with them.
CALLS = {
    "hermes": (("<tool_call>", "</tool_call>"), f"<tool_call>\n{JSON}\n</tool_call>"),
    "phi4_mini_json": (("<|tool_call|>", "<|/tool_call|>"), f"<|tool_call|>[{JSON}]<|/tool_call|>"),
    "granite": (("<|tool_call|>",), f"<|tool_call|>[{JSON}]"),
    "qwen3_coder": (("<tool_call>", "</tool_call>"), f"<tool_call>{XML}</tool_call>"),
    "gemma4": (("<|tool_call>", "<tool_call|>", Q), "<|tool_call>call:f{a:3}<tool_call|>"),
}


def vocabulary(markers: tuple[str, ...]) -> tuple[Tokenizer, str]:
    """A tiny byte-level BPE with `markers` as added tokens (served as ft serves it)."""
    tokens, merges, types = tiny_tokens()
    tok = byte_level_bpe_from_gguf(tokens, merges, types, None)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    text = tokenizer_json_of(tok)
    return Tokenizer.from_str(text), text


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_a_forced_call_writes_the_markers_the_vocabulary_holds_as_their_tokens(parser: str) -> None:
    """The markers are found among the vocabulary's tokens; the grammar's first step allows
    the marker's token (and the walk the server runs passes); the call written with the
    marker tokens is allowed whole."""
    markers, text = CALLS[parser]
    tok, tokenizer_json = vocabulary(markers)
    assert spec.marker_tokens(tokenizer_json) == frozenset(markers)
    size = tok.get_vocab_size()
    llg = grammar_tokenizer(tokenizer_json, size, (0,))
    grammar = spec.tool_calls(TOOLS, name="f", parallel=False, parser=parser, markers=frozenset(markers))
    matcher = compile_matcher(grammar_text(grammar), llg, size)
    walk(matcher.deep_copy(), size, (0,), token_lengths(llg, size))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id(markers[0])  # the marker is one token
    assert matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_without_the_markers_as_tokens_the_grammar_writes_their_text(parser: str) -> None:
    """A vocabulary that spells the markers (the byte tokenizer's) gets them as text."""
    markers, _ = CALLS[parser]
    source = spec.tool_calls(TOOLS, name="f", parallel=False, parser=parser).source
    assert json.dumps(markers[0]) in source


PROPERTIES = {"s": {"type": "string"}, "n": {"type": "integer"}, "any": {"type": "object"}}
F = {"type": "object", "properties": PROPERTIES, "required": ["s"]}
GEMMA4_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": F}}]
texts = st.text(st.characters(codec="utf-8"), max_size=30).filter(
    lambda s: not any(m in s for m in spec.TOOL_CALL_MARKERS)
)


@settings(max_examples=100, deadline=None)
@given(s=texts, n=st.integers(-1000, 1000), key=st.from_regex(r"[a-z_]{1,5}", fullmatch=True), value=texts)
def test_gemma4_calls_with_marker_tokens_allow_any_string_and_read_back(
    s: str, n: int, key: str, value: str
) -> None:
    """With Gemma 4's markers as tokens, a call whose strings hold any text (but the markers)
    is allowed token by token as the tokenizer encodes it, and reads back as written."""
    markers = ("<|tool_call>", "<tool_call|>", Q)
    tok, tokenizer_json = vocabulary(markers)
    size = tok.get_vocab_size()
    grammar = spec.tool_calls(
        GEMMA4_TOOLS, name="f", parallel=False, parser="gemma4", markers=frozenset(markers)
    )
    matcher = compile_matcher(grammar_text(grammar), grammar_tokenizer(tokenizer_json, size, (0,)), size)
    text = f"<|tool_call>call:f{{any:{{{key}:{Q}{value}{Q}}},n:{n},s:{Q}{s}{Q}}}<tool_call|>"
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and matcher.is_accepting()
    assert parse_tool_calls(text, "gemma4", GEMMA4_TOOLS)[1] == [
        ("f", json.dumps({"any": {key: value}, "n": n, "s": s}, ensure_ascii=False))
    ]
