"""One generated sequence: its tokens, its KV pages and how far the model has computed it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ft.core.spec_cost import RETRY_EVERY
from ft.params import SamplingParams

if TYPE_CHECKING:
    from ft.core.batch import TokenScore
    from ft.core.ngram import DraftLength, NgramIndex
    from ft.grammar.compiled import Matcher


class SeqStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    PREEMPTED = "preempted"  # waiting again, pages freed, to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """A prompt plus the tokens generated after it; one per choice (`index`) of a request."""

    seq_id: int
    uid: int
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    # Leading pages out of every layer's window (a model whose every layer is windowed), given
    # back to the pool: their `page_ids` entries are placeholders, never read for their content.
    num_dropped: int = 0
    page_hashes: list[int] = field(default_factory=list)  # content hashes of leading full pages
    # The first page's parent hash: its request's prefix-cache partition (`kv.partition_root`;
    # None: the shared one), so pages of other partitions never match its hashes.
    hash_root: int | None = None
    num_registered: int = 0  # leading pages registered in the prefix cache
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_prompt: int = 0  # prompt tokens the prefix cache supplied at its first admission
    num_lost: int = 0  # tokens computed before its last preemption (to recompute)
    num_loading: int = 0  # pages after `num_computed` being read from the disk tier this step
    num_preemptions: int = 0
    status: SeqStatus = SeqStatus.WAITING
    matcher: Matcher | None = None  # its grammar's state (structured output), advanced by the runner
    prompt_scores: list[TokenScore] = field(default_factory=list)  # prompt tokens 1.., scored so far
    # Speculative decoding (made at its first drafted step): its n-gram index and draft length.
    drafter: NgramIndex | None = None
    draft_length: DraftLength | None = None
    num_drafted: int = 0  # tokens drafted for it, and those the model accepted
    num_accepted: int = 0
    num_refusals: int = 0  # verifications that refused one of its drafts
    num_draft_computed: int = 0  # leading tokens whose KV the draft model holds (a draft model)
    catching_up: bool = False  # its draft model, once let through, is fed until it drafts
    # Steps its own drafts were judged not worth their rows beside others' that were, since it
    # last drafted, and how many such steps before it is let through once to be measured again.
    num_passed_over: int = 0
    retry_passed_over: int = RETRY_EVERY
    # A model with recurrent layers (`ft.core.state`): the state slot it holds while running
    # (-1: none), and, for a choice of `n` > 1, the choice whose state and prompt pages it takes
    # once that one has computed their shared prompt's full pages (None: it computes its own).
    state_slot: int = -1
    fork_from: int | None = None
    # A pooling request: the sum of the hidden states pooled so far, and the positions before
    # `num_pooled` it holds (mean: every one summed; cls: position 0; last: set when done).
    pool_sum: list[float] = field(default_factory=list)
    num_pooled: int = 0

    @property
    def is_pooling(self) -> bool:
        """True for a pooling request's sequence (prompt only, nothing sampled)."""
        return self.params.pooling is not None

    @property
    def num_reusable_pooled(self) -> int:
        """Leading prompt tokens whose hidden states this pooling sequence no longer needs.

        A prefix-cache hit skips computing those tokens, so only these may come from the
        cache: mean pooling needs every position it has not summed yet, cls position 0; last
        pooling only its last token, which is always computed.
        """
        match self.params.pooling:
            case "mean":
                return self.num_pooled
            case "cls":
                return self.num_tokens if self.num_pooled else 0
            case _:
                return self.num_tokens

    @property
    def wants_prompt_scores(self) -> bool:
        """True while prompt logprobs were asked for and some are not scored yet.

        Each of a request's `n` sequences scores its own copy (n > 1 with prompt logprobs is
        rare; sharing would tie the choices' streams together).
        """
        return self.params.prompt_logprobs is not None and len(self.prompt_scores) < len(self.prompt_ids) - 1

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold (max_tokens is resolved by `add`)."""
        assert self.params.max_tokens is not None
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token remains to be computed.

        A fresh sequence prefills its prompt; a preempted one, re-admitted, prefills its prompt
        plus the tokens it had already generated (recompute), then samples where it left off.
        """
        return self.num_tokens - self.num_computed > 1

    def token_at(self, pos: int) -> int:
        """The token at position `pos` of prompt + output."""
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens at positions [start, stop) of prompt + output."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:  # a decode's tokens: no copy of the prompt
            return self.output_ids[start - n : stop - n]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]
