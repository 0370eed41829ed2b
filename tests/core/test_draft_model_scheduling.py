"""The scheduler's side of draft-model speculation: the draft model's KV kept in step with the
sequence (fed what it lacks, in bounded chunks; cut back to what was accepted; reset by a
preemption), pages for the drafts, and the measured cost model that turns drafting off."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from ft.core.batch import Batch, Sampled, SeqWork
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.core.sequence import Sequence
from ft.core.spec_cost import (
    CATCH_UP_BUDGET,
    MAX_RETRY_EVERY,
    RETRY_EVERY,
    WINDOW,
    StepCosts,
    expected_accepted,
)
from ft.messages import SeqFailed, StepDone, TokenOut
from ft.params import SamplingParams

EOS = 0


def make(num_pages: int = 64, page_size: int = 4, **kw: object) -> Scheduler:
    opts: dict[str, object] = {
        "max_running": 8,
        "max_model_len": 256,
        "max_prefill_tokens": 32,
        "speculative_tokens": 4,
        "draft_model": True,
    } | kw
    return Scheduler(PagePool(num_pages, page_size), eos_token_ids=[EOS], **opts)  # type: ignore[arg-type]


def next_token(context: tuple[int, ...]) -> int:
    """The target: a function of the last two tokens and, slowly, the position."""
    return 10 + (context[-1] * 7 + context[-2] * 3 + len(context) // 5) % 5


def drafted_token(context: tuple[int, ...]) -> int:
    """The draft model: the target's token, but wrong at every third position."""
    token = next_token(context)
    return token if len(context) % 3 else 10 + (token - 9) % 5


