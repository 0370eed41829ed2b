"""The scheduler core: admission, batching, chunked prefill, finishing, aborting."""

from __future__ import annotations

import pytest

from ft.core.batch import Sampled
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.errors import ContextLengthExceeded, InvalidRequest
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


def test_prompt_plus_max_tokens_over_context_is_rejected_naming_the_limit() -> None:
    s = make()
    with pytest.raises(ContextLengthExceeded, match="128"):
        s.add(1, list(range(1, 100)), SamplingParams(max_tokens=40))


def test_request_larger_than_the_pool_is_rejected() -> None:
    s = make(num_pages=4, page_size=4)
    with pytest.raises(ContextLengthExceeded, match="KV pages"):
        s.add(1, [1] * 10, SamplingParams(max_tokens=10))


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


def test_decodes_run_beside_a_prefill_chunk() -> None:
    s = make(max_prefill_tokens=16)
    s.add(1, [1, 2], SamplingParams(max_tokens=10))
    run_step(s)  # request 1 prefilled, now decoding
    s.add(2, list(range(1, 41)), SamplingParams(max_tokens=2))
    batch, _ = run_step(s)
    assert [(w.seq_id, len(w.token_ids)) for w in batch.works] == [(0, 1), (1, 16)]


def test_max_running_limits_admission_and_the_rest_waits() -> None:
    s = make(max_running=2)
    for uid in range(1, 5):
        s.add(uid, [1, 2], SamplingParams(max_tokens=2))
    run_step(s)
    assert s.num_running_requests == 2 and s.num_waiting_requests == 2
    while s.has_work:
        run_step(s)
    assert s.pool.num_used == 0


def test_admission_waits_for_pages_and_never_overcommits() -> None:
    s = make(num_pages=6, page_size=4, max_running=4)  # each request needs 3 pages
    for uid in range(1, 4):
        s.add(uid, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    run_step(s)
    assert s.num_running_requests == 2
    assert s.pool.num_used == 6
    while s.has_work:
        run_step(s)
        assert s.pool.num_used <= 6
    assert s.pool.num_used == 0


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
    done = StepDone(batch.step, (Sampled(1, 5),), failed=((0, "boom"),))
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


def test_n_sequences_each_get_their_own_pages() -> None:
    s = make()
    s.add(1, [1, 2, 3], SamplingParams(max_tokens=2, n=3))
    batch, _ = run_step(s)
    assert len(batch.works) == 3
    pages = [p for w in batch.works for p in w.page_ids]
    assert len(pages) == len(set(pages)) == 6  # 5 tokens -> 2 pages each, none shared
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
    s.add(1, [1, 2, 3, 4], SamplingParams(max_tokens=12))  # 4 pages
    run_step(s)
    s.add(2, [5, 6, 7, 8], SamplingParams(max_tokens=12, n=2))  # 2 x 4 pages: does not fit yet
    for _ in range(3):
        run_step(s)
        assert s.pool.num_used == 4 and s.num_waiting_requests == 1
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
