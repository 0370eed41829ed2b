"""One generated sequence: its tokens, its KV pages and how far the model has computed it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ft.params import SamplingParams


class SeqStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
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
    page_hashes: list[int] = field(default_factory=list)  # hashes of the leading full pages
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_prompt: int = 0  # prompt tokens reused from the prefix cache
    status: SeqStatus = SeqStatus.WAITING

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
        """True while prompt tokens remain to be computed."""
        return self.num_computed < len(self.prompt_ids)

    def token_at(self, pos: int) -> int:
        """The token at position `pos` of prompt + output."""
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens at positions [start, stop) of prompt + output."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        return (self.prompt_ids + self.output_ids)[start:stop]
