"""One step's grammar masks: computed beside the forward pass, applied to the logits.

The masks of a step's constrained rows are computed by llguidance (native code, without the
GIL), then added to the logits as 0 / `-inf`, so every sampling mode (greedy, temperature,
top-k/p, min-p, penalties, logit bias, logprobs) sees only the tokens the grammar allows. The
matchers advance only once every row of the step has been sampled (each takes its token at the
start of its next mask), so a step that fails and is rerun row by row sees each matcher exactly
where it was.

A grammar's cost is its own request's. Each row's work (consuming the token sampled for it
last step, then computing its mask: both grow with an ambiguous grammar) is a task of its own,
and a row fails (an `InvalidRequest` in its stream, through `RowsFailed`; the step's other
rows are sampled) when its task is still running `MASK_DEADLINE_S` after it started (it is
left to finish: llguidance cannot be interrupted, and its item limits bound it), when one
token took more than `TOKEN_CPU_BUDGET_S` of CPU, or when its tokens have cost more than
`REQUEST_CPU_BASE_S` plus `REQUEST_CPU_PER_TOKEN_S` each. A row still queued behind slow ones
at its turn is computed by the step's own thread, so a slow grammar holds a step for at most
about one deadline and never fails another row.

A row with drafts (speculative decoding) gets a mask for each drafted position too: its task
advances the matcher through the drafts the grammar allows, a mask after each, then rolls them
back, so the matcher is where it was whatever the verification keeps. A draft the grammar
refuses ends the masks there (verification refuses it against that position's mask); the draft
masks stop early, leaving the rest of the drafts unverified, once the row's masks have used a
token's CPU budget or half its deadline, so a row costs at most about one token's budget more.
The matcher takes the accepted drafts and the token after them at the start of its next mask.

NOTE: computing the masks in a thread while the model runs pays only when the forward pass
leaves a core idle. When it uses every core, the mask thread takes one from torch's OpenMP
team and the step slows by more than the masks cost. Measured with `ft bench --structured` on
2 cores (constrained throughput / free, at 1 and 16 concurrent): always overlapped 0.89 / 0.97,
always after the forward 0.94 / 0.98, overlapped only while torch runs on fewer threads than
the machine has (what this does) 0.98 / 0.98.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import NamedTuple

import numpy as np
import torch

from ft.core.batch import ConstraintError, RowsFailed, Sampled, SeqWork
from ft.grammar.compiled import Matcher, cost_scale, error_of

# Real schemas' tokens (mask and consume) took 0.1-3.5 ms of CPU at worst, 0.07-1.1 ms on
# average, here (SmolLM2's 49k vocabulary, a loaded 2-core machine); an ambiguous grammar's
# grow with every token, to seconds. The average is the walk's (`ft.grammar.compiled`).
TOKEN_CPU_BUDGET_S = 0.01
MASK_DEADLINE_S = 0.25  # wall time, from when a row's task starts, unless it is starved:
# a task past it that has used less CPU than its token budget (other threads of this process
# hold the GIL or the cores) is waited for, up to this much wall time in all.
MASK_STARVED_DEADLINE_S = 2.0
REQUEST_CPU_BASE_S = 0.1
REQUEST_CPU_PER_TOKEN_S = 0.0025
# Threads computing masks: one row each at a time; a row past its deadline keeps its thread
# until llguidance returns, so there are spares.
MASK_THREADS = 4


class GrammarError(ConstraintError):
    """A constrained sequence's grammar failed (its limits were exceeded mid-generation)."""


_pool = ThreadPoolExecutor(max_workers=MASK_THREADS, thread_name_prefix="ft-masks")


