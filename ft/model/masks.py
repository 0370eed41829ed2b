"""One step's grammar masks: computed beside the forward pass, applied to the logits.

The masks of a step's constrained rows are computed by llguidance (native code, without the
GIL), then added to the logits as 0 / `-inf`, so every sampling mode (greedy, temperature,
top-k/p, min-p, penalties, logit bias, logprobs) sees only the tokens the grammar allows. The
matchers advance only once every row of the step has been sampled, so a step that fails and is
rerun row by row sees each matcher exactly where it was.

NOTE: computing the masks in a thread while the model runs pays only when the forward pass
leaves a core idle. When it uses every core, the mask thread takes one from torch's OpenMP
team and the step slows by more than the masks cost. Measured with `ft bench --structured` on
2 cores (constrained throughput / free, at 1 and 16 concurrent): always overlapped 0.89 / 0.97,
always after the forward 0.94 / 0.98, overlapped only while torch runs on fewer threads than
the machine has (what this does) 0.98 / 0.98.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

import numpy as np
import torch

from ft.core.batch import ConstraintError, Sampled, SeqWork
from ft.grammar.compiled import Matcher, error_of


class GrammarError(ConstraintError):
    """A constrained sequence's grammar failed (its limits were exceeded mid-generation)."""


_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-masks")


@cache
def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[256, 8]`: for each mask byte, the 8 logit offsets it stands for (0 allowed, -inf not)."""
    rows = [[0.0 if (b >> k) & 1 else float("-inf") for k in range(8)] for b in range(256)]
    return torch.tensor(rows, dtype=dtype, device=device)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class StepMasks:
    """The masks of the constrained rows among one step's sampling works."""

    def __init__(self, works: Sequence[SeqWork], vocab_size: int, *, overlap: bool) -> None:
        self.vocab_size = vocab_size
        self.rows = [i for i, w in enumerate(works) if w.matcher is not None]
        self.matchers: list[Matcher] = [m for w in works if (m := w.matcher) is not None]
        self.seq_ids = [works[i].seq_id for i in self.rows]
        self.bits = np.zeros((len(self.rows), (vocab_size + 31) // 32), dtype=np.int32)
        self._done: Future[None] | None = _pool.submit(self._fill) if overlap else None

    @staticmethod
    def start(works: Sequence[SeqWork], vocab_size: int) -> StepMasks | None:
        """Start computing the masks of `works`' constrained rows; None when there are none."""
        if not any(w.matcher is not None for w in works):
            return None
        return StepMasks(works, vocab_size, overlap=torch.get_num_threads() < _cores())

    def _fill(self) -> None:
        width = self.bits.shape[1] * 4
        for k, m in enumerate(self.matchers):
            m.unsafe_compute_mask_ptr(self.bits[k].ctypes.data, width)

    def wait(self) -> None:
        """Block until the masks are computed (they are then safe to reuse or drop)."""
        if self._done is None:
            self._fill()
            self._done = Future()
            self._done.set_result(None)
        self._done.result()

    def apply(self, logits: torch.Tensor) -> None:
        """Add each row's grammar to `logits` `[R, vocab]` in place: `-inf` where it forbids.

        Raises:
            GrammarError: a row's grammar is in error, or allows nothing.
        """
        self.wait()
        for k, m in enumerate(self.matchers):
            if m.is_error() or not self.bits[k].any():
                reason = error_of(m) if m.is_error() else "it allows no token"
                raise GrammarError(f"seq {self.seq_ids[k]}: structured output failed: {reason}")
        # One table lookup per mask byte (0.3 ms for 16 rows of 49k; a boolean masked_fill
        # took 1.6 ms). On a GPU this is the step's one extra host-to-device copy.
        packed = torch.from_numpy(self.bits.view(np.uint8)).to(logits.device, dtype=torch.long)
        offsets = torch.nn.functional.embedding(packed, _byte_table(logits.dtype, logits.device))
        offsets = offsets.view(len(self.rows), -1)[:, : logits.shape[1]]
        if len(self.rows) == logits.shape[0]:
            logits.add_(offsets)
        else:
            logits.index_add_(0, torch.tensor(self.rows, device=logits.device), offsets)

    def accept(self, sampled: Sequence[Sampled]) -> None:
        """Advance each row's matcher by the token sampled for it (`sampled` in row order)."""
        for row, m in zip(self.rows, self.matchers, strict=True):
            if not m.is_stopped():  # a finished grammar stays finished (only EOS is allowed)
                m.consume_token(sampled[row].token_id)
