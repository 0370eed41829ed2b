"""What the scheduler hands the runner for one step, and what one step gives back.

These are plain data: the runner (torch model, or a fake in tests) never sees scheduler state.
The step messages (`Batch`, `StepDone`, `TokenOut`, `SeqFailed`) are here too, beside the types
they carry, so the core depends on no actor message module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ft.errors import FtError
from ft.params import SamplingParams

if TYPE_CHECKING:
    from ft.grammar.compiled import Matcher


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's share of a step: feed `token_ids` at positions `start_pos...`.

    `page_ids` cover every position up to `start_pos + len(token_ids)`; position p lives in page
    `page_ids[p // page_size]` at slot `p % page_size`. When `sample` is true the runner samples
    one token after the last fed one (`num_generated` tokens have been generated before it).
    `history` holds prompt + output ids only when the params use penalties. `matcher` (sampling
    works of a constrained request only) is the sequence's grammar state: the runner masks the
    logits with it and advances it by the sampled token.

    `num_draft` (speculative decoding): the last `num_draft` fed tokens are drafts to verify;
    the runner returns one `Sampled` per accepted draft plus the one after them, in order.

    Draft-model speculation: the runner's draft model is first fed `draft_feed` at positions
    `draft_pos...` (the tokens whose KV its cache lacks, written into the same `page_ids`); when
    `num_model_draft` is positive the feed ends at this work's last fed token, the draft model
    then drafts `num_model_draft` tokens after it, and the runner verifies them as drafts in this
    step (as if fed after `token_ids` with `num_draft` set). Pages cover them.

    `score_ids` (prompt logprobs): the fed tokens from index `score_offset` on are scored, the
    logits at fed token `score_offset + i` giving the logprob of `score_ids[i]` (the prompt
    token after it), with `params.prompt_logprobs` alternatives; the runner returns one `Scored`.

    `num_pool_rows` (pooling requests): the hidden states (after the final norm) of the fed
    tokens `pool_offset .. pool_offset + num_pool_rows - 1` are summed; the runner returns one
    `PoolSum`. A pooling work never samples.

    `state_slot` (a model with recurrent layers: DeltaNet, short convolutions, Mamba): the slot
    of the runner's recurrent state that holds this sequence's state after its first
    `start_pos` tokens (a work at `start_pos` 0 starts from the zero state, whatever the slot
    held); after a step that succeeded as a whole it holds the state after the last fed token.
    A step that raises leaves every slot as it was, so rerunning its works alone is exact.
    -1: the model has no recurrent layers.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    page_ids: tuple[int, ...]
    sample: bool
    params: SamplingParams
    num_generated: int
    history: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    matcher: Matcher | None = None
    score_offset: int = 0
    score_ids: tuple[int, ...] = ()
    pool_offset: int = 0
    num_pool_rows: int = 0
    num_draft: int = 0
    draft_feed: tuple[int, ...] = ()
    draft_pos: int = 0
    num_model_draft: int = 0
    state_slot: int = -1


class ConstraintError(Exception):
    """A sequence's output constraint (its grammar) failed: its request's fault, not the engine's."""


class RowsFailed(ConstraintError):
    """A step ran, but some rows' grammars failed (over their budget, in error): `failed` holds
    (seq id, why) for those, `sampled` the other rows' tokens, so nothing is rerun."""

    def __init__(self, sampled: Sequence[StepOutput], failed: list[tuple[int, str]]) -> None:
        super().__init__("; ".join(why for _, why in failed))
        self.sampled: list[StepOutput] = list(sampled)
        self.failed = failed


class RunnerFailure(Exception):
    """The runner cannot run any further step (a tensor-parallel rank died or hangs).

    Unlike any other exception from `Runner.step`, it is not one sequence's fault: the runner
    actor fails every request and the engine turns to its error state.
    """


@dataclass(frozen=True, slots=True)
class Sampled:
    """The token sampled for one sequence, with its logprob and the top alternatives."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenScore:
    """A prompt token's logprob under the model given the tokens before it, with the top
    alternatives at its position."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Scored:
    """The scores of one work's `score_ids`, in order."""

    seq_id: int
    scores: tuple[TokenScore, ...]


@dataclass(frozen=True, slots=True)
class PoolSum:
    """The sum (float64) of one work's pooled rows of hidden states, `[hidden]`."""

    seq_id: int
    values: tuple[float, ...]


