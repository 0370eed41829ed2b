"""What the engine's watchdog reads, as plain records a test sets by hand."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Steps:
    """The runner actor as the watchdog reads it."""

    step_started_at: float | None = None
    num_steps: int = 0
    progress: int = 0


@dataclasses.dataclass
class Pending:
    """The scheduler core as the watchdog reads it: one request running."""

    has_work: bool = True
    num_running_requests: int = 1
    num_waiting_requests: int = 0
