"""Fair shares of a pool of workers: the next job goes to the client that used the least.

A client's usage is the worker time its jobs took, forgotten with a half-life
(`half_life_s`), plus the time its running jobs have taken so far. A job that failed (a
refusal, a crash, a deadline) is charged `failure_weight` times its time, so a client whose
requests keep failing waits behind those whose requests succeed. Among clients of equal
usage, and within one client, jobs run in the order they came.

Synchronous and clock-free (every call takes `now`); `ft.actors.fair_limiter` is its trio
shell.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

HALF_LIFE_S = 30.0
FAILURE_WEIGHT = 4.0
# Clients remembered with nothing waiting or running; past it the least used are forgotten
# (a client forgotten starts again from no usage, as a new one does).
MAX_IDLE_CLIENTS = 4096


@dataclass(slots=True)
class _Client:
    used_s: float = 0.0  # decayed worker time as of `as_of`
    as_of: float = 0.0
    waiting: deque[tuple[int, int]] = field(default_factory=deque)  # (arrival, job), oldest first
    running: dict[int, float] = field(default_factory=dict)  # job -> when it started

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running


@dataclass(frozen=True, slots=True)
class FairShareStatistics:
    """What a `FairShare` holds now."""

    num_slots: int
    num_running: int
    num_waiting: int
    num_clients: int


class FairShare:
    """A queue of jobs for `num_slots` workers, each job tagged with its client."""

    def __init__(
        self,
        num_slots: int,
        *,
        half_life_s: float = HALF_LIFE_S,
        failure_weight: float = FAILURE_WEIGHT,
        max_idle_clients: int = MAX_IDLE_CLIENTS,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if failure_weight < 1:
            raise ValueError(f"failure_weight must be at least 1, got {failure_weight}")
        self.num_slots = num_slots
        self.half_life_s = half_life_s
        self.failure_weight = failure_weight
        self.max_idle_clients = max_idle_clients
        self._clients: dict[str, _Client] = {}
        self._client_of: dict[int, str] = {}  # every job waiting or running
        self._arrivals = itertools.count()
        self.num_running = 0

    @property
    def num_waiting(self) -> int:
        """Jobs waiting for a slot."""
        return len(self._client_of) - self.num_running

    def can_start(self) -> bool:
        """Whether a slot is free and a job waits for it."""
        return self.num_running < self.num_slots and self.num_waiting > 0

    def enqueue(self, job: int, client: str) -> None:
        """Queue `job` (an id not in use) for `client`."""
        if job in self._client_of:
            raise ValueError(f"job {job} is already queued or running")
        self._client_of[job] = client
        self._clients.setdefault(client, _Client()).waiting.append((next(self._arrivals), job))

    def start_next(self, now: float) -> int | None:
        """Start the next job if a slot is free (None when none is, or nothing waits): the
        oldest job of the waiting client with the least usage, the oldest first on a tie."""
        if not self.can_start():
            return None
        _, _, name = min(
            (self.usage(name, now), client.waiting[0][0], name)
            for name, client in self._clients.items()
            if client.waiting
        )
        client = self._clients[name]
        _, job = client.waiting.popleft()
        client.running[job] = now
        self.num_running += 1
        return job

    def is_running(self, job: int) -> bool:
        """Whether `job` holds a slot."""
        name = self._client_of.get(job)
        return name is not None and job in self._clients[name].running

    def finish(self, job: int, now: float, *, failed: bool = False) -> float:
        """Free the slot `job` held and charge its client the time it ran (`failure_weight`
        times it if `failed`); return the seconds charged."""
        name = self._client_of.pop(job)
        client = self._clients[name]
        took = max(0.0, now - client.running.pop(job))
        self.num_running -= 1
        charged = took * (self.failure_weight if failed else 1.0)
        client.used_s = self._decayed(client, now) + charged
        client.as_of = now
        self._forget_idle(now)
        return charged

    def withdraw(self, job: int) -> None:
        """Take a waiting `job` out of the queue (its caller left); a running job is `finish`ed."""
        name = self._client_of.pop(job)
        client = self._clients[name]
        client.waiting = deque(item for item in client.waiting if item[1] != job)
        if client.is_idle and client.used_s == 0.0:
            del self._clients[name]

    def usage(self, client: str, now: float) -> float:
        """`client`'s worker time: what it was charged, decayed, plus its running jobs' so far."""
        state = self._clients.get(client)
        if state is None:
            return 0.0
        return self._decayed(state, now) + sum(max(0.0, now - t) for t in state.running.values())

    def statistics(self) -> FairShareStatistics:
        """What the queue holds now."""
        return FairShareStatistics(self.num_slots, self.num_running, self.num_waiting, len(self._clients))

    def _decayed(self, client: _Client, now: float) -> float:
        if client.used_s == 0.0:
            return 0.0
        return client.used_s * math.exp2(-max(0.0, now - client.as_of) / self.half_life_s)

    def _forget_idle(self, now: float) -> None:
        if len(self._clients) <= self.max_idle_clients:
            return
        idle = [name for name, client in self._clients.items() if client.is_idle]
        if len(idle) <= self.max_idle_clients:
            return
        # Amortized: only past the bound, and then down to half of it, least used first.
        idle.sort(key=lambda name: self._decayed(self._clients[name], now))
        for name in idle[: len(idle) - self.max_idle_clients // 2]:
            del self._clients[name]