StepOutput = Sampled | Scored | PoolSum  # what a runner's step returns, per work


class Heartbeat:
    """A count a forward pass bumps as it goes (once a layer, once a block of scored rows), so
    the engine's watchdog tells a slow step (the count moves) from a hung one (it stops).

    A runner that has one exposes it as `heartbeat`. One writer (the step's thread) and readers
    that only compare it: a plain int, no lock, nothing read back from a device.
    """

    __slots__ = ("beats",)

    def __init__(self) -> None:
        self.beats = 0

    def beat(self) -> None:
        """One more piece of the step done."""
        self.beats += 1


class Runner(Protocol):
    """Runs model steps over a paged KV cache. `step` is synchronous and runs in a thread."""

    @property
    def page_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def step(self, works: list[SeqWork]) -> list[StepOutput]:
        """Run one forward pass; return one `Sampled` per work with `sample=True`, in order
        (a work with drafts: one per accepted draft and one after them, consecutive), one
        `Scored` per work with `score_ids` and one `PoolSum` per work with `num_pool_rows`
        (those two anywhere in the list).

        Raises `RunnerFailure` when no further step can run; anything else fails the step.
        """
        ...


@runtime_checkable
class StateRunner(Protocol):
    """A runner of a model with recurrent layers: `num_state_slots` slots of per-sequence state
    (`SeqWork.state_slot`), and the copies between them that a `Batch` asks for."""

    @property
    def num_state_slots(self) -> int: ...

    def copy_states(self, copies: Sequence[StateCopy]) -> None:
        """Run `copies` in order (synchronous, in the step's thread, before the step's works)."""
        ...


@dataclass(frozen=True, slots=True)
class PageSave:
    """The prompt cache's disk tier: copy page `page_id` (full, its chain hash `key`) out before
    the step writes any page, and queue it to be written to disk."""

    page_id: int
    key: int


@dataclass(frozen=True, slots=True)
class PageLoad:
    """The prompt cache's disk tier: read pages `keys` from disk into `page_ids` (fresh pages of
    sequence `seq_id`, which the step does not compute), in order, stopping at the first that is
    missing or does not check out; `StepDone.loaded` says how many were."""

    seq_id: int
    page_ids: tuple[int, ...]
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Copy recurrent state slot `src` into slot `dst` (a snapshot taken of a sequence's state,
    or a sequence's state restored from one)."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's work for the runner: first the disk tier's `saves`, then its `loads`, then the
    recurrent `state_copies` in order, then the `works` (which may be empty when only pages or
    states move)."""

    step: int
    works: tuple[SeqWork, ...]
    saves: tuple[PageSave, ...] = ()
    loads: tuple[PageLoad, ...] = ()
    state_copies: tuple[StateCopy, ...] = ()


@dataclass(frozen=True, slots=True)
class StepDone:
    """The runner finished a step; `failed` maps seq ids to the error that failed them."""

    step: int
    sampled: tuple[Sampled, ...]
    failed: tuple[tuple[int, FtError], ...] = ()
    scored: tuple[Scored, ...] = ()
    pooled: tuple[PoolSum, ...] = ()
    duration_s: float = 0.0
    draft_s: float = 0.0  # of `duration_s`, the time a draft model took drafting
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    loaded: tuple[tuple[int, int], ...] = ()  # (seq id, pages read from disk) per `PageLoad`


@dataclass(frozen=True, slots=True)
class TokenOut:
    """A token generated for one sequence; `finish_reason` set on its last one.

    `is_hidden` marks a final token whose text is not part of the output (eos, stop token id).
    """

    uid: int
    index: int
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None
    stop_reason: int | None = None
    is_hidden: bool = False
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    # On a sequence's first token, when its request asked: the scores of prompt tokens 1.. (the
    # first prompt token has no context to be scored in).
    prompt_logprobs: tuple[TokenScore, ...] = ()


@dataclass(frozen=True, slots=True)
class EmbeddingOut:
    """A pooling request's result: its prompt's pooled hidden state (not normalized)."""

    uid: int
    seq_id: int
    vector: tuple[float, ...]
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied


@dataclass(frozen=True, slots=True)
class SeqFailed:
    """A sequence ended with an error (runner fault, admission refusal)."""

    uid: int
    error: FtError
