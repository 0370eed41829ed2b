"""Grammars compiled by llguidance: checked in a worker process, then built once in-process.

A hostile grammar can make a compiler explode: llguidance bounds its own work with fuel limits
(`limits`), but converting a schema nested thousands deep overflows its stack and kills the
process. So a new grammar is first compiled, its first mask computed and a few tokens walked
(`walk`) in a worker process the engine can kill at a deadline (`ft.tokenizer.job`'s
`check_grammar_job`); only a grammar that passed is built in the server, where each sequence
takes a cheap copy of it (`Grammar.matcher`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import llguidance
import numpy as np

from ft.grammar.spec import JSON_OPTIONS, GrammarSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

Matcher = llguidance.LLMatcher

# Fuel for building the lexer and for one mask. llguidance's defaults (1M / 200k) let a regex
# like `(x{500}){500}` cost 130-250 ms on every token here; these refuse it in ~100 ms, while
# real schemas (nested objects, patterns, formats, 2000-way anyOf) compile in milliseconds.
INITIAL_LEXER_FUEL = 200_000
STEP_LEXER_FUEL = 20_000
WALK_STEPS = 16


def limits() -> llguidance.LLParserLimits:
    """The parser limits every grammar runs under (a fresh object: llguidance takes ownership)."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL, verbose_errors=False
    )


def grammar_text(spec: GrammarSpec) -> str:
    """`spec` in llguidance's own grammar format.

    Raises:
        ValueError: the source cannot be read as its kind says (not valid JSON, not a grammar).
    """
    match spec.kind:
        case "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec.source, defaults=cast("JsonCompileOptions", JSON_OPTIONS)
            )
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        case "grammar":
            return llguidance.grammar_from("grammar", spec.source)
        case "choice":
            # One terminal (a lexeme), not a rule: llguidance refuses a rule of over 2000
            # alternatives, and `MAX_CHOICES` is twice that.
            options = " | ".join(json.dumps(o) for o in json.loads(spec.source))
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {options}")
        case "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.source)


@lru_cache(maxsize=2)
def grammar_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance needs it (~0.2 s to build; cached per process)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def error_of(matcher: Matcher) -> str:
    """The first line of a failed matcher's error (the rest is llguidance's debugging dump)."""
    return matcher.get_error().strip().split("\n", 1)[0]


def _mask(matcher: Matcher, vocab_size: int) -> np.ndarray:
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return mask


def compile_matcher(text: str, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> Matcher:
    """A matcher for llguidance grammar `text` with its first mask computed (the lexer built).

    Raises:
        ValueError: the grammar is invalid or exceeds the limits (the message says which).
    """
    matcher = llguidance.LLMatcher(tokenizer, text, limits=limits(), log_level=0)
    mask = _mask(matcher, vocab_size)
    if not matcher.is_error() and not mask.any():
        raise ValueError("the grammar allows no output at all")
    if matcher.is_error():
        raise ValueError(error_of(matcher))
    return matcher


def walk(matcher: Matcher, vocab_size: int, eos_token_ids: tuple[int, ...], steps: int = WALK_STEPS) -> None:
    """Feed a copy of `matcher` up to `steps` allowed tokens (the lowest non-EOS id each time).

    Some grammars pass the first mask and exhaust the lexer's fuel a few tokens in; a walk
    finds most of them before a request runs.

    Raises:
        ValueError: the grammar fails (its limits are exceeded) along the walk.
    """
    m = matcher.deep_copy()
    for _ in range(steps):
        allowed = np.unpackbits(_mask(m, vocab_size).view(np.uint8), bitorder="little")[:vocab_size]
        if m.is_error():
            raise ValueError(error_of(m))
        allowed[list(eos_token_ids)] = 0
        tokens = np.flatnonzero(allowed)
        if m.is_stopped() or not tokens.size:
            return
        m.consume_token(int(tokens[0]))
    if m.is_error():
        raise ValueError(error_of(m))


# --- in the server ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, slots=True)
class Grammar:
    """A compiled grammar: a template matcher, copied for each sequence that follows it."""

    spec: GrammarSpec
    template: Matcher

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (a copy: ~1 µs)."""
        return self.template.deep_copy()
