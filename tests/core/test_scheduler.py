"""The scheduler core: admission, batching, chunked prefill, finishing, aborting."""

from __future__ import annotations

import pytest

from ft.core.batch import Sampled
from ft.core.kv import PagePool, page_hash
from ft.core.scheduler import Scheduler
from ft.errors import ContextLengthExceeded, InvalidRequest, RequestFailed
from ft.messages import Batch, SeqFailed, StepDone, TokenOut
from ft.params import SamplingParams

EOS = 0


def make(num_pages: int = 64, page_size: int = 4, **kw: int) -> Scheduler:
    opts = {"max_running": 4, "max_model_len": 128, "max_prefill_tokens": 16} | kw
    return Scheduler(PagePool(num_pages, page_size), eos_token_ids=[EOS], **opts)


def run_step(s: Scheduler, token: int = 7) -> tuple[Batch, list[TokenOut | SeqFailed]]:
    batch = s.schedule()
    assert batch is not None
    sampled = tuple(Sampled(w.seq_id, token) for w in batch.works if w.sample)
    return batch, s.on_step_done(batch, StepDone(batch.step, sampled))


def test_max_tokens_past_the_context_is_a_ceiling_lowered_to_the_room_left() -> None:
    """max_tokens past what the context leaves after the prompt runs to the context's end."""
    s = make()
    s.add(1, list(range(1, 100)), SamplingParams(max_tokens=40))
    assert s.waiting[0][0].params.max_tokens == 128 - 99


def test_a_prompt_that_fills_the_context_is_rejected_naming_the_limit() -> None:
    """A prompt that leaves no room for one token is refused, with the counts."""
    with pytest.raises(ContextLengthExceeded, match="128 tokens"):
        make().add(1, list(range(1, 129)), SamplingParams(max_tokens=1))


def test_max_tokens_past_the_pool_is_lowered_to_what_the_pool_holds() -> None:
    """A budget larger than the pool is lowered to what one sequence can hold there."""
    s = make(num_pages=4, page_size=4)
    s.add(1, [1] * 10, SamplingParams(max_tokens=10))
    assert s.waiting[0][0].params.max_tokens == 16 - 10


def test_max_tokens_within_the_room_is_kept() -> None:
    """A max_tokens that fits is not touched."""
    s = make()
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=7))
    assert s.waiting[0][0].params.max_tokens == 7


def test_n_above_max_running_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="max_running_requests"):
        make().add(1, [1, 2], SamplingParams(n=5, max_tokens=2))


def test_missing_max_tokens_means_up_to_the_context() -> None:
    s = make()
    s.add(1, [1] * 100, SamplingParams())
    assert s.waiting[0][0].params.max_tokens == 28


def test_generates_until_max_tokens_then_frees_pages() -> None:
    s = make()
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=3))
    outs = []
    while s.has_work:
        outs += run_step(s)[1]
    assert [o.finish_reason for o in outs] == [None, None, "length"]
    assert s.pool.num_used == 0


