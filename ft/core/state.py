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
from collections.abc import Sequence as Seq

from ft.core.batch import StateCopy
from ft.core.kv import PagePool
from ft.core.sequence import Sequence


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

    def longest_snapshot(self, hashes: Seq[int]) -> int:
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


# --- sequences' slots (the scheduler's calls) ----------------------------------------------------


def take_slot(states: StatePool, seq: Sequence, page_size: int) -> None:
    """Give `seq` (being admitted) a slot, and queue the restore of the snapshot its matched
    prefix ends at (`seq.num_computed` tokens: their pages end where one is held)."""
    seq.state_slot = states.allocate()
    if seq.num_computed:
        states.restore(seq.page_hashes[seq.num_computed // page_size - 1], seq.state_slot)


def release_slot(states: StatePool, seq: Sequence) -> None:
    """`seq`'s slot back (it ended, failed or was preempted), and no fork waits any more."""
    if seq.state_slot >= 0:
        states.release(seq.state_slot)
    seq.state_slot, seq.fork_from = -1, None


def state_boundary(seq: Sequence, page_size: int) -> int:
    """Where `seq`'s state is snapshotted and its request's other choices fork from it: the
    prompt's last full-page boundary before its last token (0: none). The next turn of a
    conversation extends the prompt; a prompt sent again recomputes its last token."""
    return (len(seq.prompt_ids) - 1) // page_size * page_size


def plan_forks(group: list[Sequence], page_size: int) -> None:
    """Choices 1.. of a request (just admitted) wait for choice 0 to compute their shared prompt
    up to its state boundary, then take its state and pages there (`fork`). Not with prompt
    logprobs (each choice scores its own copy) or pooling."""
    parent = group[0]
    boundary = state_boundary(parent, page_size)
    if parent.num_computed >= boundary or parent.wants_prompt_scores or parent.is_pooling:
        return
    for child in group[1:]:
        if child.num_computed < boundary:
            child.fork_from = parent.seq_id


def fork(child: Sequence, parent: Sequence, boundary: int, pages: PagePool, states: StatePool) -> None:
    """`child` takes `parent`'s state and its prompt's pages up to `boundary` (full pages, never
    written again, now held by both); its own pages there go back."""
    first, n = child.num_computed // pages.page_size, boundary // pages.page_size
    shared = parent.page_ids[first:n]
    pages.share(shared)
    pages.release(child.page_ids[first:n])
    child.page_ids[first:n] = shared
    child.num_computed = boundary
    child.fork_from = None
    states.fork(parent.state_slot, child.state_slot)