@cache
def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[256, 8]`: for each mask byte, the 8 logit offsets it stands for (0 allowed, -inf not)."""
    rows = [[0.0 if (b >> k) & 1 else float("-inf") for k in range(8)] for b in range(256)]
    return torch.tensor(rows, dtype=dtype, device=device)


class RowMasks(NamedTuple):
    """One constrained row's masks: `bits` `[1 + drafts masked, words]` (position 0's, then one
    after each draft the grammar allowed), whether the grammar refused the draft after them,
    and the CPU time of the first mask and of them all."""

    bits: np.ndarray
    is_refused: bool
    first_cpu_s: float
    cpu_s: float


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether packed mask `mask` (32 tokens per int32, lowest bit first) allows `token`."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class StepMasks:
    """The masks of the constrained rows among one step's sampling works."""

    def __init__(self, works: Sequence[SeqWork], vocab_size: int, *, overlap: bool) -> None:
        self.vocab_size = vocab_size
        self._scale = cost_scale(vocab_size)  # the CPU budgets, for this vocabulary's masks
        self.rows = [i for i, w in enumerate(works) if w.matcher is not None]
        self.matchers: list[Matcher] = [m for w in works if (m := w.matcher) is not None]
        self.seq_ids = [works[i].seq_id for i in self.rows]
        self.drafts = [_drafts_of(works[i]) for i in self.rows]
        self.words = (vocab_size + 31) // 32
        # Each row's masks (position 0's, then one per draft the grammar allowed); every token
        # allowed until computed (a failed row's sample is dropped anyway).
        self.bits: list[np.ndarray] = [np.full((1, self.words), -1, dtype=np.int32) for _ in self.rows]
        self.is_refused = [False] * len(self.rows)  # the draft after the masked ones is refused
        self._index = {row: k for k, row in enumerate(self.rows)}  # work index -> row
        # Constrained rows (by index among them) that fail, and why.
        self.failed: dict[int, str] = {
            k: f"a mask still runs past its {MASK_DEADLINE_S * 1000:.0f} ms deadline"
            for k, m in enumerate(self.matchers)
            if m.is_busy
        }
        self._started: list[float | None] = [None] * len(self.rows)
        self._clocks: list[tuple[int, float] | None] = [None] * len(self.rows)  # CPU clock, start
        self._futures: list[Future[RowMasks] | None] | None = None
        self._collected = False
        if overlap:
            self._submit()

    @staticmethod
    def start(works: Sequence[SeqWork], vocab_size: int) -> StepMasks | None:
        """Start computing the masks of `works`' constrained rows; None when there are none."""
        if not any(w.matcher is not None for w in works):
            return None
        return StepMasks(works, vocab_size, overlap=torch.get_num_threads() < _cores())

    def _submit(self) -> None:
        self._futures = [
            None if k in self.failed else _pool.submit(self._compute, k) for k in range(len(self.rows))
        ]

    def _compute(self, k: int) -> RowMasks:
        """Row `k`'s last tokens consumed and its masks (into buffers of its own: a row
        abandoned at its deadline writes nothing shared), the matcher left after its tokens."""
        self._started[k] = began = time.perf_counter()
        drafts = self.drafts[k]
        bits = np.zeros((1 + len(drafts), self.words), dtype=np.int32)
        started = time.thread_time()
        self._clocks[k] = (time.pthread_getcpuclockid(threading.get_ident()), started)
        m = self.matchers[k]
        for token in m.next_tokens:
            if not m.llg.is_stopped():  # a finished grammar stays finished (only EOS is allowed)
                m.llg.consume_token(token)
        m.next_tokens = ()
        m.llg.unsafe_compute_mask_ptr(bits[0].ctypes.data, bits[0].nbytes)
        first_cpu_s = time.thread_time() - started
        num_masks, consumed, is_refused = 1, 0, False
        budget_s = TOKEN_CPU_BUDGET_S * self._scale
        while num_masks <= len(drafts):
            token = drafts[num_masks - 1]
            if m.llg.is_error() or not allows(bits[num_masks - 1], token):
                is_refused = True
                break
            if time.thread_time() - started > budget_s or time.perf_counter() - began > MASK_DEADLINE_S / 2:
                break  # the drafts after these are not verified
            if m.llg.is_stopped():  # only EOS was allowed, and stays so
                bits[num_masks] = bits[num_masks - 1]
            else:
                m.llg.consume_token(token)
                consumed += 1
                m.llg.unsafe_compute_mask_ptr(bits[num_masks].ctypes.data, bits[num_masks].nbytes)
            num_masks += 1
        if consumed:
            # NOTE: a draft allowed by its mask fails to consume only past the parser's limits;
            # the matcher then stays in error (llguidance cannot roll one back) and the row fails.
            m.llg.rollback(consumed)
        return RowMasks(bits[:num_masks], is_refused, first_cpu_s, time.thread_time() - started)

    def wait(self) -> None:
        """Collect the masks: each row's within its deadline, or the row fails. Afterwards no
        mask computation of this step runs on a matcher but those marked `pending`."""
        if self._collected:
            return
        self._collected = True
        if self._futures is None:
            self._submit()
        assert self._futures is not None
        for k, future in enumerate(self._futures):
            if future is None:
                continue
            if future.cancel():  # queued behind slow rows: compute it here, now
                masks = self._compute(k)
            else:
                try:
                    masks = self._result(k, future)
                except TimeoutError:
                    self.matchers[k].pending = future
                    self.failed[k] = f"a token took longer than {MASK_DEADLINE_S * 1000:.0f} ms"
                    continue
            self.bits[k] = masks.bits
            self.is_refused[k] = masks.is_refused
            self._charge(k, masks)
        for k in self.failed:
            self.bits[k] = np.full((1, self.words), -1, dtype=np.int32)  # the sample is dropped
            self.is_refused[k] = False

    def _result(self, k: int, future: Future[RowMasks]) -> RowMasks:
        """Row `k`'s mask by its deadline; past it, only while its task is starved of CPU (it
        has used less than its token budget: the deadline is for grammars, not for a busy
        process). Raises `TimeoutError`."""
        started = self._started[k] or time.perf_counter()  # None: it has just begun
        deadline = started + MASK_DEADLINE_S
        while True:
            try:
                return future.result(timeout=max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                clock = self._clocks[k]
                now = time.perf_counter()
                if clock is None or now > started + MASK_STARVED_DEADLINE_S:
                    raise
                try:
                    used_s = time.clock_gettime(clock[0]) - clock[1]
                except OSError:  # the thread has just ended its task
                    used_s = 0.0
                if used_s > TOKEN_CPU_BUDGET_S * self._scale:
                    raise
                deadline = now + 0.02

    def _charge(self, k: int, masks: RowMasks) -> None:
        m = self.matchers[k]
        m.mask_cpu_s += masks.cpu_s
        m.num_masks += len(masks.bits)
        cpu_s = masks.first_cpu_s  # the draft masks stop within the token's budget by themselves
        budget_s = (REQUEST_CPU_BASE_S + REQUEST_CPU_PER_TOKEN_S * m.num_masks) * self._scale
        token_budget_s = TOKEN_CPU_BUDGET_S * self._scale
        if m.llg.is_error():
            self.failed[k] = error_of(m.llg)
        elif not self.bits[k][0].any():
            self.failed[k] = "it allows no token"
        elif cpu_s > token_budget_s:
            self.failed[k] = (
                f"one token took {cpu_s * 1000:.0f} ms (the budget is {token_budget_s * 1000:.0f} ms): "
                "the grammar is too ambiguous"
            )
        elif m.mask_cpu_s > budget_s:
            self.failed[k] = (
                f"its masks took {m.mask_cpu_s:.2f} s over {m.num_masks} tokens (the budget is "
                f"{budget_s:.2f} s): the grammar is too ambiguous"
            )

    def num_verifiable(self, i: int, num_draft: int) -> int:
        """How many of work `i`'s `num_draft` drafts its masks cover: those the grammar allowed,
        and the one it refused (its position's mask refuses it). Call after `apply`."""
        if i not in self._index:
            return num_draft
        k = self._index[i]
        return min(num_draft, len(self.bits[k]) - 1 + self.is_refused[k])

    def apply(self, logits: torch.Tensor, first: Sequence[int] | None = None) -> None:
        """Add each row's grammar to `logits` in place: `-inf` where it forbids (nothing on a
        failed row's). `first[i]`: work i's first logits row (its drafted positions follow);
        None: one row per work."""
        self.wait()
        index: list[int] = []
        for k, row in enumerate(self.rows):
            start = row if first is None else first[row]
            index.extend(range(start, start + len(self.bits[k])))
        bits = np.concatenate(self.bits) if len(self.bits) > 1 else self.bits[0]  # [M, words]
        # One table lookup per mask byte (0.3 ms for 16 rows of 49k; a boolean masked_fill
        # took 1.6 ms). On a GPU this is the step's one extra host-to-device copy.
        packed = torch.from_numpy(bits.view(np.uint8)).to(logits.device, dtype=torch.long)
        offsets = torch.nn.functional.embedding(packed, _byte_table(logits.dtype, logits.device))
        offsets = offsets.view(len(index), -1)[:, : logits.shape[1]]
        if len(index) == logits.shape[0]:
            logits.add_(offsets)
        else:
            logits.index_add_(0, torch.tensor(index, device=logits.device), offsets)

    def accept(self, groups: Sequence[Sequence[Sampled]]) -> list[Sampled]:
        """Give each row's matcher the tokens sampled for it (`groups` in row order: the
        accepted drafts and the token after them), which it consumes at the start of its next
        mask (off the step, under that mask's budget).

        Returns:
            the samples, in order, when no row failed.

        Raises:
            RowsFailed: some rows' grammars failed; it carries the other rows' samples.
        """
        for k, (row, m) in enumerate(zip(self.rows, self.matchers, strict=True)):
            if k not in self.failed:
                m.next_tokens = tuple(s.token_id for s in groups[row])
        sampled = [s for group in groups for s in group]
        if not self.failed:
            return sampled
        dropped = {self.seq_ids[k] for k in self.failed}
        raise RowsFailed(
            [s for s in sampled if s.seq_id not in dropped],
            [(self.seq_ids[k], f"seq {self.seq_ids[k]}: structured output failed: {why}")
             for k, why in sorted(self.failed.items())],
        )  # fmt: skip


def _drafts_of(work: SeqWork) -> tuple[int, ...]:
    """The drafted tokens `work` feeds after its last accepted one."""
    return work.token_ids[len(work.token_ids) - work.num_draft :] if work.num_draft else ()
