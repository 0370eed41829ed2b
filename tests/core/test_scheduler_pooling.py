"""The scheduler core with pooling requests: prompt only, chunked sums, the prefix cache,
preemption, and pages registered like any prompt's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.batch import EmbeddingOut, PoolSum, Sampled, Scored, SeqFailed, SeqWork, StepDone, TokenOut
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.engine.fake import FakeRunner, fake_hidden
from ft.errors import ContextLengthExceeded, InvalidRequest
from ft.params import SamplingParams

Out = TokenOut | EmbeddingOut | SeqFailed
POOLINGS_AND_GENERATION = ("mean", "cls", "last", "rank", "gen")
PROMPT = [(7 * i + 3) % 90 + 3 for i in range(37)]  # 37 tokens: 9 full pages of 4 and one more


def make(num_pages: int = 64, page_size: int = 4, **kw: int) -> Scheduler:
    opts = {"max_running": 4, "max_model_len": 128, "max_prefill_tokens": 16} | kw
    return Scheduler(PagePool(num_pages, page_size), eos_token_ids=[0], **opts)


def step(s: Scheduler) -> list[Out]:
    """One step, computed by the fake runner (its hidden states are `fake_hidden`)."""
    batch = s.schedule()
    assert batch is not None
    results = FakeRunner().step(list(batch.works))
    done = StepDone(
        batch.step,
        sampled=tuple(x for x in results if isinstance(x, Sampled)),
        scored=tuple(x for x in results if isinstance(x, Scored)),
        pooled=tuple(x for x in results if isinstance(x, PoolSum)),
    )
    return s.on_step_done(batch, done)


def run(s: Scheduler) -> list[Out]:
    outs: list[Out] = []
    while s.has_work:
        outs += step(s)
    return outs


def expected(prompt: list[int], pooling: str) -> tuple[float, ...]:
    rows = [fake_hidden(t, p) for p, t in enumerate(prompt)]
    if pooling == "cls":
        return rows[0]
    if pooling in ("last", "rank"):  # (rank: the runner's head reads the last row; the fake has none)
        return rows[-1]
    return tuple(sum(col) / len(rows) for col in zip(*rows, strict=True))


def embedding(outs: list[Out], uid: int = 1) -> EmbeddingOut:
    (out,) = [o for o in outs if isinstance(o, EmbeddingOut) and o.uid == uid]
    return out


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "rank"])
def test_a_chunked_prompt_pools_every_position_once(pooling: str) -> None:
    """A 37-token prompt in 16-token chunks pools what the whole prompt would, samples nothing
    and frees its pages."""
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling=pooling))
    outs = run(s)
    assert [type(o) for o in outs] == [EmbeddingOut]
    assert embedding(outs).vector == pytest.approx(expected(PROMPT, pooling), abs=1e-12)
    assert s.pool.num_used == 0  # released (its full pages stay cached)


def test_pooling_works_never_sample_and_feed_only_the_prompt() -> None:
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling="mean"))
    fed = 0
    while s.has_work:
        batch = s.schedule()
        assert batch is not None
        assert not any(w.sample for w in batch.works)
        fed += sum(len(w.token_ids) for w in batch.works)
        s.on_step_done(batch, StepDone(batch.step, (), pooled=tuple(
            x for x in FakeRunner().step(list(batch.works)) if isinstance(x, PoolSum))))  # fmt: skip
    assert fed == len(PROMPT)


def test_a_one_token_prompt_pools_its_token() -> None:
    s = make()
    s.add(1, [42], SamplingParams(pooling="mean"))
    assert embedding(run(s)).vector == fake_hidden(42, 0)


def test_mean_pooling_never_starts_from_cached_pages() -> None:
    """A cached prefix holds KV but no hidden states: mean pooling recomputes it (no hits)."""
    s = make()
    s.add(1, PROMPT, SamplingParams(max_tokens=1))
    run(s)  # a generation request caches the prompt's full pages
    s.add(2, PROMPT, SamplingParams(pooling="mean"))
    out = embedding(run(s), uid=2)
    assert out.num_cached_tokens == 0
    assert out.vector == pytest.approx(expected(PROMPT, "mean"), abs=1e-12)


def test_cls_pooling_never_starts_from_cached_pages() -> None:
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling="last"))
    run(s)
    s.add(2, PROMPT, SamplingParams(pooling="cls"))
    out = embedding(run(s), uid=2)
    assert out.num_cached_tokens == 0 and out.vector == expected(PROMPT, "cls")


def test_last_pooling_reuses_the_cache_and_computes_the_last_token() -> None:
    """Last-token pooling starts from the cached pages before the last token."""
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling="mean"))
    run(s)  # a pooling request registers its full pages like any prompt
    s.add(2, PROMPT, SamplingParams(pooling="last"))
    out = embedding(run(s), uid=2)
    assert out.num_cached_tokens == 36
    assert out.vector == expected(PROMPT, "last")


def pool_rows(s: Scheduler) -> list[tuple[int, int]]:
    """Run `s` to the end; the (position, rows) each pooling work pooled."""
    rows = []
    while s.has_work:
        batch = s.schedule()
        assert batch is not None
        rows += [(w.start_pos + w.pool_offset, w.num_pool_rows) for w in batch.works if w.num_pool_rows]
        results = FakeRunner().step(list(batch.works))
        s.on_step_done(
            batch, StepDone(batch.step, (), pooled=tuple(x for x in results if isinstance(x, PoolSum)))
        )
    return rows


def test_rank_pooling_reads_the_last_row_and_reuses_the_cache() -> None:
    """A reranker's pair: only its last position is pooled (the one row the head reads), so the
    cached pages before it are reused (a rerank template's shared prefix)."""
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling="rank"))
    assert pool_rows(s) == [(len(PROMPT) - 1, 1)]
    s.add(2, PROMPT, SamplingParams(pooling="rank"))
    outs = step(s)  # one step: all but the last token from the cache
    assert embedding(outs, uid=2).num_cached_tokens == 36
    assert embedding(outs, uid=2).vector == expected(PROMPT, "rank")


