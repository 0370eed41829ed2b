"""Every message the actors exchange, and every event a request stream yields.

Commands are verbs (`Tokenize`, `Enqueue`, `Abort`), events are nouns (`StepDone`, `TokenOut`).
All are frozen, slotted dataclasses of plain data. The step messages the scheduler core makes and
reads (`Batch`, `StepDone`, `TokenOut`, `SeqFailed`) live beside its batch types in
`ft.core.batch`, so the core imports nothing from here; they are re-exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ft.core.batch import Batch, EmbeddingOut, SeqFailed, StepDone, TokenOut, TokenScore
from ft.errors import FtError
from ft.params import SamplingParams
from ft.prompt import PromptSpec

if TYPE_CHECKING:
    from ft.grammar.compiled import Grammar

__all__ = [
    "Abort",
    "Batch",
    "Delta",
    "DetokenizerIn",
    "Embedded",
    "EmbeddingOut",
    "Enqueue",
    "Failed",
    "FinishSeq",
    "PromptReady",
    "RequestEvent",
    "SchedulerIn",
    "SeqFailed",
    "StepDone",
    "TokenLogprob",
    "TokenOut",
    "TokenScore",
    "Tokenize",
    "TopLogprob",
]

# --- request -> tokenizer ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tokenize:
    """Render (if chat) and tokenize request `uid`'s prompt, then enqueue it."""

    uid: int
    params: SamplingParams
    prompt: PromptSpec
    grammar: Grammar | None = None  # structured output: what the choices must follow


# --- tokenizer / request exit / detokenizer -> scheduler ------------------------------------


@dataclass(frozen=True, slots=True)
class Enqueue:
    """Add a tokenized request (`n` sequences) to the waiting queue."""

    uid: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    grammar: Grammar | None = None
    cache_partition: bytes | None = None  # its prefix-cache partition (`PromptSpec.cache_partition`)


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop every sequence of request `uid` and free its pages and slots. Idempotent."""

    uid: int


@dataclass(frozen=True, slots=True)
class FinishSeq:
    """Stop one sequence early (a stop string matched in its text)."""

    seq_id: int


SchedulerIn = Enqueue | Abort | FinishSeq | StepDone


# --- scheduler -> detokenizer --------------------------------------------------------------


DetokenizerIn = tuple[TokenOut | EmbeddingOut | SeqFailed, ...]


# --- events on a request stream ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative token at a position."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's logprob at a position, with the top alternatives."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """New output for choice `index`: text (possibly empty) and the tokens behind it.

    The last delta of a choice carries `finish_reason` ("stop" | "length" | "abort") and, for a
    stop string or stop token, `stop_reason`.
    """

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied to this choice
    # A choice's first delta, when `prompt_logprobs` was asked: prompt tokens 1.. scored (ids:
    # the route turns them into text, off the loop for a body).
    prompt_logprobs: tuple[TokenScore, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptReady:
    """The prompt was tokenized; sent first on a request's channel."""

    prompt_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Embedded:
    """A pooling request's result: the pooled hidden state of its prompt (not normalized)."""

    vector: tuple[float, ...]
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed; the stream raises `error`."""

    error: FtError


RequestEvent = PromptReady | Delta | Embedded | Failed