class Models:
    """Target and draft model over KV simulations of the same slots: each reads its context
    back from its own slots, and the draft asserts that every slot it reads before its feed
    holds the sequence's token there (its KV is valid below `num_draft_computed`)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.target: dict[int, int] = {}
        self.draft: dict[int, int] = {}
        self.works: list[SeqWork] = []
        self.num_draft_forwards = 0

    def slot(self, w: SeqWork, pos: int) -> int:
        return w.page_ids[pos // self.page_size] * self.page_size + pos % self.page_size

    def step(self, s: Scheduler) -> list[TokenOut | SeqFailed]:
        batch = s.schedule()
        assert batch is not None
        sampled: list[Sampled] = []
        for w in batch.works:
            self.works.append(w)
            drafts = self.run_draft(w)
            fed = (*w.token_ids, *drafts)
            for i, token in enumerate(fed):
                self.target[self.slot(w, w.start_pos + i)] = token
            if not w.sample:
                continue
            first = w.start_pos + len(w.token_ids)
            for j in range(len(drafts) + 1):
                context = tuple(self.target[self.slot(w, p)] for p in range(first + j))
                token = next_token(context)
                sampled.append(Sampled(w.seq_id, token))
                if j == len(drafts) or token != drafts[j]:
                    break
        return s.on_step_done(batch, StepDone(batch.step, tuple(sampled)))

    def run_draft(self, w: SeqWork) -> tuple[int, ...]:
        if not w.draft_feed:
            assert not w.num_model_draft
            return ()
        for p in range(w.draft_pos):  # valid draft KV below the feed: the sequence's tokens
            assert self.draft[self.slot(w, p)] == self.target[self.slot(w, p)], (w, p)
        for i, token in enumerate(w.draft_feed):
            self.draft[self.slot(w, w.draft_pos + i)] = token
        end = w.draft_pos + len(w.draft_feed)
        if w.num_model_draft:
            assert end == w.start_pos + len(w.token_ids), "the feed ends at the work's last token"
        drafts: list[int] = []
        for j in range(w.num_model_draft):
            self.num_draft_forwards += 1
            context = tuple(self.draft[self.slot(w, p)] for p in range(end + j))
            drafts.append(drafted_token(context))
            if j + 1 < w.num_model_draft:
                self.draft[self.slot(w, end + j)] = drafts[-1]
        return tuple(drafts)


def run_all(
    s: Scheduler, reqs: list[tuple[list[int], SamplingParams]]
) -> tuple[dict[tuple[int, int], list[int]], Models]:
    models = Models(s.pool.page_size)
    for uid, (prompt, params) in enumerate(reqs, start=1):
        s.add(uid, prompt, params)
    tokens: dict[tuple[int, int], list[int]] = {}
    for _ in range(10_000):
        if not s.has_work:
            break
        for out in models.step(s):
            assert isinstance(out, TokenOut)
            tokens.setdefault((out.uid, out.index), []).append(out.token_id)
    assert not s.has_work and s.pool.num_used == 0
    return tokens, models


REQUESTS = [
    (
        list(range(1, 1 + 7 * k)) + [11, 12],
        SamplingParams(max_tokens=20 + 3 * k, n=1 + k % 2, ignore_eos=True),
    )
    for k in range(1, 5)
]


@pytest.mark.parametrize("caching", [True, False])
def test_tokens_with_a_draft_model_are_the_tokens_without(caching: bool) -> None:
    plain, _ = run_all(make(speculative_tokens=0, draft_model=False, enable_prefix_caching=caching), REQUESTS)
    s = make(enable_prefix_caching=caching)
    tokens, models = run_all(s, REQUESTS)
    assert tokens == plain
    assert s.num_accepted_tokens > 0 and s.num_draft_tokens > s.num_accepted_tokens  # both ways
    assert any(w.num_model_draft for w in models.works) and not any(w.num_draft for w in models.works)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_resets_the_draft_models_kv(caching: bool) -> None:
    """A preempted sequence's pages go to others: its draft KV is fed again from the start
    (the draft's slot check would see another sequence's tokens otherwise)."""
    plain, _ = run_all(make(num_pages=256, speculative_tokens=0, draft_model=False), REQUESTS)
    tight = make(num_pages=30, enable_prefix_caching=caching)  # each alone fits, all at once not
    tokens, _ = run_all(tight, REQUESTS)
    assert tokens == plain
    assert tight.num_preemptions > 0 and tight.num_accepted_tokens > 0


def test_a_long_prompt_feeds_the_draft_model_in_chunks_before_it_drafts() -> None:
    s = make(max_prefill_tokens=32)  # 8 tokens of catch-up a step
    s.add(1, list(range(1, 21)), SamplingParams(max_tokens=30, ignore_eos=True))
    models = Models(4)
    models.step(s)  # the prefill (the draft model is not fed with it)
    assert not models.works[-1].draft_feed
    feeds = []
    for _ in range(4):
        models.step(s)
        w = models.works[-1]
        feeds.append((w.draft_pos, len(w.draft_feed), w.num_model_draft))
    # 21 tokens to catch up (one more each step): 8, 8, then the last 7 and the drafts.
    assert feeds[:3] == [(0, 8, 0), (8, 8, 0), (16, 7, 4)]
    assert s.running[0].num_draft_computed >= 22


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 4])
def test_the_draft_models_kv_is_cut_back_to_what_was_accepted(num_accepted: int) -> None:
    s = make(page_size=4)
    s.add(1, [11, 12, 13, 14, 11, 12], SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
    used_before = s.pool.num_used
    batch = s.schedule()
    assert batch is not None
    (work,) = batch.works
    assert work.token_ids == (13,) and work.start_pos == 6 and work.num_draft == 0
    assert (work.draft_feed, work.draft_pos, work.num_model_draft) == ((11, 12, 13, 14, 11, 12, 13), 0, 4)
    assert s.pool.num_used == used_before + 1  # a page for positions 8..10 (the drafts)
    # The accepted drafts' tokens, then the target's own (the scheduler counts what it gets).
    sampled = tuple(Sampled(0, 20 + i) for i in range(num_accepted + 1))
    s.on_step_done(batch, StepDone(batch.step, sampled))
    seq = s.running[0]
    assert seq.num_computed == 7 + num_accepted
    # The draft fed 7 tokens then its first 3 drafts: the accepted ones among those stay valid.
    assert seq.num_draft_computed == 7 + min(num_accepted, 3)
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_verifications) == (4, num_accepted, 1)
    assert s.num_refusals == (num_accepted < 4)
    assert len(seq.page_ids) == -(-seq.num_tokens // 4)


def test_a_prefix_cache_hit_feeds_the_draft_model_only_the_uncached_tail() -> None:
    """The same long prompt twice: the pages the first request's draft model was fed carry its
    KV into the cache, so the second feeds it only the tail after them (the simulation checks
    every draft slot it reads holds the sequence's token), and gives the same tokens."""
    s = make(num_pages=64, page_size=4)
    models = Models(4)
    prompt = [*range(1, 41), 11, 12]  # 42 tokens: 10 full pages
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tokens: list[list[int]] = []
    fed: list[int] = []
    first_fed: list[int] = []
    for uid in (1, 2):
        s.add(uid, prompt, params)
        start = len(models.works)
        out: list[int] = []
        while s.has_work:
            out += [o.token_id for o in models.step(s) if isinstance(o, TokenOut)]
        tokens.append(out)
        feeds = [w for w in models.works[start:] if w.draft_feed]
        fed.append(sum(len(w.draft_feed) for w in feeds))
        first_fed.append(min(w.draft_pos for w in feeds))
    assert tokens[0] == tokens[1] and s.pool.num_used == 0
    assert s.num_prefix_hit_tokens == 40
    # The first fed the whole prompt; the second starts after the 40 cached tokens (what each
    # feeds of its output depends on what was accepted).
    assert first_fed == [0, 40]
    assert fed[0] >= len(prompt) and fed[1] <= fed[0] - 40 + 8, fed


def test_a_page_handed_out_again_loses_its_draft_kv() -> None:
    pool = PagePool(4, 4)
    [a, b] = pool.allocate(2)
    pool.mark_drafted([a, b])
    assert pool.num_drafted([a, b]) == 2
    pool.release([a, b])  # not registered: free, and handed out again
    assert pool.num_drafted(pool.allocate(2)) == 0


def test_a_request_that_opts_out_never_feeds_the_draft_model() -> None:
    s = make()
    s.add(1, [11, 12, 13, 14], SamplingParams(max_tokens=8, speculative=False, ignore_eos=True))
    _, models = run_all(s, [])
    assert models.works and not any(w.draft_feed or w.num_model_draft for w in models.works)
    assert s.num_draft_tokens == 0


# --- the cost model -----------------------------------------------------------------------------


def test_expected_accepted_drafts_follow_a_run_until_the_first_refusal() -> None:
    assert expected_accepted(0, 0.9) == 0.0
    assert expected_accepted(3, 1.0) == 3.0
    assert expected_accepted(3, 0.5) == pytest.approx(0.5 + 0.25 + 0.125)


def test_an_unmeasured_plain_step_is_measured_before_drafting() -> None:
    costs = StepCosts()
    assert not costs.pays(1, 4, 3.0)  # t(1) unknown: a plain step first
    costs.observe(1, 0.010)
    assert costs.pays(1, 4, 0.1)  # t(5) unknown: measured by drafting


def test_drafting_pays_only_when_the_expected_gain_beats_the_verify_rows() -> None:
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(5, 0.012)  # 4 verify rows cost 2 ms
    assert costs.pays(1, 4, 0.5)  # 0.5 tokens x 10 ms > 2 ms
    assert not costs.pays(1, 4, 0.1)  # 1 ms < 2 ms


def test_a_draft_models_forwards_count_as_cost() -> None:
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(5, 0.012)
    assert costs.pays(1, 4, 1.0, num_forwards=4)  # draft forwards unmeasured: measured
    costs.observe(5, 0.012 + 0.008, draft_s=0.008, num_forwards=4, num_drafting=1)  # 2 ms each
    assert costs.estimate(5) == pytest.approx(0.012)  # the target's share only
    assert not costs.pays(1, 4, 0.9, num_forwards=4, num_drafting=1)  # 9 ms < 2 + 8 ms
    assert costs.pays(1, 4, 1.1, num_forwards=4, num_drafting=1)


def test_the_estimate_is_the_median_of_the_last_measurements() -> None:
    costs = StepCosts()
    for seconds in (0.010, 0.011, 0.500, 0.009, 0.010):  # one step behind a busy neighbour
        costs.observe(3, seconds)
    assert costs.estimate(3) == 0.010
    for _ in range(WINDOW):
        costs.observe(3, 0.020)  # the machine got slower for good: the old ones age out
    assert costs.estimate(3) == 0.020


def test_unmeasured_row_counts_are_interpolated_between_measured_ones() -> None:
    costs = StepCosts()
    costs.observe(2, 0.010)
    costs.observe(10, 0.018)
    costs.observe(1, 0.009)
    # t(6) = 14 ms by interpolation: 4 rows cost 4 ms over t(2), worth more than 0.7 x 5 ms.
    assert not costs.pays(2, 4, 0.7)
    assert costs.pays(2, 4, 0.9)


def test_a_decision_that_stays_the_same_is_tried_the_other_way_less_and_less_often() -> None:
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(5, 0.050)  # verifying is far too dear
    decisions = [costs.pays(1, 4, 0.5) for _ in range(200)]
    # after RETRY_EVERY steps, then twice as many after each retry that changed nothing
    first, second = RETRY_EVERY, RETRY_EVERY + 1 + 2 * RETRY_EVERY
    assert [i for i, d in enumerate(decisions) if d] == [first, second, second + 1 + 4 * RETRY_EVERY]
    assert not costs.pays(1, 4, 0.5)
    assert costs.pays(1, 4, 10.0)  # the measurements changed the decision: retries start over
    decisions = [costs.pays(1, 4, 10.0) for _ in range(RETRY_EVERY + 1)]
    assert decisions.index(False) == RETRY_EVERY - 1


def test_a_retry_that_must_feed_a_lagging_draft_model_waits_until_it_costs_a_hundredth() -> None:
    def refusing() -> StepCosts:
        costs = StepCosts()
        costs.observe(1, 0.010)
        costs.observe(5, 0.050)  # verifying is far too dear
        costs.observe_catch_up(100, 0.10035)  # ~1 ms a token of catch-up
        return costs

    # 100 tokens behind: 0.10035 s to feed, so not before 100 x that = 1,003.5 steps of 10 ms
    assert CATCH_UP_BUDGET == 100
    costs = refusing()
    decisions = [costs.pays(1, 4, 0.5, num_catch_up=100) for _ in range(1200)]
    assert [i + 1 for i, d in enumerate(decisions) if d] == [1004]
    # one token behind (a draft model that was never refused): retries as without one
    costs = refusing()
    decisions = [costs.pays(1, 4, 0.5, num_catch_up=1) for _ in range(RETRY_EVERY + 1)]
    assert [i for i, d in enumerate(decisions) if d] == [RETRY_EVERY]
    # drafting that pays is never held back by its catch-up (only retries to drafting are)
    assert costs.pays(1, 4, 10.0, num_catch_up=10_000)


def test_retries_are_never_further_apart_than_the_cap() -> None:
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(5, 0.050)
    retries = [i for i in range(6000) if costs.pays(1, 4, 0.5)]
    gaps = [b - a for a, b in zip(retries, retries[1:], strict=False)]
    assert gaps[-1] == MAX_RETRY_EVERY + 1 and max(gaps) == MAX_RETRY_EVERY + 1


def make_costs(plain: float, verify: float) -> StepCosts:
    costs = StepCosts()
    costs.observe(1, plain)
    for rows in range(2, 10):
        costs.observe(rows, verify)
    return costs


def test_the_scheduler_drafts_only_when_the_cost_model_says_it_pays() -> None:
    prompt = [11, 12, 13, 14, 11, 12]
    for verify_s, drafts in ((0.0101, True), (0.5, False)):
        s = make(draft_model=False, costs=make_costs(0.010, verify_s))
        s.add(1, prompt, SamplingParams(max_tokens=20))
        batch = s.schedule()
        assert batch is not None
        s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
        batch = s.schedule()
        assert batch is not None
        (work,) = batch.works
        assert bool(work.num_draft) == drafts, verify_s
        assert s.pool.num_used == 2 + drafts  # no page taken for drafts that are not run


def test_the_scheduler_measures_decode_steps_into_its_cost_model() -> None:
    costs = StepCosts()
    s = make(draft_model=False, costs=costs)
    s.add(1, [11, 12, 13, 14, 11, 12], SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),), duration_s=0.5))
    assert costs.step_s == {}  # a prefill is no decode step's cost
    batch = s.schedule()  # t(1) unknown: a plain decode
    assert batch is not None and batch.works[0].num_draft == 0
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 14),), duration_s=0.01))
    assert costs.estimate(1) == 0.01 and costs.estimate(2) is None
    batch = s.schedule()  # t(1 + drafts) unknown: drafted and measured
    assert batch is not None and batch.works[0].num_draft > 0
    rows = 1 + batch.works[0].num_draft
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 99),), duration_s=0.02))
    assert costs.estimate(rows) == 0.02