def test_eos_finishes_with_a_hidden_token_unless_ignored() -> None:
    s = make()
    s.add(1, [1, 2], SamplingParams(max_tokens=5))
    s.add(2, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    _, outs = run_step(s, token=EOS)
    by_uid = {o.uid: o for o in outs if isinstance(o, TokenOut)}
    assert by_uid[1].finish_reason == "stop" and by_uid[1].is_hidden
    assert by_uid[2].finish_reason is None


def test_stop_token_id_finishes_with_its_id() -> None:
    s = make()
    s.add(1, [1, 2], SamplingParams(max_tokens=5, stop_token_ids=(9,)))
    (out,) = run_step(s, token=9)[1]
    assert isinstance(out, TokenOut) and out.finish_reason == "stop" and out.stop_reason == 9


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    s = make(max_prefill_tokens=16)
    s.add(1, list(range(1, 41)), SamplingParams(max_tokens=2))
    sizes = []
    while s.has_work:
        batch, _ = run_step(s)
        sizes.append([len(w.token_ids) for w in batch.works])
    assert sizes[:3] == [[16], [16], [8]]
    assert sizes[3] == [1]


def test_decodes_run_beside_a_prefill_chunk_of_a_quarter_budget() -> None:
    """A step that decodes carries a quarter of the prefill budget (running streams pause for
    a short chunk only); a step without decodes takes the whole budget."""
    s = make(max_prefill_tokens=16)
    s.add(1, [1, 2], SamplingParams(max_tokens=10))
    run_step(s)  # request 1 prefilled, now decoding
    s.add(2, list(range(1, 41)), SamplingParams(max_tokens=2))
    batch, _ = run_step(s)
    assert [(w.seq_id, len(w.token_ids)) for w in batch.works] == [(0, 1), (1, 4)]
    alone = make(max_prefill_tokens=16)
    alone.add(2, list(range(1, 41)), SamplingParams(max_tokens=2))
    batch, _ = run_step(alone)
    assert [(w.seq_id, len(w.token_ids)) for w in batch.works] == [(0, 16)]


def test_max_running_limits_admission_and_the_rest_waits() -> None:
    s = make(max_running=2)
    for uid in range(1, 5):
        s.add(uid, [1, 2], SamplingParams(max_tokens=2))
    run_step(s)
    assert s.num_running_requests == 2 and s.num_waiting_requests == 2
    while s.has_work:
        run_step(s)
    assert s.pool.num_used == 0


def test_admission_by_need_runs_more_than_whole_budgets_would() -> None:
    s = make(num_pages=10, page_size=4, max_running=4)  # each budget is 9 pages; each needs 1 now
    for uid in range(1, 5):
        s.add(uid, [1, 2], SamplingParams(max_tokens=30))
    run_step(s)
    assert s.num_running_requests == 4 and s.pool.num_used == 4


def test_reserve_full_budget_admits_only_whole_budgets_and_never_preempts() -> None:
    s = make(num_pages=6, page_size=4, max_running=4, reserve_full_budget=True)  # 3 pages each
    for uid in range(1, 4):
        s.add(uid, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    run_step(s)
    assert s.num_running_requests == 2 and s.pool.num_used == 6
    while s.has_work:
        run_step(s)
        assert s.pool.num_used <= 6
    assert s.pool.num_used == 0 and s.num_preemptions == 0


def test_pages_grow_one_at_a_time_and_never_overcommit() -> None:
    s = make(num_pages=6, page_size=4, max_running=4)
    for uid in range(1, 4):
        s.add(uid, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    outs: list[TokenOut | SeqFailed] = []
    while s.has_work:
        outs += run_step(s)[1]
        assert s.pool.num_used <= 6
    assert s.pool.num_used == 0
    assert s.num_preemptions > 0
    lengths = {uid: sum(1 for o in outs if isinstance(o, TokenOut) and o.uid == uid) for uid in (1, 2, 3)}
    assert lengths == {1: 8, 2: 8, 3: 8}  # every answer whole, none repeated


def test_abort_frees_pages_at_once_and_ignores_in_flight_results() -> None:
    s = make()
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=10))
    batch = s.schedule()
    assert batch is not None and s.pool.num_used > 0
    assert s.abort(1) == 1
    assert s.pool.num_used == 0
    outs = s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 5),)))
    assert outs == [] and not s.has_work
    assert s.abort(1) == 0  # idempotent


def test_abort_of_a_waiting_request() -> None:
    s = make()
    s.add(1, [1], SamplingParams(max_tokens=1))
    assert s.abort(1) == 1 and not s.has_work


def test_failed_sequence_fails_only_its_request() -> None:
    s = make()
    s.add(1, [1, 2], SamplingParams(max_tokens=5))
    s.add(2, [1, 2], SamplingParams(max_tokens=5))
    batch = s.schedule()
    assert batch is not None
    done = StepDone(batch.step, (Sampled(1, 5),), failed=((0, RequestFailed("boom")),))
    outs = s.on_step_done(batch, done)
    assert [type(o).__name__ for o in outs] == ["SeqFailed", "TokenOut"]
    assert s.num_running_requests == 1