def test_a_preempted_rank_request_pools_its_last_row_once() -> None:
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling="rank"))
    assert step(s) == []  # the first 16 tokens, nothing pooled yet
    s.preempt(1)
    outs = run(s)
    assert embedding(outs).vector == expected(PROMPT, "rank") and s.num_preemptions == 1


def test_a_pooling_request_preempted_mid_prompt_pools_each_position_once() -> None:
    """Preempted after its first chunk and recomputed, mean pooling neither loses nor
    double-counts a position (its full pages came back from the cache)."""
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling="mean"))
    assert step(s) == []  # the first 16 tokens summed
    s.preempt(1)
    outs = run(s)
    assert embedding(outs).vector == pytest.approx(expected(PROMPT, "mean"), abs=1e-12)
    assert s.num_preemptions == 1


@pytest.mark.parametrize(("budget", "caching"), [(18, True), (16, False), (23, False)])
def test_a_recompute_never_sums_a_position_twice(budget: int, caching: bool) -> None:
    """Preempted after a chunk that ends mid-page (or with no prefix cache at all), the
    recompute starts before what was summed: those positions are fed again but not pooled."""
    s = make(max_prefill_tokens=budget, enable_prefix_caching=caching)
    s.add(1, PROMPT, SamplingParams(pooling="mean"))
    step(s)
    s.preempt(1)
    assert embedding(run(s)).vector == pytest.approx(expected(PROMPT, "mean"), abs=1e-12)


def test_an_aborted_pooling_request_frees_its_pages() -> None:
    s = make()
    s.add(1, PROMPT, SamplingParams(pooling="mean"))
    step(s)
    assert s.pool.num_used > 0
    assert s.abort(1) == 1
    assert s.pool.num_used == 0 and not s.has_work


