"""Recurrent state slots: one per running sequence of a hybrid model, and prefix snapshots.

A model with recurrent layers (short convolutions, DeltaNet, Mamba) keeps, beside its KV
pages, a fixed-size state per sequence: the whole past of its recurrent layers. The runner
holds `num_slots` of them (`ft.core.batch.StateRunner`); this pool, owned by the scheduler,
says which is whose. Slots are one index space, so every move is a `StateCopy` slot -> slot:

- a running sequence holds one slot from admission to its end or preemption (`allocate`,
  `release`); at most `max_running` run, so `max_running` slots are always theirs to take;
- the other slots hold *snapshots*: the state of some sequence after a full page, filed under
  that page's chain hash (`ft.core.kv.page_hash`, so partitions never share one), least
  recently used first out. A snapshot lets a prefix-cache hit on a hybrid skip computing the
  prefix: KV pages alone do not carry the recurrent layers' past. At least `max_snapshots` fit
  while every running slot is taken; idle running slots hold more until a sequence needs them.

Nothing is copied here: `snapshot`, `restore` and `fork` queue `StateCopy`s, which the next
batch runs in order before its works (`Batch.state_copies`). Queued in order, they stay right
whatever happens in between: a copy out of a slot runs before a later owner's copy into it,
and a fresh sequence's work ignores what its slot held (`SeqWork.state_slot`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ft.core.batch import StateCopy


class StatePool:
    """Which recurrent state slot is whose: running sequences' and snapshots'."""

    def __init__(self, num_slots: int, max_running: int) -> None:
        if not 1 <= max_running <= num_slots:
            raise ValueError(f"{num_slots} recurrent state slots cannot hold {max_running} running sequences")
        self.num_slots = num_slots
        self.max_running = max_running
        self.max_snapshots = num_slots - max_running  # 0: no snapshots (no prefix reuse)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # page hash -> slot, LRU first
        self._copies: list[StateCopy] = []
        self.num_hits = 0  # snapshots restored into a sequence's slot
        self.num_taken = 0  # snapshots taken
        self.num_evicted = 0

    @property
    def num_snapshots(self) -> int:
        """Snapshots held."""
        return len(self._snapshots)

    @property
    def num_in_use(self) -> int:
        """Slots held by running sequences."""
        return self.num_slots - len(self._free) - len(self._snapshots)

    def can_allocate(self, n: int) -> bool:
        """Whether `n` sequences can take a slot now (snapshots evicted if needed)."""
        return self.num_in_use + n <= self.max_running

    def allocate(self) -> int:
        """A slot for a sequence being admitted: a free one, else the least recently used
        snapshot's (evicted). Raises `MemoryError` past `max_running` slots in use."""
        if not self.can_allocate(1):
            raise MemoryError(f"all {self.max_running} running state slots are taken")
        if not self._free:
            self._evict()
        return self._free.pop()

    def release(self, slot: int) -> None:
        """A sequence's slot back (it ended or was preempted): what it held is never read again."""
        assert 0 <= slot < self.num_slots and slot not in self._free, f"state slot {slot} released twice"
        self._free.append(slot)

    def longest_snapshot(self, hashes: Sequence[int]) -> int:
        """The most leading pages of `hashes` (a sequence's chain) that end where a snapshot
        was taken: the KV a hybrid can reuse (0: none)."""
        for n in range(len(hashes), 0, -1):
            if hashes[n - 1] in self._snapshots:
                return n
        return 0

    def touch(self, key: int) -> None:
        """Mark snapshot `key` just used (the last one eviction picks)."""
        self._snapshots.move_to_end(key)

    def restore(self, key: int, slot: int) -> None:
        """Queue snapshot `key`'s state into `slot` (a sequence that reuses its prefix)."""
        self._copies.append(StateCopy(self._snapshots[key], slot))
        self.touch(key)
        self.num_hits += 1

    def snapshot(self, slot: int, key: int) -> None:
        """Queue a snapshot of `slot`'s state (a sequence's, after the page whose chain hash is
        `key`), evicting the least recently used when no slot is free. Nothing when snapshots
        are off or `key` is held already (only marked used)."""
        if key in self._snapshots:
            self.touch(key)
            return
        if not self.max_snapshots:
            return
        if not self._free:
            self._evict()  # (one is held: every slot is a running sequence's or a snapshot's)
        dst = self._free.pop()
        self._snapshots[key] = dst
        self._copies.append(StateCopy(slot, dst))
        self.num_taken += 1

    def fork(self, src: int, dst: int) -> None:
        """Queue a copy of running slot `src` into running slot `dst` (a choice of `n` that
        continues from another's state after their shared prompt)."""
        self._copies.append(StateCopy(src, dst))

    def take_copies(self) -> tuple[StateCopy, ...]:
        """The copies queued since the last call, in order, for the next batch."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def _evict(self) -> None:
        _, slot = self._snapshots.popitem(last=False)
        self._free.append(slot)
        self.num_evicted += 1
