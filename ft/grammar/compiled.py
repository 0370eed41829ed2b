"""Grammars compiled by llguidance: checked in a worker process, then built for each request.

A hostile grammar can make a compiler explode: llguidance bounds its own work with fuel and
item limits (`limits`), but converting a schema nested thousands deep overflows its stack and
kills the process. So a new grammar is first compiled, its first mask computed and walked
(`walk`: the shortest tokens, the lowest ids and random ones, each mask's time measured) in a
worker process the engine can kill at a deadline (`ft.tokenizer.job`'s `check_grammar_job`);
only a grammar that passed is built in the server.

NOTE: llguidance's `deep_copy` shares the lexer, whose DFA grows with every state a copy
explores (a counting regex such as `[a-z]{1,20000}`: ~21 KB per token on the byte tokenizer,
~40 KB on SmolLM2's). A template kept in a cache and copied for every request grows by the
output of all of them and holds it while idle; so each request builds its own template
(`build_grammar`, 1-230 ms in a thread) and only its own sequences share it. Its lexer is
capped at `MAX_LEXER_STATES` (~0.7 KB each) and freed with the request.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol, cast

import llguidance
import numpy as np

from ft.grammar.spec import JSON_OPTIONS, GrammarSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

LLMatcher = llguidance.LLMatcher

# Fuel for building the lexer and for one mask. llguidance's defaults (1M / 200k) let a regex
# like `(x{500}){500}` cost 130-250 ms on every token here; these refuse it in ~100 ms, while
# real schemas (nested objects, patterns, formats, 2000-way anyOf of constants) compile in
# milliseconds.
INITIAL_LEXER_FUEL = 200_000
STEP_LEXER_FUEL = 20_000
# Earley items. An ambiguous grammar (`s: s s | s s s | "a" | ""`) grows every row with each
# token and a mask re-walks them: with llguidance's defaults (50k a mask, 2000 a row) one mask
# reached 2.4-3.2 s by token 200-300 here. A row of 1000 still admits a 1000-way `anyOf` of
# objects; these limits alone do not bound a mask's time (a 1000-item row took 0.5-1.6 s),
# so the walk and the runtime budgets (`ft.model.masks`) measure it too.
STEP_MAX_ITEMS = 20_000
MAX_ITEMS_IN_ROW = 1_000
# Lexer (DFA) states of one request's template: ~0.7 KB each (250k, the default, took 181 MB).
MAX_LEXER_STATES = 50_000
# The walk: this many tokens per strategy, refused when one mask (or token) costs more CPU
# than `WALK_MASK_CPU_S`, or the walk more than `WALK_MEAN_CPU_S` a token on average (after
# `WALK_MEAN_AFTER` tokens). Measured here (SmolLM2's vocabulary): real schemas' masks took
# 0.1-3.5 ms at worst over 256 tokens, 0.07-1.1 ms on average; the ambiguous grammars above
# passed 10 ms within 45-140 tokens (1-5 s of walking: the mean catches them sooner).
WALK_STEPS = 192
WALK_MASK_CPU_S = 0.010
WALK_MEAN_CPU_S = 0.0025
WALK_MEAN_AFTER = 32
WALK_SEED = 0
BUDGET_VOCAB_SIZE = 49_152  # the vocabulary the CPU budgets were measured on


def cost_scale(vocab_size: int) -> float:
    """How much more a mask costs than on the vocabulary the budgets were measured on: its
    work is a walk of the vocabulary's token trie, so a 152k vocabulary (Qwen) gets 3x."""
    return max(1.0, vocab_size / BUDGET_VOCAB_SIZE)


def limits() -> llguidance.LLParserLimits:
    """The parser limits every grammar runs under (a fresh object: llguidance takes ownership)."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS,
        max_items_in_row=MAX_ITEMS_IN_ROW,
        max_lexer_states=MAX_LEXER_STATES,
        verbose_errors=False,
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


@lru_cache(maxsize=2)
def token_lengths(tokenizer: llguidance.LLTokenizer, vocab_size: int) -> np.ndarray:
    """Each token's length in bytes (`[vocab]`; a walk prefers the shortest)."""
    return np.array([len(tokenizer.decode_bytes([i])) for i in range(vocab_size)], dtype=np.int32)


def error_of(matcher: LLMatcher) -> str:
    """The first line of a failed matcher's error (the rest is llguidance's debugging dump)."""
    return matcher.get_error().strip().split("\n", 1)[0]


def _mask(matcher: LLMatcher, vocab_size: int) -> np.ndarray:
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return mask


