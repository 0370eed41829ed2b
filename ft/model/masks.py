"""One step's grammar masks: computed beside the forward pass, applied to the logits.

The masks of a step's constrained rows are computed by llguidance's executor (native threads,
without the GIL) while the model runs, then turned into `-inf` logits, so every sampling mode
(greedy, temperature, top-k/p, min-p, penalties, logit bias, logprobs) sees only the tokens
the grammar allows. The matchers advance only once every row of the step has been sampled, so
a step that fails and is rerun row by row sees each matcher exactly where it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from ft.core.batch import Sampled, SeqWork
from ft.grammar.compiled import Matcher, error_of


class GrammarError(RuntimeError):
    """A constrained sequence's grammar failed (its limits were exceeded mid-generation)."""


_executor: llguidance.LLExecutor | None = None
_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-masks")


def _llg_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor


class StepMasks:
    """The masks of the constrained rows among one step's sampling works."""

    def __init__(self, works: Sequence[SeqWork], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows = [i for i, w in enumerate(works) if w.matcher is not None]
        self.matchers: list[Matcher] = [m for w in works if (m := w.matcher) is not None]
        self.seq_ids = [works[i].seq_id for i in self.rows]
        self.bits = np.zeros((len(self.rows), (vocab_size + 31) // 32), dtype=np.int32)
        self._done: Future[None] = _pool.submit(self._fill)

    @staticmethod
    def start(works: Sequence[SeqWork], vocab_size: int) -> StepMasks | None:
        """Start computing the masks of `works`' constrained rows; None when there are none."""
        return StepMasks(works, vocab_size) if any(w.matcher is not None for w in works) else None

    def _fill(self) -> None:
        width = self.bits.shape[1] * 4
        pairs = [(m, k) for k, m in enumerate(self.matchers)]
        _llg_executor().unsafe_compute_mask_ptr(pairs, self.bits.ctypes.data, width, len(pairs))

    def wait(self) -> None:
        """Block until the masks are computed (they are then safe to reuse or drop)."""
        self._done.result()

    def apply(self, logits: torch.Tensor) -> None:
        """Set every token a row's grammar forbids to `-inf` in `logits` `[R, vocab]` (in place).

        Raises:
            GrammarError: a row's grammar is in error, or allows nothing.
        """
        self.wait()
        for k, m in enumerate(self.matchers):
            if m.is_error() or not self.bits[k].any():
                reason = error_of(m) if m.is_error() else "it allows no token"
                raise GrammarError(f"seq {self.seq_ids[k]}: structured output failed: {reason}")
        allowed = np.unpackbits(self.bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        # On a GPU this is the step's one extra host-to-device copy, and only with grammars.
        allowed_t = torch.from_numpy(allowed.astype(np.bool_)).to(logits.device)  # [C, vocab]
        width = min(logits.shape[1], self.vocab_size)
        rows = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        picked = logits[rows, :width].masked_fill(~allowed_t[:, :width], float("-inf"))
        logits[rows, :width] = picked
        if logits.shape[1] > width:
            logits[rows, width:] = float("-inf")

    def accept(self, sampled: Sequence[Sampled]) -> None:
        """Advance each row's matcher by the token sampled for it (`sampled` in row order)."""
        for row, m in zip(self.rows, self.matchers, strict=True):
            if not m.is_stopped():  # a finished grammar stays finished (only EOS is allowed)
                m.consume_token(sampled[row].token_id)