@pytest.mark.parametrize(("verify_s", "fed"), [(0.0101, True), (0.5, False)])
def test_a_lagging_draft_model_is_fed_only_while_drafting_pays(verify_s: float, fed: bool) -> None:
    """A draft model the cost model keeps off is not fed the prompt in chunks (its catch-up
    was the whole cost of a draft model that never agrees: 0 of 123 drafts accepted on a 1B
    target, 2% of its decode), except on the cost model's rare retries: then it is fed until
    it drafts once, so the retry measures its drafts."""
    costs = make_costs(0.010, verify_s)
    costs.observe(5, verify_s + 0.001, draft_s=0.001, num_forwards=4, num_drafting=1)  # measured
    s = make(max_prefill_tokens=32, costs=costs)  # 8 tokens a catch-up
    s.add(1, list(range(1, 41)), SamplingParams(max_tokens=2 * RETRY_EVERY, ignore_eos=True))
    tokens, models = run_all(s, [])
    assert len(tokens[1, 0]) == 2 * RETRY_EVERY
    feeds = [len(w.draft_feed) for w in models.works if w.draft_feed]
    if fed:  # 41 tokens behind after the prefill: 8 a step, then it drafts
        assert feeds[:5] == [8] * 5 and s.num_draft_tokens > 0
    else:  # the one retry in 31 steps (its 17th decode) fed the lag in chunks, then drafted
        drafting = [(w.start_pos, len(w.draft_feed), w.num_model_draft) for w in models.works if w.draft_feed]
        assert drafting[0][0] == 40 + RETRY_EVERY and feeds == [8] * 8
        assert [k for *_, k in drafting] == [0] * 7 + [4] and s.num_verifications == 1


