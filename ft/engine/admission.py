"""Admission: what the engine lets in, counted until the request scopes open.

A request is admitted (`Admission`) before the work that precedes its scopes (tokenizing,
compiling its grammar, sending a stream's headers); a drain waits for every admission to be
released, and the prompts of one not yet open count against the capacity as queued work.
"""

from __future__ import annotations

import trio

from ft.actors.registry import Registry
from ft.config import EngineConfig
from ft.errors import Overloaded


class Admission:
    """A request admitted by `Engine.admit`; it holds a drain open until released.

    Until its scopes open (`opened`, once each) its `num_preparing` prompts count against the
    engine's capacity as queued work: tokenizing them and compiling a grammar wait for workers
    as queued requests do.
    """

    def __init__(self, admissions: Admissions, num_prompts: int) -> None:
        self._admissions: Admissions | None = admissions
        self.num_preparing = num_prompts

    @property
    def is_preparing(self) -> bool:
        """Whether a scope of it has yet to open."""
        return self.num_preparing > 0

    def opened(self) -> None:
        """One of its request scopes is open: the registry counts that one from now on."""
        if self.is_preparing and self._admissions is not None:
            self._admissions.num_preparing -= 1
            self.num_preparing -= 1

    def release(self) -> None:
        """Let a drain stop waiting for this request. Idempotent and synchronous."""
        if self._admissions is not None:
            self._admissions.note_released(self.num_preparing)
            self.num_preparing = 0
            self._admissions = None


class Admissions:
    """The admissions not yet released, and the capacity they and the registry share."""

    def __init__(self, config: EngineConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.num_admissions = 0  # `Admission`s not yet released: a drain waits for them
        self.num_preparing = 0  # `Admission`s whose scopes are not open yet: they count as queued
        self._all_released = trio.Event()  # set while `num_admissions` is 0
        self._all_released.set()

    def check_capacity(self, admission: Admission | None = None) -> None:
        """Raise `Overloaded` when the running slots and the queue are full.

        `admission`: the request's own place in the queue, not counted twice.
        """
        # Capacity is the running slots plus the queue. A request being tokenized or having its
        # grammar compiled counts as queued, so a burst cannot slip past the limit; one the
        # engine is done with (its client still reading its output) holds nothing and does
        # not count, so clients that stop reading cannot lock everyone out.
        in_use = self.registry.num_in_engine + self.num_preparing
        if admission is not None and admission.is_preparing:
            in_use -= 1
        if in_use >= self.config.max_running_requests + self.config.max_queued_requests:
            raise Overloaded(
                f"the queue is full ({self.config.max_queued_requests} waiting requests); retry later"
            )

    def admit(self, num_prompts: int) -> Admission:
        """Count a request of `num_prompts` prompts as admitted (the caller checked first)."""
        if self._all_released.is_set():
            self._all_released = trio.Event()
        self.num_admissions += 1
        self.num_preparing += num_prompts
        return Admission(self, num_prompts)

    def note_released(self, num_preparing: int) -> None:
        """An admission was released with `num_preparing` of its scopes never opened."""
        self.num_preparing -= num_preparing
        self.num_admissions -= 1
        if not self.num_admissions:
            self._all_released.set()

    async def wait_all_released(self) -> None:
        """Wait until every admission is released (at once, with a checkpoint, if none is held)."""
        await self._all_released.wait()
