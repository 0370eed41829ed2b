"""Event counters and latency windows behind `/v1/stats` (request gauges are derived), and the
`RequestReport` each closed request leaves for observers (the server's Prometheus metrics)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ft.actors.registry import RequestEntry
from ft.engine.stream import RequestStream
from ft.messages import StepDone

WINDOW_S = 10.0


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


def _p95(values: deque[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


@dataclass(frozen=True, slots=True)
class RequestReport:
    """One closed engine request, as measured from its own events (seconds, trio clock).

    `outcome` is "completed", "aborted", "rejected" or "failed"; `finish_reasons` has one entry
    per choice that finished ("stop", "length"). `queue_s` runs from the scope's entry to the
    first step scheduled for it (tokenizing and waiting for a slot), `ttft_s` to its first
    token; each of `token_gaps_s` is the time between two steps that gave it tokens. Times are
    None for a request that never got that far.
    """

    request_id: str
    outcome: str
    finish_reasons: tuple[str, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    e2e_s: float
    queue_s: float | None
    ttft_s: float | None
    token_gaps_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Throughput:
    """Tokens per second over the last `WINDOW_S` seconds of steps."""

    decode_tps: float
    prefill_tps: float


RequestObserver = Callable[[RequestReport], None]


class Stats:
    """Counts what happened (completed, aborted, ...) and recent step throughput.

    `observers` are called with each `RequestReport`, synchronously at the request scope's exit
    (possibly in a cancelled task): they must be quick and must not raise.
    """

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self.completed = 0
        self.aborted = 0
        self.rejected = 0
        self.failed = 0
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        self._ttfts: deque[float] = deque(maxlen=1000)
        self._latencies: deque[float] = deque(maxlen=1000)
        self._steps: deque[tuple[float, int, int]] = deque()
        self.observers: list[RequestObserver] = []

    def started(self) -> None:
        """Mark the moment the engine became ready."""
        self.started_at = time.monotonic()

    def uptime(self) -> float:
        """Seconds since the engine became ready."""
        return time.monotonic() - self.started_at

    def record(self, outcome: str, entry: RequestEntry, stream: RequestStream, now: float) -> RequestReport:
        """Account for a request whose scope just closed; tell the observers; return its report."""
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.prompt_tokens_total += stream.num_prompt_tokens
        self.completion_tokens_total += stream.num_completion_tokens
        if outcome == "completed":
            self._latencies.append(now - entry.created_at)
            if entry.first_token_at is not None:
                self._ttfts.append(entry.first_token_at - entry.created_at)
        report = RequestReport(
            request_id=entry.request_id,
            outcome=outcome,
            finish_reasons=tuple(stream.finish_reasons[i] for i in sorted(stream.finish_reasons)),
            num_prompt_tokens=stream.num_prompt_tokens,
            num_output_tokens=stream.num_completion_tokens,
            num_cached_tokens=stream.num_cached_tokens,
            e2e_s=now - entry.created_at,
            queue_s=_since(entry.created_at, entry.scheduled_at),
            ttft_s=_since(entry.created_at, entry.first_token_at),
            token_gaps_s=tuple(entry.token_gaps),
        )
        for observe in self.observers:
            observe(report)
        return report

    def step(self, done: StepDone, now: float) -> None:
        """Account for one model step."""
        self._steps.append((now, done.num_prefill_tokens, done.num_decode_tokens))
        while self._steps and self._steps[0][0] < now - WINDOW_S:
            self._steps.popleft()

    def throughput(self, now: float) -> Throughput:
        """Prefill and decode tokens per second over the last few seconds."""
        recent = [s for s in self._steps if s[0] >= now - WINDOW_S]
        if not recent:
            return Throughput(decode_tps=0.0, prefill_tps=0.0)
        span = max(now - recent[0][0], 1e-3)
        return Throughput(
            decode_tps=round(sum(s[2] for s in recent) / span, 2),
            prefill_tps=round(sum(s[1] for s in recent) / span, 2),
        )

    def ttft_mean_ms(self) -> float:
        """The mean time to first token of recent completed requests (ms)."""
        ttft = sum(self._ttfts) / len(self._ttfts) if self._ttfts else 0.0
        return round(ttft * 1000, 2)

    def p95_ms(self) -> float:
        """The 95th percentile latency of recent completed requests (ms)."""
        return round(_p95(self._latencies) * 1000, 2)
