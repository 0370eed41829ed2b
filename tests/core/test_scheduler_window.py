"""Pages behind the window: a model whose every layer attends its last `kv_window` positions
gives back the pages a sequence has passed, and the prefix cache stays right."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.core.batch import Sampled
from ft.core.kv import PagePool
from ft.core.prompt_cache import PromptCache, cache_identity
from ft.core.scheduler import Scheduler
from ft.errors import ContextLengthExceeded
from ft.messages import Batch, StepDone, TokenOut
from ft.params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Buffer

WINDOW, PAGE = 8, 4


def make(num_pages: int = 64, kv_window: int = WINDOW, **kw: int | bool) -> Scheduler:
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


class PagedModel:
    """A fake model over a real paged KV store: each work writes its tokens into the slots its
    block table names, and a sampled token is a function of the tokens read back from the
    slots of the last `WINDOW` positions, so a page freed and handed to another sequence while
    still in some window changes the output."""

    def __init__(self, page_size: int = PAGE, window: int = WINDOW) -> None:
        self.page_size, self.window = page_size, window
        self.slots: dict[int, int] = {}

    def _slot(self, page_ids: tuple[int, ...], pos: int) -> int:
        return page_ids[pos // self.page_size] * self.page_size + pos % self.page_size

    def _sample(self, page_ids: tuple[int, ...], last: int) -> int:
        """A function of the tokens the slots of positions `last - window + 1 .. last` hold."""
        first = max(0, last - self.window + 1)
        return (
            1 + sum(self.slots[self._slot(page_ids, p)] * (p - first + 1) for p in range(first, last + 1)) % 7
        )

    def step(self, batch: Batch) -> StepDone:
        sampled = []
        for w in batch.works:
            assert len(w.page_ids) * self.page_size >= w.start_pos + len(w.token_ids)
            for i, token in enumerate(w.token_ids):
                self.slots[self._slot(w.page_ids, w.start_pos + i)] = token
            if not w.sample:
                continue
            last = w.start_pos + len(w.token_ids) - 1 - w.num_draft  # before the drafts
            drafts = w.token_ids[len(w.token_ids) - w.num_draft :]
            for j in range(w.num_draft + 1):  # verified as the runner does: up to a refusal
                token = self._sample(w.page_ids, last + j)
                sampled.append(Sampled(w.seq_id, token))
                if j == w.num_draft or token != drafts[j]:
                    break
        return StepDone(batch.step, tuple(sampled))


def _held_pages(s: Scheduler) -> set[int]:
    """The pages the running sequences hold (behind their placeholders): all the pool has in use."""
    return {page for seq in s.running.values() for page in seq.page_ids[seq.num_dropped :]}


def serve(
    s: Scheduler,
    requests: list[tuple[list[int], int]],
    model: PagedModel | None = None,
    max_steps: int = 5000,
) -> dict[int, list[int]]:
    """Every request's tokens through `s` and `model` (the KV its pages hold: a fresh one when
    None); checks each step that the pages in use are those held, and the window bound."""
    model = model or PagedModel(s.pool.page_size, WINDOW)
    for uid, (prompt, max_tokens) in enumerate(requests):
        s.add(uid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[int, list[int]] = {uid: [] for uid in range(len(requests))}
    for _ in range(max_steps):
        batch = s.schedule()
        if batch is None:
            break
        assert s.pool.num_used == len(_held_pages(s)) <= s.pool.num_pages
        if s.kv_window:
            for seq in s.running.values():
                assert len(seq.page_ids) - seq.num_dropped <= s.window_pages
        for out in s.on_step_done(batch, model.step(batch)):
            assert isinstance(out, TokenOut)
            tokens[out.uid].append(out.token_id)
        assert s.pool.num_used == len(_held_pages(s))
    assert not s.has_work and s.pool.num_used == 0
    return tokens


def test_a_long_request_is_admitted_in_a_pool_that_holds_its_window() -> None:
    """200 prompt tokens and 60 more on 6 pages of 4: it never holds more than its window and
    the next chunk, and gives the tokens of a pool holding every page."""
    s = make(num_pages=6, max_prefill_tokens=8, max_model_len=512)
    assert s.window_pages == 5  # 7 positions before the next one, a chunk of 8: 4 pages, one more
    prompt = [1 + i % 50 for i in range(200)]
    assert s.check_fits(len(prompt), SamplingParams(max_tokens=60)) == 60
    windowed = serve(s, [(prompt, 60)])
    held = serve(make(num_pages=128, kv_window=0, max_prefill_tokens=8, max_model_len=512), [(prompt, 60)])
    assert windowed == held and len(windowed[0]) == 60


def test_without_a_window_the_pool_still_bounds_the_budget() -> None:
    s = make(num_pages=6, kv_window=0, max_prefill_tokens=8, max_model_len=512)
    assert s.check_fits(10, SamplingParams(max_tokens=60)) == 6 * PAGE - 10
    with pytest.raises(ContextLengthExceeded, match="the KV pool holds 24 tokens"):
        s.check_fits(200, SamplingParams(max_tokens=60))


def test_a_pool_smaller_than_the_window_counts_the_whole_budget() -> None:
    s = make(num_pages=4, max_prefill_tokens=8, max_model_len=512)  # window_pages is 5
    assert s.check_fits(10, SamplingParams(max_tokens=60)) == 4 * PAGE - 10


def test_the_reserving_policy_keeps_counting_the_whole_budget() -> None:
    s = make(num_pages=6, max_prefill_tokens=8, max_model_len=512, reserve_full_budget=True)
    assert s.check_fits(10, SamplingParams(max_tokens=60)) == 6 * PAGE - 10


def test_a_long_cached_prefix_behind_the_window_is_not_held_at_admission() -> None:
    """The second run of a 40-token prompt matches 9 cached pages; the 7 behind the window of
    its first position to compute go back at once (`serve` checks it never holds more than its
    window's pages)."""
    s = make(num_pages=16, max_prefill_tokens=8, max_model_len=512)
    prompt, model = list(range(1, 41)), PagedModel()
    first = serve(s, [(prompt, 3)], model)
    hits = s.num_prefix_hit_tokens
    again = serve(s, [(prompt, 3)], model)
    assert s.num_prefix_hit_tokens > hits and again == first


BASE = [1 + (i * 7) % 11 for i in range(64)]  # a prefix the generated prompts share in part


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 64), st.lists(st.integers(1, 6), max_size=40), st.integers(1, 40)),
        min_size=1,
        max_size=5,
    ),
    extra_pages=st.integers(0, 12),
    max_prefill=st.integers(1, 16),
    max_running=st.integers(1, 4),
    caching=st.booleans(),
    drafts=st.sampled_from([0, 3]),
)
def test_pages_in_use_stay_in_the_pool_and_windowed_outputs_are_unchanged(
    shapes: list[tuple[int, list[int], int]],
    extra_pages: int,
    max_prefill: int,
    max_running: int,
    caching: bool,
    drafts: int,
) -> None:
    """Any mix of requests (a shared prefix of some length, then their own tokens) on a pool
    from the window's size up, with n-gram drafts or without: every request finishes, no
    sequence holds more than `window_pages`, and each gets the tokens it gets from a pool
    holding all its pages."""
    requests = [(BASE[:shared] + own or [1], max_tokens) for shared, own, max_tokens in shapes]
    opts = dict(
        max_prefill_tokens=max_prefill, max_model_len=256, max_running=max_running, speculative_tokens=drafts
    )
    s = make(num_pages=1, **opts)
    s = make(num_pages=s.window_pages + extra_pages, enable_prefix_caching=caching, **opts)
    windowed = serve(s, requests)
    held = serve(make(num_pages=512, kv_window=0, **opts), requests)
    assert windowed == held


