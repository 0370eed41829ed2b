"""Pages behind the window: a model whose every layer attends its last `kv_window` positions
gives back the pages a sequence has passed, and the prefix cache stays right."""

from __future__ import annotations

from ft.core.batch import Sampled
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.messages import Batch, StepDone, TokenOut
from ft.params import SamplingParams

WINDOW, PAGE = 8, 4


def make(num_pages: int = 64, kv_window: int = WINDOW, **kw: int) -> Scheduler:
    opts = {"max_running": 4, "max_model_len": 256, "max_prefill_tokens": 64} | kw
    return Scheduler(PagePool(num_pages, PAGE), eos_token_ids=[0], kv_window=kv_window, **opts)


def run_step(s: Scheduler, token: int = 7) -> tuple[Batch, list[TokenOut]]:
    batch = s.schedule()
    assert batch is not None
    sampled = tuple(Sampled(w.seq_id, token) for w in batch.works if w.sample)
    outs = s.on_step_done(batch, StepDone(batch.step, sampled))
    return batch, [o for o in outs if isinstance(o, TokenOut)]


def test_pages_behind_the_window_go_back_to_the_pool_as_the_sequence_decodes() -> None:
    s = make()
    s.add(1, list(range(1, 21)), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(30):
        run_step(s)
        for seq in s.running.values():
            # every position a later token attends is on a page still held
            first_needed = max(0, seq.num_computed - WINDOW + 1)
            assert seq.num_dropped == first_needed // PAGE
            held = len(seq.page_ids) - seq.num_dropped
            assert s.pool.num_used == held <= WINDOW // PAGE + 2
    assert s.num_dropped_pages > 0 and s.pool.num_used == 0


def test_without_a_window_every_page_stays_held() -> None:
    s = make(kv_window=0)
    s.add(1, list(range(1, 21)), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(10):
        run_step(s)
    (seq,) = s.running.values()
    assert seq.num_dropped == 0 and s.pool.num_used == len(seq.page_ids) == -(-seq.num_tokens // PAGE)


def test_a_work_keeps_its_block_table_layout_with_placeholders_it_never_attends() -> None:
    s = make()
    s.add(1, list(range(1, 31)), SamplingParams(max_tokens=5, ignore_eos=True))
    run_step(s)  # the prompt: 30 positions, pages 0..4 behind the next token's window
    batch, _ = run_step(s)
    (work,) = batch.works
    assert len(work.page_ids) == -(-(work.start_pos + 1) // PAGE)  # position p still on page p // 4
    dropped = (work.start_pos - WINDOW + 1) // PAGE  # behind the window when the work was made
    assert dropped > 0
    assert set(work.page_ids[:dropped]) <= set(work.page_ids[dropped:])  # pages it holds: valid ids


def test_a_dropped_registered_page_is_a_cached_prefix_for_the_next_request() -> None:
    """Its KV is that of the tokens before it: a request with the same prompt reuses it."""
    s = make()
    prompt = list(range(1, 31))
    s.add(1, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        run_step(s)
    assert s.num_dropped_pages > 0 and not s.running
    s.add(2, prompt, SamplingParams(max_tokens=1))
    run_step(s)
    assert s.num_prefix_hit_tokens == (len(prompt) - 1) // PAGE * PAGE


def test_an_evicted_dropped_page_ends_the_match_there() -> None:
    """When the pool hands a dropped cached page to another request, a later prompt sharing the
    prefix matches nothing from that page on (never a page holding someone else's KV)."""
    s = make(num_pages=12)
    prompt = list(range(1, 31))
    s.add(1, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        run_step(s)
    assert not s.running and s.pool.num_cached == 8  # every full page, the dropped ones first
    s.add(2, list(range(100, 140)), SamplingParams(max_tokens=1))  # 11 pages: evicts the oldest
    run_step(s)
    hits = s.num_prefix_hit_tokens
    s.add(3, prompt, SamplingParams(max_tokens=1))
    run_step(s)
    assert s.num_prefix_hit_tokens == hits  # its first page went first: no match at all


def test_preempting_and_aborting_a_sequence_with_dropped_pages_frees_each_page_once() -> None:
    s = make(num_pages=16)
    s.add(1, list(range(1, 25)), SamplingParams(max_tokens=30, ignore_eos=True))
    s.add(2, list(range(50, 70)), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(12):
        run_step(s)
    assert len(s.running) == 2 and all(seq.num_dropped for seq in s.running.values())
    for uid in (2, 1):
        s.preempt(uid)
    assert s.pool.num_used == 0  # PagePool.release asserts no page is released twice
    for _ in range(6):
        run_step(s)
    s.abort(1)
    s.abort(2)
    assert s.pool.num_used == 0 and not s.running
