"""How many compute threads a step gets: measured per batch size, re-measured as load changes.

On a 2-core machine the forward pass shares the cores with the event loop, the tokenizer
workers and whatever else runs there. Two OpenMP threads are fastest on a quiet machine, but
when another process keeps one core busy each barrier waits for a descheduled thread and a step
took up to 7x longer than with one thread. So the runner times every step, keeps the last
few seconds per row for each thread count and batch-size bucket, uses the one whose median is
lower, and now and then tries the other so that a change in load is noticed. A count decides
only once it has `MIN_SAMPLES` measurements: with one measurement each and a moving average,
one noisy step kept a bucket on the slower count for a hundred steps (73 of 262 one-row steps
of a quiet 1B decode ran on one thread); a count that looks slower after one is measured again
every `RECHECK_EVERY` steps until it has as many, so one noisy step cannot keep it out either.
A try costs what the slower choice costs, so tries are spaced in proportion to how much slower
it was: under heavy contention a two-thread step took 2.6 s against 20 ms for one thread, and
trying it every 32 steps stalled streams for seconds.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

BUCKETS = (1, 4, 16, 64)  # rows: 1, 2-4, 5-16, 17-64, more
EXPLORE_EVERY = 128  # steps of a bucket between two tries of the slower choice, when close
MAX_SPACING = 4096  # at most this many steps between two tries
WINDOW = 5  # measurements kept per bucket and thread count; the estimate is their median
MIN_SAMPLES = 3  # measured steps of every count of a bucket before its first choice
RECHECK_EVERY = 16  # steps between tries of a count judged slower on fewer than MIN_SAMPLES


def _bucket(rows: int) -> int:
    return next((i for i, top in enumerate(BUCKETS) if rows <= top), len(BUCKETS))


class ThreadChooser:
    """Picks the thread count for a step of `rows` rows among `choices`, by measurement."""

    def __init__(self, choices: tuple[int, ...]) -> None:
        self.choices = choices
        self._cost: dict[tuple[int, int], deque[float]] = {}  # (bucket, threads) -> seconds per row
        self._warm: set[tuple[int, int]] = set()  # keys whose first (cold) step was seen
        self._steps: dict[int, int] = {}
        self._next_try: dict[int, int] = {}  # bucket -> step count of the next try

    def _estimate(self, bucket: int, threads: int) -> float:
        return statistics.median(self._cost[bucket, threads])

    def choose(self, rows: int) -> int:
        """The thread count for the next step of `rows` rows."""
        bucket = _bucket(rows)
        count = self._steps.get(bucket, 0)
        self._steps[bucket] = count + 1

        # NOTE: the most threads first: the first steps of a bucket are often its only ones
        # (a burst's prefill), and on a quiet machine more threads are the faster choice. They
        # are measured `MIN_SAMPLES` times; every other count then once, and again only while
        # it looks faster, until it has as many: a slower count costs a bucket two steps (its
        # cold one and one measured), not `MIN_SAMPLES` + 1 (of 8 one-client prompts, 4 were
        # prefilled on one thread at twice the time).
        def measured(n: int) -> int:
            return len(self._cost.get((bucket, n), ()))

        most = max(self.choices)
        if measured(most) < MIN_SAMPLES:
            return most
        untried = [n for n in self.choices if measured(n) == 0]
        if untried:
            return max(untried)
        ranked = sorted(self.choices, key=lambda n: self._estimate(bucket, n))
        if measured(ranked[0]) < MIN_SAMPLES:  # looks faster: measured more before it decides
            return ranked[0]
        if len(ranked) == 1:
            return ranked[0]
        # A count judged slower on fewer than MIN_SAMPLES measurements (one may be a noisy
        # step) is tried again soon, and its estimate does not space the tries yet.
        settled = measured(ranked[1]) >= MIN_SAMPLES
        if count < self._next_try.setdefault(bucket, count + (EXPLORE_EVERY if settled else RECHECK_EVERY)):
            return ranked[0]
        if not settled:
            self._next_try[bucket] = count + RECHECK_EVERY
            return ranked[1]
        ratio = self._estimate(bucket, ranked[1]) / max(self._estimate(bucket, ranked[0]), 1e-9)
        self._next_try[bucket] = count + min(MAX_SPACING, int(EXPLORE_EVERY * max(1.0, ratio)))
        return ranked[1]

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """Fold one step's duration into the measurements of its bucket and thread count."""
        key = (_bucket(rows), threads)
        if key not in self._warm:  # NOTE: a first step pays page faults and thread start-up
            self._warm.add(key)
            return
        cost = seconds / max(rows, 1)
        window = self._cost.setdefault(key, deque(maxlen=WINDOW))
        # A try much faster than the median replaces the window: it may hold a bad spell.
        if window and cost < statistics.median(window) / 2:
            window.clear()
        window.append(cost)

    @contextmanager
    def timed(self, rows: int) -> Iterator[int]:
        """Choose for `rows`, yield the count, and record how long the block took."""
        threads = self.choose(rows)
        start = time.perf_counter()
        yield threads
        self.record(rows, threads, time.perf_counter() - start)


def thread_choices(max_threads: int) -> tuple[int, ...]:
    """One thread and all of them (half and all past four cores)."""
    if max_threads <= 1:
        return (1,)
    return (1, max_threads) if max_threads <= 4 else (max_threads // 2, max_threads)