def test_shared_prompt_prefix_reuses_cached_pages() -> None:
    s = make(page_size=4)
    prompt = list(range(1, 14))  # 13 tokens: pages 0-2 full and reusable
    s.add(1, prompt, SamplingParams(max_tokens=1))
    while s.has_work:
        run_step(s)
    assert s.pool.num_used == 0 and s.pool.num_cached >= 3
    s.add(2, prompt, SamplingParams(max_tokens=1))
    batch = s.schedule()
    assert batch is not None
    (work,) = batch.works
    assert work.start_pos == 12 and work.token_ids == (13,)
    assert s.num_prefix_hit_tokens == 12


def prefix_hits(s: Scheduler, uid: int, prompt: list[int], partition: bytes | None) -> int:
    """Prompt tokens the prefix cache supplies request `uid`, run to its end."""
    before = s.num_prefix_hit_tokens
    s.add(uid, prompt, SamplingParams(max_tokens=1), cache_partition=partition)
    while s.has_work:
        run_step(s)
    return s.num_prefix_hit_tokens - before


def test_a_prefix_is_reused_only_within_its_cache_partition() -> None:
    """Pages computed in one partition (a tenant, a cache salt) are never another's prefix,
    the shared partition's included; the same partition still reuses them."""
    s = make(page_size=4)
    prompt = list(range(1, 14))  # 13 tokens: pages 0-2 full and reusable
    assert prefix_hits(s, 1, prompt, b"tenant a") == 0
    assert prefix_hits(s, 2, prompt, b"tenant b") == 0
    assert prefix_hits(s, 3, prompt, None) == 0
    assert prefix_hits(s, 4, prompt, b"tenant a") == 12
    assert prefix_hits(s, 5, prompt, b"tenant b") == 12
    assert prefix_hits(s, 6, prompt, None) == 12


def test_without_a_partition_pages_are_cached_under_the_unsalted_chain() -> None:
    s = make(page_size=4)
    prefix_hits(s, 1, list(range(1, 14)), None)
    h0 = page_hash(None, [1, 2, 3, 4])
    h1 = page_hash(h0, [5, 6, 7, 8])
    assert len(s.pool.match_prefix([h0, h1, page_hash(h1, [9, 10, 11, 12])])) == 3


def test_n_sequences_each_get_their_own_pages() -> None:
    s = make()
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=2, n=3))
    batch, _ = run_step(s)
    assert len(batch.works) == 3
    pages = [p for w in batch.works for p in w.page_ids]
    assert len(pages) == len(set(pages)) == 3  # prompt + 1 decode token: a page each, none shared
    while s.has_work:
        run_step(s)
    assert s.pool.num_used == 0


def test_penalties_send_the_history() -> None:
    s = make()
    s.add(1, [1, 2], SamplingParams(max_tokens=3, presence_penalty=1.0))
    s.add(2, [1, 2], SamplingParams(max_tokens=3))
    run_step(s, token=5)
    batch = s.schedule()
    assert batch is not None
    assert batch.works[0].history == (1, 2, 5) and batch.works[1].history == ()


def test_seeded_choices_get_distinct_seeds_and_choice_zero_keeps_it() -> None:
    s = make()
    s.add(1, [1, 2], SamplingParams(max_tokens=2, n=3, seed=42))
    seeds = [seq.params.seed for seq in s.waiting[0]]
    assert seeds[0] == 42 and len(set(seeds)) == 3
    s.add(2, [1, 2], SamplingParams(max_tokens=2, n=2, seed=2**63 - 1))  # wraps within int64
    assert len({seq.params.seed for seq in s.waiting[1]}) == 2


def test_a_group_that_does_not_fit_holds_no_pages_while_it_waits() -> None:
    s = make(num_pages=10, page_size=4)
    s.add(1, list(range(1, 21)), SamplingParams(max_tokens=12))  # 6 pages now
    run_step(s)
    s.add(2, [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=4, n=2))  # 2 x 3 pages
    for _ in range(3):
        run_step(s)
        assert s.num_waiting_requests == 1
        assert s.pool.num_used == len(s.running[0].page_ids)
    s.abort(2)
    s.abort(1)
    assert s.pool.num_used == 0


