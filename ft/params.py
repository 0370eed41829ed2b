"""Sampling parameters: what a request asks of the sampler and the finish conditions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ft.errors import InvalidRequest
from ft.grammar.spec import GrammarSpec

# Engine-representable bounds. Anything outside is a 400 at the edge and a ValueError here.
MAX_INT64 = 2**63 - 1
MAX_TOKENS_LIMIT = 1 << 20
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_LOGIT_BIAS = 1024
MIN_TEMPERATURE = 1e-5
# How a pooling request (an embedding) turns its prompt's hidden states into one vector: their
# mean, the first token's (cls) or the last token's; rank: the last token's through the model's
# classification head (a reranker: the vector is the head's outputs, `ft.model.classifier`).
POOLINGS = ("mean", "cls", "last", "rank")


def mix_seed(seed: int, k: int) -> int:
    """A signed 64-bit seed derived from `seed` and a counter `k` (a choice index, a step).

    Distinct `k` give distinct streams; the one mixing rule for every derived seed.
    """
    return (seed * 1_000_003 + k + 2**63) % 2**64 - 2**63


def _finite(name: str, value: float, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number", param=name)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be between {lo} and {hi}, got {value!r}", param=name)


def _integer(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be between {lo} and {hi}, got {value}", param=name)


def first_outside_vocab(ids: Sequence[int], vocab_size: int) -> int | None:
    """The first of `ids` outside `0..vocab_size - 1`, or None: the token-id rule, written once.

    `min`/`max` first: C loops, so the ~2M ids a body can hold are checked on the event loop.
    """
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        return next(t for t in ids if not 0 <= t < vocab_size)
    return None


def check_token_ids(ids: Sequence[int], vocab_size: int, *, param: str) -> None:
    """Raise `InvalidRequest` (a 400 naming `param`) for an id outside the vocabulary."""
    t = first_outside_vocab(ids, vocab_size)
    if t is not None:
        raise InvalidRequest(f"token id {t} is outside the vocabulary (0..{vocab_size - 1})", param=param)


def has_lone_surrogate(text: str) -> bool:
    """True when `text` cannot be encoded as UTF-8 (it holds a lone UTF-16 surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    Every field is validated in `__post_init__`; a bad value raises `InvalidRequest` naming the
    field, so the embedded API refuses what the HTTP edge refuses.
    """

    # None: up to the end of the context. 0: the prompt only (scored with `prompt_logprobs`),
    # nothing generated: each choice's one delta has no token and finishes with "length".
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt tokens' logprobs (and this many alternatives each); None: not computed.
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # structured output: what the text must follow
    # Speculative decoding may draft this request's tokens (when the engine enables it); the
    # output is the same either way, so this only turns the extra verify rows off.
    speculative: bool = True
    # A pooling request (one of `POOLINGS`): prompt only, nothing sampled; its stream gives the
    # pooled hidden state (after the final norm) instead of tokens.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 0, MAX_TOKENS_LIMIT)
        _finite("temperature", self.temperature, 0.0, 100.0)
        _finite("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequest("top_p must be greater than 0", param="top_p")
        _integer("top_k", self.top_k, -1, 1 << 30)
        _finite("min_p", self.min_p, 0.0, 1.0)
        _finite("repetition_penalty", self.repetition_penalty, 0.01, 100.0)
        _finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _finite("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases",
                param="logit_bias",
            )
        for token_id, bias in self.logit_bias.items():
            _integer("logit_bias", token_id, 0, MAX_INT64)
            _finite("logit_bias", bias, -100.0, 100.0)
        if self.seed is not None:
            _integer("seed", self.seed, -(2**63), MAX_INT64)
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN:
                raise InvalidRequest(f"each stop string must be 1 to {MAX_STOP_LEN} characters", param="stop")
            if has_lone_surrogate(s):
                raise InvalidRequest("stop contains a lone UTF-16 surrogate", param="stop")
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > 64:
            raise InvalidRequest("stop_token_ids takes at most 64 ids", param="stop_token_ids")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, 0, MAX_INT64)
        _integer("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        _integer("n", self.n, 1, MAX_N)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidRequest("grammar must be a GrammarSpec", param="grammar")
        if not isinstance(self.speculative, bool):
            raise InvalidRequest("speculative must be true or false", param="speculative")
        if self.pooling is not None:
            self._check_pooling()

    def _check_pooling(self) -> None:
        if self.pooling not in POOLINGS:
            raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)}", param="pooling")
        sampled = self.n != 1 or self.logprobs or self.prompt_logprobs is not None or self.grammar is not None
        if sampled:
            raise InvalidRequest("a pooling request samples nothing: n, logprobs and grammars do not apply")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax.

        A temperature below `MIN_TEMPERATURE` is argmax too: dividing float32 logits by 1e-40
        gives inf and NaN, and the "sample" would be token 0.
        """
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def can_speculate(self) -> bool:
        """True when drafted tokens can be verified for this request: asked for, and it samples
        (no pooling). A grammar's masks follow each drafted position (`ft.model.masks`)."""
        return self.speculative and self.pooling is None

    @property
    def uses_penalties(self) -> bool:
        """True when the sampler needs the token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
