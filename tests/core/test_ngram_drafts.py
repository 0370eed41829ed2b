"""N-gram drafting and the scheduler's side of speculative decoding: drafts scheduled, verified
tokens folded in, rejected drafts' KV rolled back, limits and switches respected."""

from __future__ import annotations

import pytest

from ft.core.batch import Sampled
from ft.core.kv import PagePool
from ft.core.ngram import DraftLength, NgramIndex
from ft.core.scheduler import Scheduler
from ft.messages import Batch, SeqFailed, StepDone, TokenOut
from ft.params import SamplingParams

EOS = 0


def make(num_pages: int = 64, page_size: int = 4, **kw: int) -> Scheduler:
    opts = {"max_running": 8, "max_model_len": 256, "max_prefill_tokens": 16, "speculative_tokens": 4} | kw
    return Scheduler(PagePool(num_pages, page_size), eos_token_ids=[EOS], **opts)


# --- the n-gram index ---------------------------------------------------------------------------


def test_the_longest_earlier_match_of_the_suffix_proposes_what_followed_it() -> None:
    index = NgramIndex()
    index.extend([5, 6, 7, 8, 9, 1, 2, 6, 7])
    # The suffix 6 7 (the 3-gram 2 6 7 never occurred) was followed by 8 9 1 2 before.
    assert index.propose(3) == [8, 9, 1]
    assert index.propose(10) == [8, 9, 1, 2, 6, 7]  # up to the end, never past it


def test_a_longer_match_wins_over_a_more_recent_shorter_one() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3])
    assert index.propose(1) == [40]  # 1 2 3 -> 40, although 2 3 -> 50 is more recent


def test_the_most_recent_occurrence_of_the_suffix_is_used() -> None:
    index = NgramIndex()
    index.extend([1, 2, 10, 1, 2, 20, 1, 2])
    assert index.propose(1) == [20]


def test_no_match_proposes_nothing_and_the_index_grows_incrementally() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3])
    assert index.propose(4) == []
    assert index.propose(0) == []
    index.extend([1, 2])
    assert index.propose(4) == [3, 1, 2]


def test_a_single_token_match_drafts_one_token() -> None:
    index = NgramIndex()
    index.extend([7, 8, 9, 7])
    assert index.propose(2) == [8]  # only "7" recurs: one draft
    index.extend([8])
    assert index.propose(2) == [9, 7]  # "7 8" recurs: the whole length
    longer = NgramIndex(max_n=3, min_n=2)
    longer.extend([7, 8, 9, 7])
    assert longer.propose(2) == []


def test_draft_length_doubles_on_full_acceptance_and_falls_to_one_past_the_accepted() -> None:
    length = DraftLength(8)
    assert length.current == 8
    length.update(8, 2)
    assert length.current == 3
    length.update(3, 3)
    assert length.current == 6
    length.update(6, 0)
    assert length.current == 1
    length.update(1, 1)
    length.update(2, 2)
    length.update(4, 4)
    assert length.current == 8  # capped
    length.update(0, 0)
    assert length.current == 8  # nothing drafted: no evidence


# --- the scheduler ------------------------------------------------------------------------------


