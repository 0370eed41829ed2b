"""The scheduler's recurrent state slots (a hybrid model): admission, preemption, leaving,
forks of `n` > 1 choices, snapshots at page boundaries, and that nothing leaks.

A simulated runner (`Sim`) holds each slot's state as the tuple of tokens it has seen and each
KV page's slots as tokens, and checks every work against its sequence: a work that does not
start at position 0 must find in its slot the state of exactly the tokens before it, and in its
pages their KV. So a restore from the wrong snapshot, a copy run out of order or a fork that
shares the wrong pages fails the step it would corrupt.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ft.core.batch import Batch, Sampled, StateCopy
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.core.sequence import Sequence
from ft.core.state import StatePool
from ft.errors import InvalidRequest
from ft.messages import SeqFailed, StepDone, TokenOut
from ft.params import SamplingParams

EOS = 0
PAGE = 4


def make(
    num_pages: int = 64, snapshots: int = 4, max_running: int = 4, caching: bool = True, **kw: int
) -> Scheduler:
    opts = {"max_model_len": 256, "max_prefill_tokens": 16} | kw
    return Scheduler(
        PagePool(num_pages, PAGE),
        max_running=max_running,
        eos_token_ids=[EOS],
        enable_prefix_caching=caching,
        states=StatePool(max_running + snapshots, max_running),
        **opts,
    )


class Sim:
    """A runner's state slots and KV pages, as tokens; checks each work starts from the truth."""

    def __init__(self, s: Scheduler) -> None:
        assert s.states is not None
        self.s = s
        self.slots: list[tuple[int, ...] | None] = [None] * s.states.num_slots
        self.kv: dict[tuple[int, int], int] = {}  # (page, slot in page) -> token
        self.copies: list[StateCopy] = []
        self.fed: list[tuple[int, int, int]] = []  # (seq id, start, tokens) per work
        self.seen: dict[int, Sequence] = {}  # every sequence that ran
        self.chains: dict[int, tuple[int, ...]] = {}  # page chain hash -> the tokens it covers

    def step(
        self, token: int = 7, fail: frozenset[int] = frozenset()
    ) -> tuple[Batch, list[TokenOut | SeqFailed]]:
        batch = self.s.schedule()
        assert batch is not None
        for copy in batch.state_copies:
            self.slots[copy.dst] = self.slots[copy.src]
        self.copies += batch.state_copies
        self.check_snapshots()
        written: dict[int, tuple[int, ...]] = {}
        for w in batch.works:
            seq = self.s.running[w.seq_id]
            assert w.state_slot == seq.state_slot >= 0
            if w.start_pos:
                assert self.slots[w.state_slot] == tuple(seq.tokens(0, w.start_pos)), f"seq {w.seq_id}"
            for p in range(w.start_pos):
                assert self.kv.get((w.page_ids[p // PAGE], p % PAGE)) == seq.token_at(p), (w.seq_id, p)
            if w.seq_id in fail:
                continue
            for i, t in enumerate(w.token_ids):
                p = w.start_pos + i
                self.kv[(w.page_ids[p // PAGE], p % PAGE)] = t
            before = self.slots[w.state_slot] if w.start_pos else ()
            assert before is not None
            written[w.state_slot] = before + w.token_ids
            self.fed.append((w.seq_id, w.start_pos, len(w.token_ids)))
        for slot, state in written.items():
            self.slots[slot] = state
        sampled = tuple(Sampled(w.seq_id, token) for w in batch.works if w.sample and w.seq_id not in fail)
        stepped = {w.seq_id for w in batch.works}
        failed = tuple((seq_id, _failure()) for seq_id in fail if seq_id in stepped)
        return batch, self.s.on_step_done(batch, StepDone(batch.step, sampled, failed))

    def check_snapshots(self) -> None:
        """Once a batch's copies ran, every snapshot holds the state of exactly the tokens its
        key (a page's chain hash) covers, and the slots split into free, snapshots and running."""
        states = self.s.states
        assert states is not None
        for seq in self.s.running.values():
            self.seen[seq.seq_id] = seq
        for seq in self.seen.values():
            for i, h in enumerate(seq.page_hashes):
                self.chains[h] = tuple(seq.tokens(0, (i + 1) * PAGE))
        for key, slot in states._snapshots.items():
            assert self.slots[slot] == self.chains[key], f"snapshot in slot {slot} is not its key's"
        assert_slots_partitioned(self.s)

    def run_all(self, token: int = 7) -> list[TokenOut | SeqFailed]:
        outs: list[TokenOut | SeqFailed] = []
        while self.s.has_work:
            outs += self.step(token)[1]
        return outs


def _failure() -> InvalidRequest:
    return InvalidRequest("injected")


def assert_slots_partitioned(s: Scheduler) -> None:
    """Every slot is exactly one of: free, a snapshot's, a running sequence's (its own)."""
    assert s.states is not None
    free, snapshots = s.states._free, list(s.states._snapshots.values())
    running = [seq.state_slot for seq in s.running.values()]
    held = free + snapshots + running
    assert sorted(held) == list(range(s.states.num_slots)), (free, snapshots, running)


def assert_only_snapshots_held(s: Scheduler) -> None:
    assert s.states is not None
    assert s.states.num_in_use == 0
    assert s.states.num_snapshots + len(s.states._free) == s.states.num_slots
    assert s.pool.num_used == 0


def test_each_running_sequence_holds_its_own_slot_and_its_works_carry_it() -> None:
    s = make()
    s.add(1, list(range(1, 6)), SamplingParams(max_tokens=3))
    s.add(2, list(range(1, 4)), SamplingParams(max_tokens=3))
    sim = Sim(s)
    batch, _ = sim.step()
    slots = {w.seq_id: w.state_slot for w in batch.works}
    assert len(set(slots.values())) == 2 and all(slot >= 0 for slot in slots.values())
    assert s.states is not None and s.states.num_in_use == 2
    sim.run_all()
    assert_only_snapshots_held(s)


def test_n_above_the_running_slots_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="max_running_requests"):
        make(max_running=2).add(1, [1, 2], SamplingParams(n=3, max_tokens=2))


def test_finish_and_abort_give_the_slot_back() -> None:
    s = make()
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=1))
    s.add(2, [1, 2, 3], SamplingParams(max_tokens=9))
    sim = Sim(s)
    sim.step()  # request 1 finishes on its first token
    assert s.states is not None and s.states.num_in_use == 1
    s.abort(2)
    assert_only_snapshots_held(s)


def test_a_failed_sequence_gives_its_slot_back() -> None:
    s = make()
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=5))
    s.add(2, [4, 5, 6], SamplingParams(max_tokens=5))
    sim = Sim(s)
    _, outs = sim.step(fail=frozenset({0}))
    assert any(isinstance(o, SeqFailed) and o.uid == 1 for o in outs)
    sim.run_all()
    assert_only_snapshots_held(s)


def test_the_prefill_chunk_is_cut_at_the_prompts_last_full_page_and_snapshotted_there() -> None:
    """A 14-token prompt (pages of 4): its last full page before its last token ends at 12, so
    the first chunk (16 would cross it) is cut there and the next batch snapshots the state."""
    s = make()
    s.add(1, list(range(1, 15)), SamplingParams(max_tokens=2))
    sim = Sim(s)
    first, _ = sim.step()
    assert [(w.start_pos, len(w.token_ids)) for w in first.works] == [(0, 12)]
    second, _ = sim.step()
    (work,) = second.works
    assert second.state_copies == (StateCopy(work.state_slot, second.state_copies[0].dst),)
    assert work.start_pos == 12
    assert s.states is not None and s.states.num_snapshots == 1
    sim.run_all()
    assert_only_snapshots_held(s)


def test_a_next_turn_restores_the_snapshot_and_reuses_the_kv_up_to_it() -> None:
    s = make()
    turn1 = list(range(1, 15))
    s.add(1, turn1, SamplingParams(max_tokens=2))
    sim = Sim(s)
    sim.run_all()
    s.add(2, [*turn1, 50, 51, 52, 53, 54, 55], SamplingParams(max_tokens=2))
    batch, outs = sim.step()
    (work,) = batch.works
    assert work.start_pos == 12  # the snapshot's page boundary
    assert s.states is not None and s.states.num_hits == 1
    assert any(c.dst == work.state_slot for c in batch.state_copies)
    assert s.running[work.seq_id].num_cached_prompt == 12
    sim.run_all()
    assert_only_snapshots_held(s)


def test_the_same_prompt_sent_again_hits_its_snapshot() -> None:
    s = make()
    prompt = list(range(1, 15))
    sim = Sim(s)
    for uid in (1, 2):
        s.add(uid, prompt, SamplingParams(max_tokens=2))
        sim.run_all()
    assert s.states is not None and s.states.num_hits == 1


def test_cached_pages_without_a_snapshot_at_their_end_are_not_reused() -> None:
    """The pages of a prompt are cached past its snapshot (its decoded tokens fill a page): a
    prompt sharing all of them reuses only up to the snapshot, and computes the rest."""
    s = make()
    s.add(1, list(range(1, 7)), SamplingParams(max_tokens=6, ignore_eos=True))  # snapshot at 4
    sim = Sim(s)
    sim.run_all()
    prompt = list(range(1, 7)) + [7] * 6 + [9, 9]  # its output was 7s: pages 0-2 are cached
    s.add(2, prompt, SamplingParams(max_tokens=2))
    batch, _ = sim.step()
    assert [w.start_pos for w in batch.works] == [4]


def test_a_miss_computes_from_the_start() -> None:
    s = make()
    s.add(1, list(range(1, 15)), SamplingParams(max_tokens=2))
    sim = Sim(s)
    sim.run_all()
    s.add(2, [99, *range(2, 20)], SamplingParams(max_tokens=2))
    batch, _ = sim.step()
    assert [w.start_pos for w in batch.works] == [0]
    assert s.states is not None and s.states.num_hits == 0


def test_snapshots_are_evicted_least_recently_used_first() -> None:
    """Three slots, one running: a's and b's snapshots fill the others; a is used again, so
    c's snapshot evicts b's: b's next turn misses, a's hits."""
    s = make(snapshots=2, max_running=1)
    a, b, c = list(range(1, 10)), list(range(20, 29)), list(range(40, 49))
    sim = Sim(s)
    for uid, prompt in enumerate([a, b, [*a, 5], c], 1):
        s.add(uid, prompt, SamplingParams(max_tokens=1))
        sim.run_all()
    assert s.states is not None and s.states.num_hits == 1 and s.states.num_snapshots == 2
    s.add(5, [*a, 6], SamplingParams(max_tokens=1))
    sim.run_all()
    assert s.states.num_hits == 2
    s.add(6, [*b, 5], SamplingParams(max_tokens=1))
    batch, _ = sim.step()
    assert [w.start_pos for w in batch.works] == [0]
    sim.run_all()
    assert_only_snapshots_held(s)


def test_admission_takes_a_snapshots_slot_when_none_is_free() -> None:
    s = make(snapshots=1, max_running=2)
    sim = Sim(s)
    for uid, first in enumerate((1, 20, 40), 1):
        s.add(uid, list(range(first, first + 9)), SamplingParams(max_tokens=1))
        sim.run_all()
    assert s.states is not None and s.states.num_snapshots == 2  # and one slot free
    s.add(9, [70, 71, 72], SamplingParams(max_tokens=3))
    s.add(10, [80, 81, 82], SamplingParams(max_tokens=3))
    sim.step()
    assert s.states.num_in_use == 2 and s.states.num_snapshots == 1
    sim.run_all()
    assert_only_snapshots_held(s)


def test_cache_partitions_never_share_a_snapshot() -> None:
    s = make()
    prompt = list(range(1, 15))
    sim = Sim(s)
    s.add(1, prompt, SamplingParams(max_tokens=1), cache_partition=b"tenant-a")
    sim.run_all()
    s.add(2, [*prompt, 3], SamplingParams(max_tokens=1), cache_partition=b"tenant-b")
    s.add(3, [*prompt, 3], SamplingParams(max_tokens=1))
    batch, _ = sim.step()
    assert sorted(w.start_pos for w in batch.works) == [0, 0]
    s.add(4, [*prompt, 3], SamplingParams(max_tokens=1), cache_partition=b"tenant-a")
    sim.run_all()
    assert s.states is not None and s.states.num_hits == 1


def test_zero_snapshots_turn_prefix_caching_off() -> None:
    s = make(snapshots=0)
    assert not s.enable_prefix_caching
    prompt = list(range(1, 15))
    sim = Sim(s)
    for uid in (1, 2):
        s.add(uid, prompt, SamplingParams(max_tokens=2))
        first, _ = sim.step()
        assert [(w.start_pos, len(w.token_ids)) for w in first.works] == [(0, 14)]  # not cut
        sim.run_all()
    assert s.states is not None and s.states.num_snapshots == 0 and s.num_prefix_hit_tokens == 0


def test_preemption_frees_the_slot_and_the_recompute_restores_or_starts_fresh() -> None:
    """A pool too small for both: the newest request is preempted (its slot freed), and it is
    recomputed from its snapshot, then continues with every state right (the `Sim` checks)."""
    s = make(num_pages=9, snapshots=2, max_running=2)
    s.add(1, list(range(1, 10)), SamplingParams(max_tokens=20, ignore_eos=True))
    s.add(2, list(range(30, 39)), SamplingParams(max_tokens=20, ignore_eos=True))
    sim = Sim(s)
    held = []
    while s.has_work:
        sim.step()
        assert s.states is not None
        held.append(s.states.num_in_use)
        assert s.states.num_in_use == len(s.running)
    assert s.num_preemptions >= 1 and 1 in held
    assert_only_snapshots_held(s)


@pytest.mark.parametrize("caching", [True, False])
def test_n_choices_fork_from_choice_zero_after_their_shared_prompt(caching: bool) -> None:
    """Choice 0 alone computes the prompt up to its last full page; the others then take its
    state (a copy) and its pages there, compute the rest themselves and sample on their own."""
    s = make(caching=caching)
    prompt = list(range(1, 15))
    s.add(1, prompt, SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    sim = Sim(s)
    first, _ = sim.step()
    assert [(w.seq_id, w.start_pos, len(w.token_ids)) for w in first.works] == [(0, 0, 12)]
    second, _ = sim.step()
    parent = first.works[0].state_slot
    children = {w.seq_id: w for w in second.works if w.seq_id != 0}
    forks = [c for c in second.state_copies if c.dst in {w.state_slot for w in children.values()}]
    assert [c.src for c in forks] == [parent, parent]
    assert len(second.state_copies) == 2 + caching  # and the snapshot, with the prefix cache on
    assert all(w.start_pos == 12 for w in children.values())
    assert children[1].page_ids[:3] == first.works[0].page_ids[:3] == children[2].page_ids[:3]
    outs = sim.run_all()
    assert sum(isinstance(o, TokenOut) for o in outs) + 3 == 9  # (3 came in the second step)
    assert sum(n for seq_id, _, n in sim.fed if seq_id == 0) == 14 + 2
    assert sum(n for seq_id, _, n in sim.fed if seq_id == 1) == 2 + 2
    assert_only_snapshots_held(s)


def test_choices_with_prompt_logprobs_each_compute_their_prompt() -> None:
    s = make()
    s.add(1, list(range(1, 15)), SamplingParams(n=2, max_tokens=2, prompt_logprobs=0))
    sim = Sim(s)
    first, _ = sim.step()
    assert sorted(w.seq_id for w in first.works if w.start_pos == 0) == [0, 1]


def test_aborting_a_request_whose_choices_wait_to_fork_frees_everything() -> None:
    s = make()
    s.add(1, list(range(1, 15)), SamplingParams(n=3, max_tokens=3))
    sim = Sim(s)
    sim.step()
    s.abort(1)
    assert_only_snapshots_held(s)
    assert s.schedule() is not None  # the snapshot's copy still goes out (into a free slot)
    assert not s.has_work


# --- slots never leak ------------------------------------------------------------------------

BASES = ([3 + i % 5 for i in range(40)], [4 + (i * 3) % 7 for i in range(40)])  # shared prefixes
adds = st.tuples(st.just("add"), st.integers(1, 36), st.integers(4, 24), st.integers(1, 3), st.integers(0, 1))
steps = st.tuples(st.just("step"), st.integers(0, 2))
ops = st.lists(
    st.one_of(
        adds,
        adds,
        steps,
        steps,
        steps,
        st.tuples(st.just("abort"), st.integers(0, 12)),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("fail"), st.integers(0, 30)),
    ),
    min_size=4,
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_pages=st.integers(8, 24),
    snapshots=st.integers(0, 3),
    max_running=st.integers(1, 4),
    caching=st.booleans(),
)
def test_any_mix_of_requests_preemptions_forks_and_aborts_leaks_no_slot(
    ops: list[tuple[int | str, ...]], num_pages: int, snapshots: int, max_running: int, caching: bool
) -> None:
    """Whatever happens, a slot is held exactly by each running sequence, every state a work
    starts from is right (`Sim`), and once every request ended only snapshots hold slots."""
    s = make(num_pages=num_pages, snapshots=snapshots, max_running=max_running, caching=caching)
    sim = Sim(s)
    uid = 0
    for op in ops:
        match op:
            case ("add", prompt_len, max_tokens, n, variant):
                uid += 1
                prompt = BASES[int(variant)][: int(prompt_len)]
                n = min(int(n), max_running)
                params = SamplingParams(max_tokens=int(max_tokens), n=n, ignore_eos=True)
                try:
                    s.add(uid, prompt, params)
                except InvalidRequest:
                    pass
            case ("step", token):
                if s.has_work:
                    sim.step(3 + int(token))
            case ("abort", back):
                s.abort(uid - int(back))
            case ("finish", seq_id):
                s.finish_seq(int(seq_id))
            case ("fail", seq_id):
                if s.has_work and int(seq_id) in s.running:
                    sim.step(fail=frozenset({int(seq_id)}))
        assert s.states is not None
        assert s.states.num_in_use == len(s.running)
        assert_slots_partitioned(s)
    steps = 0
    while s.has_work:
        sim.step()
        steps += 1
        assert steps < 10_000
    assert_only_snapshots_held(s)
    event(f"preempted: {s.num_preemptions > 0}")
    event(f"restored: {s.states.num_hits > 0}")


requests = st.lists(
    st.tuples(st.integers(1, 30), st.integers(8, 30), st.integers(1, 2), st.integers(0, 1)),
    min_size=3,
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    tightness=st.floats(1.0, 1.3),
    snapshots=st.integers(0, 3),
    max_running=st.integers(2, 4),
    aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 7)), max_size=3),
)
def test_preemption_under_pressure_with_forks_and_aborts_leaks_no_slot(
    reqs: list[tuple[int, int, int, int]],
    tightness: float,
    snapshots: int,
    max_running: int,
    aborts: list[tuple[int, int]],
) -> None:
    """A pool just above the largest request's budget: requests (some with choices that fork)
    are preempted and recomputed, some aborted midway; every state stays right and no slot
    outlives its request."""
    budgets = [min(n, max_running) * -(-(p + 1 + m) // PAGE) for p, m, n, _ in reqs]
    s = make(num_pages=max(8, int(tightness * max(budgets))), snapshots=snapshots, max_running=max_running)
    sim = Sim(s)
    for uid, (prompt_len, max_tokens, n, variant) in enumerate(reqs):
        params = SamplingParams(max_tokens=max_tokens, n=min(n, max_running), ignore_eos=True)
        s.add(uid, BASES[variant][:prompt_len], params)
    steps = 0
    while s.has_work:
        sim.step()
        for at, uid in aborts:
            if at == steps:
                s.abort(uid)
        steps += 1
        assert s.states is not None and s.states.num_in_use == len(s.running)
        assert steps < 10_000
    assert_only_snapshots_held(s)
    event(f"preempted: {s.num_preemptions > 0}")