def test_a_waiting_group_is_admitted_once_pages_free_up() -> None:
    s = make(num_pages=10, page_size=4)
    s.add(1, [1, 2, 3, 4], SamplingParams(max_tokens=12))
    s.add(2, [5, 6, 7, 8], SamplingParams(max_tokens=12, n=2))
    while s.has_work:
        run_step(s)
        assert s.pool.num_used <= 10
    assert s.pool.num_used == 0


# --- preemption by recompute ---------------------------------------------------------------


class KvSim:
    """A runner that keeps tokens in page slots and samples from what it reads back.

    The next token is a hash of the context read from the cache, so a recompute that writes a
    token to the wrong slot, skips one, or resumes at the wrong position changes the output.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.slots: dict[int, int] = {}

    def step(self, s: Scheduler) -> tuple[Batch, list[TokenOut | SeqFailed]]:
        batch = s.schedule()
        assert batch is not None
        sampled = []
        for w in batch.works:
            size = self.page_size
            for i, token in enumerate(w.token_ids):
                pos = w.start_pos + i
                self.slots[w.page_ids[pos // size] * size + pos % size] = token
            if w.sample:
                end = w.start_pos + len(w.token_ids)
                context = tuple(self.slots[w.page_ids[p // size] * size + p % size] for p in range(end))
                seed = w.params.seed or 0
                token = 10 + hash((context, seed, w.num_generated)) % 50
                sampled.append(Sampled(w.seq_id, token))
        return batch, s.on_step_done(batch, StepDone(batch.step, tuple(sampled)))


def run_all(s: Scheduler, reqs: list[tuple[list[int], SamplingParams]]) -> dict[tuple[int, int], list[int]]:
    """Run every request to the end; each choice's tokens, keyed by (uid, index)."""
    sim = KvSim(s.pool.page_size)
    for uid, (prompt, params) in enumerate(reqs, start=1):
        s.add(uid, prompt, params)
    tokens: dict[tuple[int, int], list[int]] = {}
    for _ in range(10_000):
        if not s.has_work:
            break
        for out in sim.step(s)[1]:
            assert isinstance(out, TokenOut)
            tokens.setdefault((out.uid, out.index), []).append(out.token_id)
    assert not s.has_work and s.pool.num_used == 0
    return tokens


PRESSURE = [
    (list(range(1, 1 + 3 * k)), SamplingParams(max_tokens=20 + k, n=1 + k % 2, seed=k)) for k in range(1, 7)
]


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_continue_exactly_as_an_uninterrupted_run(caching: bool) -> None:
    roomy = run_all(make(num_pages=256, max_running=8, enable_prefix_caching=caching), PRESSURE)
    tight = make(num_pages=24, max_running=8, enable_prefix_caching=caching)
    squeezed = run_all(tight, PRESSURE)
    assert tight.num_preemptions > 0 and tight.num_recomputed_tokens > 0
    assert squeezed == roomy  # same tokens, none resent, none changed


def test_the_newest_request_is_preempted_and_goes_back_to_the_head_of_the_queue() -> None:
    s = make(num_pages=8, page_size=4, max_running=4)
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=28))
    s.add(2, [4, 5, 6], SamplingParams(max_tokens=28))
    s.add(3, [7] * 24, SamplingParams(max_tokens=1))  # waits: it needs 7 pages
    while s.num_preemptions == 0:
        run_step(s)
    assert [seq.uid for seq in s.running.values()] == [1]
    assert [group[0].uid for group in s.waiting] == [2, 3]
    (victim,) = s.waiting[0]
    assert victim.page_ids == [] and victim.num_computed == 0 and len(victim.output_ids) > 0
    assert s.pool.num_used == len(s.running[0].page_ids)


