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

# Longest and shortest suffix looked up. Measured on `ft bench`'s edit prompts (default model,
# greedy, 397 tokens, 4 drafted at most): down to 1-grams, 364 drafted and 181 accepted (50%);
# down to 2-grams, 296 drafted and 166 accepted (56%): the 1-grams' extra drafts were 78%
# refused, rows verified for little.
MAX_NGRAM = 3
MIN_NGRAM = 2


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
        """Up to `max_tokens` tokens that followed the longest earlier match of the suffix."""
        tokens = self.tokens
        if max_tokens < 1:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) < n:
                continue
            start = self.follows.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + max_tokens]
        return []


MAX_PAUSE_STEPS = 64  # the longest a sequence whose drafts keep failing waits to draft again


@dataclass(eq=False, slots=True)
class DraftLength:
    """A sequence's draft length: doubled (to `max_tokens`) when every draft was accepted, else
    one past what was accepted, so a sequence whose drafts fail costs one extra row a step.

    After two verifications in a row that kept nothing, the sequence stops drafting for 2 steps,
    then 4, 8, ... up to `MAX_PAUSE_STEPS` while they keep failing: text that repeats its
    n-grams without repeating what followed them stops paying for verify rows.
    """

    max_tokens: int
    current: int = 0
    num_misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without drafting

    def __post_init__(self) -> None:
        self.current = self.current or self.max_tokens

    def take_turn(self) -> bool:
        """Whether to draft this step (a paused sequence counts the step down)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Fold in one verification's result."""
        if num_drafted == 0:
            return
        if num_accepted >= num_drafted:
            self.current = min(self.max_tokens, 2 * self.current)
        else:
            self.current = max(1, num_accepted + 1)
        self.num_misses = self.num_misses + 1 if num_accepted == 0 else 0
        if self.num_misses >= 2:
            self.pause = min(MAX_PAUSE_STEPS, 1 << (self.num_misses - 1))