def compile_matcher(text: str, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> LLMatcher:
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


# Picks the next token of a walk among the allowed ones (a non-empty array of ids).
Pick = Callable[[np.ndarray], int]


def walk_picks(lengths: np.ndarray) -> dict[str, Pick]:
    """The walks a new grammar is checked with: the shortest tokens (which grow an ambiguous
    grammar's rows fastest), the lowest ids, and seeded random ones."""
    rng = random.Random(WALK_SEED)
    return {
        "shortest": lambda allowed: int(allowed[np.argmin(lengths[allowed])]),
        "lowest": lambda allowed: int(allowed[0]),
        "random": lambda allowed: int(allowed[rng.randrange(allowed.size)]),
    }


def walk(
    matcher: LLMatcher,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    lengths: np.ndarray,
    *,
    steps: int = WALK_STEPS,
    mask_cpu_s: float = WALK_MASK_CPU_S,
) -> None:
    """Feed copies of `matcher` up to `steps` allowed tokens along each of `walk_picks`,
    timing each mask and token (CPU time of this thread, so a loaded machine does not fail it).

    Some grammars pass the first mask and exhaust their limits a few tokens in; an ambiguous
    one costs more with every token. A walk finds most of both before a request runs.

    Raises:
        ValueError: the grammar fails (its limits are exceeded) along a walk, or one mask or
            token costs more than `mask_cpu_s`.
    """
    eos = list(eos_token_ids)
    mask_cpu_s *= cost_scale(vocab_size)
    mean_cpu_s = WALK_MEAN_CPU_S * cost_scale(vocab_size)
    for name, pick in walk_picks(lengths).items():
        m = matcher.deep_copy()
        walked = time.thread_time()
        for i in range(steps):
            started = time.thread_time()
            allowed = np.unpackbits(_mask(m, vocab_size).view(np.uint8), bitorder="little")[:vocab_size]
            allowed[eos] = 0
            tokens = np.flatnonzero(allowed)
            if not m.is_error() and not m.is_stopped() and tokens.size:
                m.consume_token(pick(tokens))
            if m.is_error():
                raise ValueError(error_of(m))
            now = time.thread_time()
            where = f"after {i} tokens (walking the {name} tokens)"
            if now - started > mask_cpu_s:
                raise ValueError(
                    f"the grammar is too ambiguous: one token took {(now - started) * 1000:.0f} ms "
                    f"{where}; the budget is {mask_cpu_s * 1000:.0f} ms"
                )
            if i >= WALK_MEAN_AFTER and (now - walked) / (i + 1) > mean_cpu_s:
                raise ValueError(
                    f"the grammar is too ambiguous: its tokens took {(now - walked) / (i + 1) * 1000:.1f} ms "
                    f"each {where}; the budget is {mean_cpu_s * 1000:.1f} ms"
                )
            if m.is_stopped() or not tokens.size:
                break


# --- in the server ---------------------------------------------------------------------------


class Pending(Protocol):
    """A mask computation in flight (a `Future`; only whether it is done is read here, so the
    grammar package needs nothing of the model's)."""

    def done(self) -> bool: ...


class Matcher:
    """One sequence's grammar state: llguidance's matcher, the tokens it is yet to consume (the
    last step's: its accepted drafts and the token after them), and what its tokens have cost
    (`ft.model.masks` keeps these).

    `pending` is the mask computation still running on it, if one outlived its step's
    deadline: until it ends the matcher must not be touched.
    """

    __slots__ = ("llg", "mask_cpu_s", "next_tokens", "num_masks", "pending")

    def __init__(self, llg: LLMatcher) -> None:
        self.llg = llg
        self.next_tokens: tuple[int, ...] = ()
        self.mask_cpu_s = 0.0
        self.num_masks = 0
        self.pending: Pending | None = None

    @property
    def is_busy(self) -> bool:
        """A mask computation abandoned at a deadline still runs on it."""
        return self.pending is not None and not self.pending.done()


@dataclass(frozen=True, eq=False, slots=True)
class Grammar:
    """A request's compiled grammar: its own template, copied for each of its sequences."""

    spec: GrammarSpec
    template: LLMatcher

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (a copy: ~1 µs; it shares the template's lexer)."""
        return Matcher(self.template.deep_copy())


def build_grammar(
    spec: GrammarSpec, text: str, tokenizer: llguidance.LLTokenizer, vocab_size: int
) -> Grammar:
    """A new template for llguidance grammar `text` (blocking: run it in a thread).

    Raises:
        ValueError: the grammar is invalid or exceeds the limits.
    """
    return Grammar(spec, compile_matcher(text, tokenizer, vocab_size))