def test_a_sequence_whose_drafts_fail_does_not_draft_beside_one_whose_drafts_pay() -> None:
    """The step's gate decides for all its drafts at once: one request refusing every draft
    beside one accepting them all would cost a verify row a step. Its own expected gain is
    weighed against the rows it adds, so only the other drafts."""
    costs = StepCosts()
    costs.observe(2, 0.010)
    costs.observe(10, 0.012)  # 0.25 ms a verify row; 5 ms a token without drafts
    s = make(draft_model=False, costs=costs)
    prompt = [11, 12, 13, 14, 11, 12]  # "13 14 11 12" is drafted after the next "13"
    s.add(1, prompt, SamplingParams(max_tokens=20))
    s.add(2, prompt, SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13), Sampled(1, 13))))
    good, bad = s.running[0], s.running[1]
    good.num_accepted, good.num_refusals = 40, 2
    bad.num_accepted, bad.num_refusals = 0, 40
    batch = s.schedule()
    assert batch is not None
    drafts = {w.seq_id: w.num_draft for w in batch.works}
    assert drafts[0] > 0 and drafts[1] == 0
    # When neither pays on its own, the step's gate decides for both: it refuses (and retries
    # now and then).
    good.num_accepted, good.num_refusals = 0, 40
    batch2 = s.schedule()
    assert batch2 is not None and all(w.num_draft == 0 for w in batch2.works)