def test_a_recompute_feeds_prompt_and_output_then_samples_where_it_left_off() -> None:
    s = make(num_pages=8, page_size=4, max_running=4, max_prefill_tokens=64)
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=28))
    s.add(2, [4, 5, 6], SamplingParams(max_tokens=28))
    while s.num_preemptions == 0:
        run_step(s)
    (victim,) = s.waiting[0]
    produced = list(victim.output_ids)
    while True:
        batch, _ = run_step(s)
        work = next((w for w in batch.works if w.seq_id == victim.seq_id), None)
        if work is not None:
            break
    end = work.start_pos + len(work.token_ids)
    assert end == 3 + len(produced) and work.sample and work.num_generated == len(produced)
    assert list(work.token_ids) == ([4, 5, 6] + produced)[work.start_pos :]


def test_the_prefix_cache_serves_a_recompute_when_its_pages_survive() -> None:
    s = make(num_pages=8, page_size=4, max_running=4)
    s.add(1, list(range(1, 10)), SamplingParams(max_tokens=20))  # budget 8 pages
    s.add(2, list(range(20, 29)), SamplingParams(max_tokens=20))
    while s.num_preemptions == 0:
        run_step(s)
    s.abort(1)  # the victim's full pages are cached and nothing evicts them
    batch = s.schedule()
    assert batch is not None
    (work,) = batch.works
    assert work.start_pos > 0 and s.num_recomputed_tokens < 9


def test_the_oldest_running_request_is_never_preempted_and_every_request_finishes() -> None:
    s = make(num_pages=16, page_size=4, max_running=8)
    for uid in range(1, 13):
        s.add(uid, [uid] * (1 + uid % 5), SamplingParams(max_tokens=40))
    finished: set[int] = set()
    steps = 0
    while s.has_work:
        oldest = next(iter(s.running.values())).uid if s.running else None
        _, outs = run_step(s)
        finished |= {o.uid for o in outs if isinstance(o, TokenOut) and o.finish_reason}
        if oldest is not None and oldest not in finished:
            assert any(seq.uid == oldest for seq in s.running.values())
        steps += 1
        assert steps < 12 * 40 * 4  # bounded: the oldest advances every step
    assert finished == set(range(1, 13)) and s.num_preemptions > 0


def test_a_preempted_group_keeps_all_or_nothing() -> None:
    s = make(num_pages=10, page_size=4, max_running=4)
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=16))
    s.add(2, [4, 5, 6], SamplingParams(max_tokens=12, n=2))
    while s.num_preemptions == 0:
        run_step(s)
    assert [len(group) for group in s.waiting] == [2]
    assert all(seq.uid == 1 for seq in s.running.values())
    while s.has_work:
        run_step(s)
        uids = [seq.uid for seq in s.running.values()]
        assert uids.count(2) in (0, 2) or s.num_waiting_requests == 0


def test_a_stop_string_for_a_preempted_sequence_drops_it_from_the_queue() -> None:
    s = make(num_pages=4, page_size=4, max_running=4)
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=12))
    s.add(2, [4, 5, 6], SamplingParams(max_tokens=12))
    while s.num_preemptions == 0:
        run_step(s)
    (victim,) = s.waiting[0]
    assert s.finish_seq(victim.seq_id)
    assert not s.waiting and not s.finish_seq(victim.seq_id)


def test_abort_of_a_preempted_request_is_idempotent_and_frees_nothing_twice() -> None:
    s = make(num_pages=4, page_size=4, max_running=4)
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=12))
    s.add(2, [4, 5, 6], SamplingParams(max_tokens=12))
    while s.num_preemptions == 0:
        run_step(s)
    assert s.abort(2) == 1 and s.abort(2) == 0
    s.abort(1)
    assert s.pool.num_used == 0 and not s.has_work


def test_a_prompt_that_cannot_fit_the_pool_alone_is_refused_naming_the_pool() -> None:
    s = make(num_pages=4, page_size=4)
    with pytest.raises(ContextLengthExceeded, match="pool holds 16 tokens"):
        s.add(1, [1] * 16, SamplingParams())
    s.add(2, [1] * 15, SamplingParams())  # prompt + 1 fits: admitted, may run to the pool's end
    assert s.waiting[0][0].params.max_tokens == 1