def test_pooling_and_generation_share_a_step() -> None:
    s = make()
    s.add(1, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    s.add(2, PROMPT, SamplingParams(pooling="mean"))
    outs = run(s)
    assert len([o for o in outs if isinstance(o, TokenOut)]) == 3
    assert embedding(outs, uid=2).vector == pytest.approx(expected(PROMPT, "mean"), abs=1e-12)


def test_a_pooling_input_may_fill_the_context_but_not_pass_it() -> None:
    """Nothing is generated after an input, so it may use the whole context."""
    s = make()
    s.add(1, [3] * 128, SamplingParams(pooling="last"))
    with pytest.raises(ContextLengthExceeded, match="128 tokens") as e:
        s.add(2, [3] * 129, SamplingParams(pooling="last"))
    assert e.value.param == "input"


def test_a_pooling_input_larger_than_the_pool_is_refused() -> None:
    with pytest.raises(ContextLengthExceeded, match="KV pool"):
        make(num_pages=4).add(1, [3] * 17, SamplingParams(pooling="last"))


@pytest.mark.parametrize(
    "fields",
    [{"pooling": "max"}, {"pooling": "mean", "n": 2}, {"pooling": "mean", "logprobs": True},
     {"pooling": "last", "prompt_logprobs": 0}],
)  # fmt: skip
def test_pooling_params_refuse_sampling_options(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        SamplingParams(**fields)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(3, 40), min_size=1, max_size=40), min_size=1, max_size=5),
    poolings=st.lists(st.sampled_from(POOLINGS_AND_GENERATION), min_size=5, max_size=5),
    budget=st.integers(16, 48),
    num_pages=st.integers(12, 40),
    events=st.lists(st.sampled_from(["step", "step", "step", "preempt", "warm"]), max_size=40),
)
def test_any_mix_of_chunks_preemptions_and_cache_hits_pools_exactly(
    prompts: list[list[int]], poolings: list[str], budget: int, num_pages: int, events: list[str]
) -> None:
    """Whatever the chunking, the pool's size (and the preemptions it forces), explicit
    preemptions and prefixes cached by earlier requests: each pooled vector is the prompt's,
    each request ends once, and every page is released at the end."""
    s = make(num_pages=num_pages, max_prefill_tokens=budget, max_running=3)
    kinds = dict(enumerate(poolings[: len(prompts)], start=1))
    for uid, prompt in enumerate(prompts, start=1):
        kind = kinds[uid]
        s.add(
            uid,
            prompt,
            SamplingParams(max_tokens=3, ignore_eos=True) if kind == "gen" else SamplingParams(pooling=kind),
        )
    outs: list[Out] = []
    warm_uid = 100
    for event in [*events, *["step"] * 400]:
        if not s.has_work:
            break
        if event == "preempt" and s.running:
            s.preempt(next(reversed(s.running.values())).uid)
        elif event == "warm":  # another request caches a prompt's prefix meanwhile
            s.add(warm_uid, prompts[warm_uid % len(prompts)], SamplingParams(max_tokens=1))
            warm_uid += 1
        else:
            outs += step(s)
    assert not s.has_work
    for uid, prompt in enumerate(prompts, start=1):
        if kinds[uid] == "gen":
            assert len([o for o in outs if isinstance(o, TokenOut) and o.uid == uid]) == 3
        else:
            assert embedding(outs, uid).vector == pytest.approx(expected(prompt, kinds[uid]), abs=1e-9)
    assert not any(isinstance(o, SeqFailed) for o in outs)
    assert s.pool.num_used == 0


def prefix_hidden(prefix: tuple[int, ...]) -> tuple[float, ...]:
    """A hidden state that depends on the whole prefix (as a causal model's does)."""
    h = hash(prefix)
    return tuple(float((h >> (8 * j)) % 17 - 8) for j in range(4))