class ModelPages:
    """The `PageIO` of a `PagedModel`: a page's payload is the tokens its slots hold."""

    page_payload_bytes = 8 * PAGE

    def __init__(self, model: PagedModel) -> None:
        self.model = model

    def page_payload(self, page: int) -> list[Buffer]:
        slots = range(page * PAGE, (page + 1) * PAGE)
        return [b"".join(self.model.slots.get(slot, 0).to_bytes(8, "little") for slot in slots)]

    def load_page(self, page: int, payload: memoryview) -> None:
        for i in range(PAGE):
            self.model.slots[page * PAGE + i] = int.from_bytes(payload[8 * i : 8 * i + 8], "little")


def serve_with_disk(s: Scheduler, cache: PromptCache, prompt: list[int], max_tokens: int) -> list[int]:
    """One request through `s`, its pages saved to and loaded from `cache` as the runner does."""
    model = PagedModel()
    io = ModelPages(model)
    s.add(0, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens = []
    for _ in range(5000):
        batch = s.schedule()
        if batch is None:
            break
        for seq in s.running.values():
            assert len(seq.page_ids) - seq.num_dropped <= s.window_pages
        cache.save_pages(io, batch.saves)
        loaded = cache.load_pages(io, batch.loads)
        done = model.step(batch)
        for out in s.on_step_done(batch, StepDone(batch.step, done.sampled, loaded=loaded)):
            assert isinstance(out, TokenOut)
            tokens.append(out.token_id)
    assert not s.has_work and s.pool.num_used == 0
    return tokens


def test_a_prompt_on_disk_longer_than_the_pool_is_loaded_a_window_at_most(tmp_path: pathlib.Path) -> None:
    """A 200-token prompt whose pages are all on disk, on 8 pages of 4 (check_fits admits it by
    its window): admission loads no more pages than the window holds (asking for all 50 at once
    left it waiting forever), and the tokens are those of the first run."""
    prompt = [1 + i % 50 for i in range(200)]

    def windowed(cache: PromptCache) -> Scheduler:
        return Scheduler(PagePool(8, PAGE), max_running=4, max_model_len=512, max_prefill_tokens=8,
                         eos_token_ids=[0], kv_window=WINDOW, disk=cache, disk_min_tokens=8)  # fmt: skip

    identity = cache_identity("window-review")
    cache = PromptCache(tmp_path, 1 << 24, identity)
    try:
        first = serve_with_disk(windowed(cache), cache, prompt, 10)
    finally:
        cache.close()
    cache = PromptCache(tmp_path, 1 << 24, identity)
    try:
        s = windowed(cache)
        again = serve_with_disk(s, cache, prompt, 10)
    finally:
        cache.close()
    assert s.num_disk_hit_tokens > 0 and again == first and len(first) == 10
