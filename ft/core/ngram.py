"""N-gram (prompt lookup) drafting for speculative decoding: no trio, no torch.

A sequence's `NgramIndex` maps every n-gram of its prompt + output (n from `min_n` to `max_n`)
to where its most recent occurrence was followed; the draft for the next step is what followed
the longest suffix of the sequence that occurred before. The index grows with the sequence
(O(max_n) per token), so drafting never scans the whole context on the event loop.

`DraftLength` is the per-sequence draft length, adapted to what the target model accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Longest and shortest suffix looked up. A single token recurs far more often than what
# followed it does, so a match of one token drafts at most `ONE_TOKEN_MATCH_DRAFTS`. Replayed
# over the c1e outputs (tools/sim_ngram_bound.py: default model, greedy, EOS banned, 8 drafts at
# most, each step costing the engine's measured time by rows, no pauses): 2-grams and up 1.76x;
# 1-grams and up drafting their whole length 1.79x, drafting one token 1.81x. In the engine
# (with the pauses gone too), same process, alternating: 1.58x -> 1.71x (mean of six pairs).
MAX_NGRAM = 3
MIN_NGRAM = 1
ONE_TOKEN_MATCH_DRAFTS = 1


@dataclass(eq=False, slots=True)
class NgramIndex:
    """Where each n-gram of a token list last occurred (the index of the token after it)."""

    max_n: int = MAX_NGRAM
    min_n: int = MIN_NGRAM
    tokens: list[int] = field(default_factory=list)
    # n-gram -> index of the token that followed its latest occurrence. The n-grams ending at the
    # last token are not in it yet (nothing follows them); they enter with the next token.
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, new: Sequence[int]) -> None:
        """Append `new` tokens, indexing the n-grams each one completes as followed."""
        tokens = self.tokens
        for token in new:
            end = len(tokens)  # `token` goes here: it follows the n-grams ending at end - 1
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self.follows[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the longest earlier match of the suffix
        (`ONE_TOKEN_MATCH_DRAFTS` when that match is a single token)."""
        tokens = self.tokens
        if max_tokens < 1:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) < n:
                continue
            start = self.follows.get(tuple(tokens[-n:]))
            if start is not None:
                length = max_tokens if n > 1 else min(max_tokens, ONE_TOKEN_MATCH_DRAFTS)
                return tokens[start : start + length]
        return []


@dataclass(eq=False, slots=True)
class DraftLength:
    """A sequence's draft length: doubled (to `max_tokens`) when every draft was accepted, else
    one past what was accepted, so a sequence whose drafts fail costs one extra row a step.

    Whether even that row pays is the scheduler's cost model's call (`StepCosts`), from the
    sequence's acceptance so far: a sequence whose drafts keep failing stops drafting there.
    (Pauses after failed drafts, 2, 4, ... 64 steps, measured worse once a verify row was
    cheap: 1.62x against 1.81x in the replay above, as they also stopped the drafts that would
    have been kept.)
    """

    max_tokens: int
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.current or self.max_tokens

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Fold in one verification's result."""
        if num_drafted == 0:
            return
        if num_accepted >= num_drafted:
            self.current = min(self.max_tokens, 2 * self.current)
        else:
            self.current = max(1, num_accepted + 1)