class Model:
    """A deterministic model over a KV simulation: the next token is a function of the last two
    tokens *read back from the KV slots* (and of the position, slowly), over a small alphabet so
    n-grams repeat and drafts are often, not always, right. Drafts are verified as greedy
    decoding would, so a token fed at the wrong position or a page that lost one shows."""

    def __init__(self, page_size: int, *, record: list[Batch] | None = None) -> None:
        self.page_size = page_size
        self.slots: dict[int, int] = {}
        self.record = record

    def next_token(self, context: tuple[int, ...], seed: int) -> int:
        return 10 + (context[-1] * 7 + context[-2] * 3 + len(context) // 5 + seed) % 5

    def step(self, s: Scheduler) -> tuple[Batch, list[TokenOut | SeqFailed]]:
        batch = s.schedule()
        assert batch is not None
        if self.record is not None:
            self.record.append(batch)
        size = self.page_size
        sampled: list[Sampled] = []
        for w in batch.works:
            for i, token in enumerate(w.token_ids):
                pos = w.start_pos + i
                self.slots[w.page_ids[pos // size] * size + pos % size] = token
            if not w.sample:
                continue
            first = w.start_pos + len(w.token_ids) - w.num_draft  # end of the context before drafts
            drafts = w.token_ids[len(w.token_ids) - w.num_draft :]
            for j in range(w.num_draft + 1):
                end = first + j
                context = tuple(self.slots[w.page_ids[p // size] * size + p % size] for p in range(end))
                token = self.next_token(context, w.params.seed or 0)
                sampled.append(Sampled(w.seq_id, token))
                if j == w.num_draft or token != drafts[j]:
                    break
        return batch, s.on_step_done(batch, StepDone(batch.step, tuple(sampled)))


def run_all(
    s: Scheduler, reqs: list[tuple[list[int], SamplingParams]], record: list[Batch] | None = None
) -> dict[tuple[int, int], list[int]]:
    """Run every request to the end; each choice's tokens, keyed by (uid, index)."""
    model = Model(s.pool.page_size, record=record)
    for uid, (prompt, params) in enumerate(reqs, start=1):
        s.add(uid, prompt, params)
    tokens: dict[tuple[int, int], list[int]] = {}
    for _ in range(10_000):
        if not s.has_work:
            break
        for out in model.step(s)[1]:
            assert isinstance(out, TokenOut)
            tokens.setdefault((out.uid, out.index), []).append(out.token_id)
    assert not s.has_work and s.pool.num_used == 0
    return tokens


REQUESTS = [
    (
        list(range(1, 1 + 3 * k)) + [11, 12],
        SamplingParams(max_tokens=20 + k, n=1 + k % 2, seed=k, ignore_eos=True),
    )
    for k in range(1, 5)
]


@pytest.mark.parametrize("caching", [True, False])
def test_tokens_with_speculation_are_the_tokens_without(caching: bool) -> None:
    plain = run_all(make(speculative_tokens=0, enable_prefix_caching=caching), REQUESTS)
    s = make(enable_prefix_caching=caching)
    assert run_all(s, REQUESTS) == plain
    assert s.num_accepted_tokens > 0 and s.num_draft_tokens > s.num_accepted_tokens  # both ways


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_with_speculation_changes_no_token(caching: bool) -> None:
    plain = run_all(make(num_pages=256, speculative_tokens=0, enable_prefix_caching=caching), REQUESTS)
    tight = make(num_pages=18, enable_prefix_caching=caching)  # each alone fits, all at once not
    assert run_all(tight, REQUESTS) == plain
    assert tight.num_preemptions > 0 and tight.num_accepted_tokens > 0


def test_a_work_feeds_the_last_token_then_its_drafts_with_pages_for_them() -> None:
    s = make(page_size=4)
    s.add(1, [11, 12, 13, 14, 11, 12], SamplingParams(max_tokens=10))
    batch = s.schedule()  # the prefill
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
    batch = s.schedule()
    assert batch is not None
    (work,) = batch.works
    # ... 11 12 13: the suffix 12 13 was followed by 14 11 12 13 (the drafts run to the end).
    assert work.token_ids == (13, 14, 11, 12, 13) and work.num_draft == 4 and work.start_pos == 6
    assert len(work.page_ids) * 4 >= work.start_pos + len(work.token_ids)


@pytest.mark.parametrize("num_accepted", [0, 1, 3])
def test_rejected_drafts_are_rolled_back_and_their_pages_freed(num_accepted: int) -> None:
    s = make(page_size=4)
    s.add(1, [11, 12, 13, 14, 11, 12], SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
    used_before = s.pool.num_used  # 2 pages: positions 0..7
    batch = s.schedule()
    assert batch is not None and batch.works[0].token_ids == (13, 14, 11, 12, 13)
    assert s.pool.num_used == used_before + 1  # a page taken for the drafts (positions 8..10)
    # The first `num_accepted` drafts are accepted, the next refused: the model says 99 there.
    sampled = (*(Sampled(0, t) for t in (14, 11, 12)[:num_accepted]), Sampled(0, 99))
    outs = s.on_step_done(batch, StepDone(batch.step, sampled))
    assert [o.token_id for o in outs if isinstance(o, TokenOut)] == [s.token_id for s in sampled]
    seq = s.running[0]
    assert seq.output_ids == [13, *(s.token_id for s in sampled)]
    # Prompt 6 + 13 + the accepted drafts: the refused drafts' slots do not count.
    assert seq.num_computed == 7 + num_accepted
    assert len(seq.page_ids) == -(-seq.num_tokens // 4)  # a page only drafts used is freed
    assert s.pool.num_used == used_before + (seq.num_tokens > 8)
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_verifications) == (4, num_accepted, 1)
    assert seq.draft_length is not None and seq.draft_length.current == num_accepted + 1


def test_pages_holding_rejected_drafts_never_enter_the_prefix_cache() -> None:
    s = make(page_size=4)
    s.add(1, [11, 12, 13, 14, 11, 12, 13], SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 14),)))
    batch = s.schedule()  # feeds 14 at 7 and drafts 11 12 13 14 at 8..11 (page 2 is all drafts)
    assert batch is not None and batch.works[0].num_draft == 4
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 50),)))  # every draft refused
    seq = s.running[0]
    assert seq.num_computed == 8 and seq.num_registered == 2  # pages 0-1: accepted tokens only
    assert len(seq.page_ids) == 3 and seq.num_tokens == 9


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_drafts_never_run_past_max_tokens(max_tokens: int) -> None:
    s = make(page_size=4)
    s.add(1, [11, 12] * 6, SamplingParams(max_tokens=max_tokens))
    record: list[Batch] = []
    model = Model(4, record=record)
    outs: list[TokenOut] = []
    while s.has_work:
        outs += [o for o in model.step(s)[1] if isinstance(o, TokenOut)]
    assert len(outs) == max_tokens and outs[-1].finish_reason == "length"
    for batch in record:
        for w in batch.works:
            assert w.num_generated + w.num_draft + 1 <= max_tokens
    assert s.pool.num_used == 0


