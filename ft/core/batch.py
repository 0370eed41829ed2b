"""What the scheduler hands the runner for one step, and what one step gives back.

These are plain data: the runner (torch model, or a fake in tests) never sees scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ft.params import SamplingParams


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's share of a step: feed `token_ids` at positions `start_pos...`.

    `page_ids` cover every position up to `start_pos + len(token_ids)`; position p lives in page
    `page_ids[p // page_size]` at slot `p % page_size`. When `sample` is true the runner samples
    one token after the last fed one (`num_generated` tokens have been generated before it).
    `history` holds prompt + output ids only when the params use penalties.
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


@dataclass(frozen=True, slots=True)
class Sampled:
    """The token sampled for one sequence, with its logprob and the top alternatives."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Runner(Protocol):
    """Runs model steps over a paged KV cache. `step` is synchronous and runs in a thread."""

    @property
    def page_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def step(self, works: list[SeqWork]) -> list[Sampled]:
        """Run one forward pass; return one `Sampled` per work with `sample=True`, in order."""
        ...