class KVContentRunner:
    """A runner whose KV slots hold the prefix each position saw: a work reads its context from
    its pages (asserting each slot holds this sequence's prefix), so a page registered or reused
    with the wrong content, or a cached page standing in for an uncomputed one, changes the
    pooled vectors and the sampled tokens."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def step(self, works: list[SeqWork]) -> list[Sampled | PoolSum]:
        out: list[Sampled | PoolSum] = []
        size = self.s.pool.page_size
        for w in works:
            seq = self.s.running[w.seq_id]
            tokens = seq.prompt_ids + seq.output_ids
            context: tuple[int, ...] = ()
            for p in range(w.start_pos):
                context = self.kv[(w.page_ids[p // size], p % size)]
                assert context == tuple(tokens[: p + 1]), f"slot of position {p} holds another prefix"
            rows = []
            for p in range(w.start_pos, w.start_pos + len(w.token_ids)):
                context = (*context, w.token_ids[p - w.start_pos])
                self.kv[(w.page_ids[p // size], p % size)] = context
                rows.append(prefix_hidden(context))
            if w.sample:
                out.append(Sampled(w.seq_id, 3 + hash(context) % 50, None, ()))
            if w.num_pool_rows:
                pooled = rows[w.pool_offset : w.pool_offset + w.num_pool_rows]
                out.append(PoolSum(w.seq_id, tuple(float(sum(c)) for c in zip(*pooled, strict=True))))
        return out


def generated_alone(prompt: list[int], n: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        out.append(3 + hash(tuple(tokens)) % 50)
        tokens.append(out[-1])
    return out


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(3, 6), min_size=1, max_size=15), min_size=1, max_size=5),
    kinds=st.lists(st.sampled_from(POOLINGS_AND_GENERATION), min_size=5, max_size=5),
    page_size=st.sampled_from([1, 2, 4, 5]),
    budget=st.integers(1, 24),
    pool_tokens=st.integers(36, 80),
    caching=st.booleans(),
    events=st.lists(st.sampled_from(["step", "step", "step", "preempt", "abort"]), max_size=40),
)
def test_pooling_reads_and_registers_only_pages_of_its_own_content(
    prompts: list[list[int]],
    kinds: list[str],
    page_size: int,
    budget: int,
    pool_tokens: int,
    caching: bool,
    events: list[str],
) -> None:
    """Prompts sharing prefixes, pooling and generation mixed, chunks, preemptions, aborts:
    every context read from the KV pages is the sequence's own, each pooled vector is the
    prompt's, each generation's tokens are what it samples alone, and the pool ends whole."""
    prompts = [p if i % 2 else [*prompts[0], *p] for i, p in enumerate(prompts)]
    num_pages = pool_tokens // page_size + 1
    s = make(num_pages=num_pages, page_size=page_size, max_prefill_tokens=budget, max_running=3,
             max_model_len=64, enable_prefix_caching=caching)  # fmt: skip
    runner = KVContentRunner(s)
    for uid, (prompt, kind) in enumerate(zip(prompts, kinds, strict=False), start=1):
        params = (
            SamplingParams(max_tokens=4, ignore_eos=True) if kind == "gen" else SamplingParams(pooling=kind)
        )
        s.add(uid, prompt, params)
    outs: list[Out] = []
    aborted: set[int] = set()
    for event in [*events, *["step"] * 600]:
        if not s.has_work:
            break
        if event == "preempt" and s.running:
            s.preempt(next(reversed(s.running.values())).uid)
        elif event == "abort" and s.running:
            uid = next(iter(s.running.values())).uid
            aborted.add(uid)
            s.abort(uid)
        elif (batch := s.schedule()) is not None:
            results = runner.step(list(batch.works))
            done = StepDone(
                batch.step,
                sampled=tuple(x for x in results if isinstance(x, Sampled)),
                pooled=tuple(x for x in results if isinstance(x, PoolSum)),
            )
            outs += s.on_step_done(batch, done)
    assert not s.has_work and s.pool.num_used == 0 and s.pool.num_allocatable == num_pages
    for uid, (prompt, kind) in enumerate(zip(prompts, kinds, strict=False), start=1):
        if uid in aborted:
            continue
        if kind == "gen":
            assert [o.token_id for o in outs if isinstance(o, TokenOut) and o.uid == uid] == generated_alone(
                prompt, 4
            )
            continue
        rows = [prefix_hidden(tuple(prompt[: p + 1])) for p in range(len(prompt))]
        want = {"cls": rows[0], "last": rows[-1], "rank": rows[-1]}.get(kind) or tuple(
            sum(col) / len(rows) for col in zip(*rows, strict=True)
        )
        assert embedding(outs, uid).vector == pytest.approx(want, abs=1e-9)