def test_a_sequence_passed_over_beside_others_is_let_through_now_and_then() -> None:
    """So that its acceptance is measured again: after RETRY_EVERY steps passed over, then
    twice as many each time (the step's own gate retrying on the same cadence must not
    swallow those steps)."""
    costs = StepCosts()
    costs.observe(2, 0.010)
    costs.observe(10, 0.012)
    s = make(draft_model=False, costs=costs)
    params = SamplingParams(max_tokens=20)
    good, bad = Sequence(0, 1, 0, [1, 2], params), Sequence(1, 2, 0, [1, 2], params)
    good.num_accepted, good.num_refusals = 400, 20
    bad.num_accepted, bad.num_refusals = 0, 40
    s.num_accepted_tokens, s.num_refusals = 400, 30
    steps = [s._worth([good, bad], {0: [5, 6, 7, 8], 1: [5]}) for _ in range(1000)]
    assert sum(1 in step for step in steps) == 5  # steps 17, 50, 115, 244, 501 (spacing 16 .. 256)
    assert sum(0 in step for step in steps) >= 990  # only the gate's own retries skip a step


def test_a_request_the_engine_gave_up_on_drafts_once_a_retry_feeds_its_draft_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Earlier requests' drafts all failed, so the gate refuses this one's from the start, while
    its draft model lags behind a long prompt; this one's drafts would all be accepted. A
    retry feeds its draft model until it drafts (one chunk a retry never caught up: it drafted
    nothing in 1,500 tokens), and once its drafts are seen to pay it keeps drafting."""
    monkeypatch.setattr(sys.modules[__name__], "drafted_token", next_token)  # always agrees
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(5, 0.012)  # 0.5 ms a verify row
    costs.observe(5, 0.0125, draft_s=0.002, num_forwards=4, num_drafting=1)  # 0.5 ms a draft forward
    s = make(max_prefill_tokens=32, max_model_len=2048, num_pages=600, costs=costs)  # 8 a catch-up
    s.num_accepted_tokens, s.num_refusals = 0, 100
    prompt = list(range(1, 61))
    tokens, models = run_all(s, [(prompt, SamplingParams(max_tokens=1500, ignore_eos=True))])
    assert len(tokens[1, 0]) == 1500
    assert s.num_accepted_tokens > 1000 and len(models.works) < 700


def test_a_step_feeding_a_catch_up_or_drafts_measures_each_as_what_it_is() -> None:
    """A drafting work's usual one- or two-token feed is drafting (measured per forward); a
    step that fed catch-ups gives catch-up seconds per token, less its drafting's share."""
    costs = StepCosts()
    s = make(costs=costs)
    s.add(1, [11, 12, 13, 14, 11, 12], SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
    decode = s.schedule()  # a decode work to vary
    assert decode is not None
    work = replace(decode.works[0], draft_feed=(), num_model_draft=0)
    catch_up = replace(work, draft_feed=tuple(range(40)), draft_pos=0)
    drafting = replace(work, draft_feed=(12, 13), draft_pos=5, num_model_draft=4)
    for works, draft_s in (((drafting,), 0.004), ((catch_up,), 0.020), ((catch_up, drafting), 0.030)):
        s._observe_costs(Batch(9, works, (), ()), StepDone(9, (), duration_s=0.05, draft_s=draft_s))
    assert list(costs.catch_up_s) == [pytest.approx(0.020 / 40), pytest.approx((0.030 - 4 * 0.001) / 40)]
    assert {rows: list(v) for rows, v in costs.draft_forward_s.items()} == {1: [pytest.approx(0.001)]}


def test_a_catch_up_fed_with_drafting_is_measured_only_when_the_feed_dominates() -> None:
    costs = StepCosts()
    costs.observe_catch_up(36, 0.040, num_forwards=4, num_drafting=1)  # drafting unmeasured
    assert list(costs.catch_up_s) == [pytest.approx(0.036 / 36)]  # forwards as tokens: dearer
    costs.catch_up_s.clear()
    costs.observe(5, 0.014, draft_s=0.004, num_forwards=4, num_drafting=1)  # 1 ms a forward
    costs.observe_catch_up(24, 0.010, num_forwards=4, num_drafting=1)  # mostly the forwards
    assert not costs.catch_up_s
    costs.observe_catch_up(40, 0.024, num_forwards=4, num_drafting=1)
    assert list(costs.catch_up_s) == [pytest.approx(0.020 / 40)]


def test_a_preempted_sequence_stops_catching_up_and_waits_for_the_gate_again() -> None:
    costs = make_costs(0.010, 0.5)  # drafting never pays
    costs.observe(5, 0.501, draft_s=0.001, num_forwards=4, num_drafting=1)
    s = make(max_prefill_tokens=32, costs=costs)
    s.add(1, list(range(1, 41)), SamplingParams(max_tokens=40, ignore_eos=True))
    models = Models(4)
    while not any(w.draft_feed for w in models.works):  # the gate's retry starts a catch-up
        models.step(s)
    seq = s.running[0]
    assert seq.catching_up
    s.preempt(1)
    assert not seq.catching_up and seq.num_draft_computed == 0
    start = len(models.works)
    for _ in range(8):  # recomputed, then decoding again: its draft model is not fed
        models.step(s)
    assert not any(w.draft_feed for w in models.works[start:])


def test_a_draft_model_passed_over_beside_others_is_retried_within_the_catch_up_budget() -> None:
    """Passed over, its draft model is not fed, so its lag grows a token a step: letting it
    through every 16, 32, ... steps would feed it about a token a step. It waits as the gate's
    retries do, until its catch-up costs at most 1 / CATCH_UP_BUDGET of the steps since."""
    costs = StepCosts()
    costs.observe(2, 0.010)
    costs.observe(10, 0.012)
    costs.observe_catch_up(100, 0.05)  # 0.5 ms a token: 10% of a step's 5 ms a token
    s = make(costs=costs)
    params = SamplingParams(max_tokens=2000)
    good, bad = Sequence(0, 1, 0, [1, 2], params), Sequence(1, 2, 0, [1, 2], params)
    good.num_accepted, good.num_refusals = 400, 20
    bad.num_accepted, bad.num_refusals = 0, 40
    s.num_accepted_tokens, s.num_refusals = 400, 30
    let = []
    for step in range(600):
        good.num_draft_computed = good.num_tokens - 1  # caught up: it drafts every step
        if s._worth([good, bad], {0: [5, 6, 7, 8], 1: 1}).get(1):
            let.append(step)
        bad.output_ids.append(9)  # both grow a token a step; only the good one is fed
        good.output_ids.append(9)
    assert let == []  # 0.5 ms x 100 a token of lag never fits in the 10 ms steps since
    bad.num_draft_computed = bad.num_tokens - 1  # caught up (say, a new request)
    assert any(s._worth([good, bad], {0: [5, 6, 7, 8], 1: 1}).get(1) for _ in range(40))


def test_a_verify_step_measured_faster_than_a_plain_one_does_not_make_drafts_free() -> None:
    """The two medians are measured at different times: under a neighbour's load a stale
    t(1 + drafts) below a fresh t(1) made drafts look as if they saved time by themselves."""
    costs = StepCosts()
    costs.observe(1, 0.030)  # measured under load
    costs.observe(5, 0.020, draft_s=0.004, num_forwards=4, num_drafting=1)  # measured quiet
    costs.observe(5, 0.016)
    assert not costs.pays(1, 4, 0.01, num_forwards=4, num_drafting=1)  # 0.3 ms < 4 ms drafting
    assert not costs.pays(1, 4, 0.0)  # free n-gram drafts, nothing expected: no gain either