def test_drafts_never_run_past_the_context() -> None:
    s = make(page_size=4, max_model_len=16)
    s.add(1, [11, 12] * 6, SamplingParams())
    record: list[Batch] = []
    model = Model(4, record=record)
    while s.has_work:
        model.step(s)
    for batch in record:
        for w in batch.works:
            assert w.start_pos + len(w.token_ids) <= 16


def test_a_stop_token_inside_the_accepted_drafts_ends_the_output_there() -> None:
    s = make(page_size=4)
    s.add(1, [11, 12, 13, EOS, 11, 12], SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
    batch = s.schedule()
    assert batch is not None and batch.works[0].token_ids[1:3] == (EOS, 11)
    # The model accepts the eos draft and the next: the output ends at the eos, nothing after.
    outs = s.on_step_done(batch, StepDone(batch.step, (Sampled(0, EOS), Sampled(0, 11), Sampled(0, 12))))
    assert [(o.token_id, o.finish_reason) for o in outs if isinstance(o, TokenOut)] == [(EOS, "stop")]
    assert not s.running and s.pool.num_used == 0


def test_a_large_batch_drafts_nothing() -> None:
    s = make(speculative_max_batch=2)
    for uid in range(3):
        s.add(uid, [11, 12, 11, 12, 11], SamplingParams(max_tokens=30))
    record: list[Batch] = []
    model = Model(4, record=record)
    for _ in range(3):
        model.step(s)
    decodes = [w for w in record[-1].works if w.sample]
    assert len(decodes) == 3 and all(w.num_draft == 0 for w in decodes)
    s.abort(0)
    del record[:]
    for _ in range(6):
        model.step(s)
    assert any(w.num_draft for batch in record for w in batch.works)  # two decoding: it drafts


@pytest.mark.parametrize("speculative", [False, True])
def test_a_request_that_switched_speculation_off_gets_no_drafts(speculative: bool) -> None:
    # (A grammar does not stop drafting: each drafted row gets its mask, tests/model/test_grammar_drafts.py.)
    s = make()
    s.add(1, [11, 12, 11, 12, 11, 12, 11], SamplingParams(max_tokens=30, speculative=speculative))
    record: list[Batch] = []
    model = Model(4, record=record)
    for _ in range(4):
        model.step(s)
    assert any(w.num_draft for batch in record for w in batch.works) == speculative


def test_an_abort_while_drafts_are_in_flight_frees_every_page() -> None:
    s = make(page_size=4)
    s.add(1, [11, 12, 13, 14, 11, 12], SamplingParams(max_tokens=20))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
    batch = s.schedule()
    assert batch is not None and batch.works[0].num_draft
    s.abort(1)
    assert s.pool.num_used == 0
    assert s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 14), Sampled(0, 11)))) == []
    assert s.pool.num_used == 0 and not s.has_work


def test_drafts_that_find_no_free_page_are_cut_to_the_pages_held() -> None:
    s = make(num_pages=3, page_size=4)
    s.add(1, [11, 12, 13, 14, 11, 12], SamplingParams(max_tokens=6))
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, StepDone(batch.step, (Sampled(0, 13),)))
    s.add(2, [1, 2, 3], SamplingParams(max_tokens=1))  # takes the last free page
    batch = s.schedule()
    assert batch is not None
    mine = next(w for w in batch.works if w.seq_id == 0)
    assert mine.num_draft == 1  # positions 6, 7 fit its 2 pages: 13 and one draft
    assert s.pool.num_used == 3


def test_a_penalized_request_speculates_with_its_history_sent() -> None:
    s = make()
    s.add(1, [11, 12, 11, 12, 11, 12, 11], SamplingParams(max_tokens=30, presence_penalty=0.5))
    record: list[Batch] = []
    model = Model(4, record=record)
    for _ in range(6):
        model.step(s)
    drafted = [w for batch in record for w in batch.works if w.num_draft]
    assert drafted
    for w in drafted:  # prompt + output: the runner appends the drafts per row itself
        assert len(w.history) == w.start_pos + 1 and w.history[-1] == w.token_ids[0]
