"""Draft-model speculative decoding through the whole engine, on tiny random GGUFs and the packed
kernels: greedy tokens and logprobs bit for bit the tokens without it, a model drafting for
itself accepts everything, seeds repeat, every exit frees, and a draft model with another
tokenizer is refused at load."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import trio
from test_request_scope import assert_nothing_held

import tests.support.gguf_files as gguf_files
from ft.config import EngineConfig
from ft.engine.engine import Engine, open_engine
from ft.engine.lifetime import EngineState
from ft.engine.loading import EngineHooks
from ft.model.draft import TokenizerMismatch, check_same_tokenizer
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.engine import no_step_costs
from tests.support.gguf_files import write_tiny_gguf

PROMPTS = ["the the the hello hello the", "Hello there, Hello there, Hello"]
# Without the measured cost model: every small step drafts, whatever the timings here.
UNGATED = EngineHooks(step_costs=no_step_costs)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("draft") / "target.gguf", seed=3)


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Other weights, the same tokenizer: a draft model that is often wrong."""
    return write_tiny_gguf(tmp_path_factory.mktemp("draft") / "other.gguf", seed=5)


def config(model: pathlib.Path, draft: pathlib.Path | None = None, **kw: Any) -> EngineConfig:
    spec: dict[str, Any] = {}
    if draft is not None:
        spec = {"speculative_method": "draft", "speculative_model": str(draft), "speculative_tokens": 5}
    return EngineConfig(model=str(model), compute_threads=1, num_pages=64, **spec, **kw)


async def generate(engine: Engine, params: SamplingParams, prompt: str) -> tuple[list[int], list[Any]]:
    async with engine.open_request(PromptSpec(text=prompt), params=params) as stream:
        (choice,) = await stream.collect()
    return choice.token_ids, [(lp.logprob, lp.top) for lp in choice.logprobs]


async def run(
    cfg: EngineConfig, params: SamplingParams, hooks: EngineHooks = UNGATED
) -> tuple[list[Any], Any]:
    with trio.fail_after(180):
        async with open_engine(cfg, hooks=hooks) as engine:
            out = [await generate(engine, params, prompt) for prompt in PROMPTS]
            await assert_nothing_held(engine)
            return out, engine.snapshot().speculative


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)


async def test_a_model_drafting_for_itself_gives_the_same_tokens_and_accepts_them_all(
    target: pathlib.Path,
) -> None:
    without, _ = await run(config(target), GREEDY)
    with_spec, spec = await run(config(target, draft=target), GREEDY)
    assert with_spec == without
    assert spec.method == "draft" and spec.draft_tokens > 20
    assert spec.accepted_tokens == spec.draft_tokens  # the same numbers, row by row


async def test_another_draft_model_changes_no_token_or_logprob(
    target: pathlib.Path, other: pathlib.Path
) -> None:
    without, _ = await run(config(target), GREEDY)
    with_spec, spec = await run(config(target, draft=other), GREEDY)
    assert with_spec == without
    assert spec.draft_tokens > 0 and spec.accepted_tokens < spec.draft_tokens


async def test_the_measured_cost_model_changes_no_token(target: pathlib.Path, other: pathlib.Path) -> None:
    without, _ = await run(config(target), GREEDY)
    with_spec, _ = await run(config(target, draft=other), GREEDY, hooks=EngineHooks())
    assert with_spec == without


@pytest.mark.parametrize("knobs", [{"repetition_penalty": 1.3}, {"logit_bias": {40: 3.0, 41: -5.0}}])
async def test_penalties_and_bias_with_a_draft_model(target: pathlib.Path, knobs: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, **knobs)
    without, _ = await run(config(target), params)
    with_spec, spec = await run(config(target, draft=target), params)
    assert with_spec == without and spec.accepted_tokens > 0


async def test_a_seeded_sampled_request_repeats_itself_with_a_draft_model(
    target: pathlib.Path, other: pathlib.Path
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    first, spec = await run(config(target, draft=other), params)
    again, _ = await run(config(target, draft=other), params)
    assert first == again and all(len(ids) == 40 for ids, _ in first)
    assert spec.draft_tokens > 0
    _, spec = await run(config(target, draft=target), params)
    assert spec.accepted_tokens > spec.draft_tokens // 2  # q = p: most drafts are kept


async def test_preemption_with_a_draft_model_changes_no_token(
    target: pathlib.Path, other: pathlib.Path
) -> None:
    """Two requests in a pool that holds either alone, not both: the newer is preempted and
    recomputed (its draft KV fed again), and each gives the tokens it gives alone."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def both(cfg: EngineConfig) -> tuple[list[list[int]], int]:
        out: dict[int, list[int]] = {}
        with trio.fail_after(180):
            async with open_engine(cfg, hooks=UNGATED) as engine:

                async def one(i: int) -> None:
                    out[i] = (await generate(engine, params, PROMPTS[i]))[0]

                async with trio.open_nursery() as nursery:
                    for i in range(2):
                        nursery.start_soon(one, i)
                await assert_nothing_held(engine)
                assert engine.core is not None
                return [out[0], out[1]], engine.core.num_preemptions

    plain, _ = await both(config(target))
    tight, preemptions = await both(
        EngineConfig(
            model=str(target),
            compute_threads=1,
            num_pages=14,
            page_size=8,
            speculative_method="draft",
            speculative_model=str(other),
        )  # fmt: skip
    )
    assert tight == plain and preemptions > 0


async def test_a_request_left_mid_stream_frees_its_pages_and_draft_state(target: pathlib.Path) -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with trio.fail_after(180):
        async with open_engine(config(target, draft=target), hooks=UNGATED) as engine:
            for leave_after in (1, 5):
                async with engine.open_request(PromptSpec(text=PROMPTS[1]), params=params) as stream:
                    seen = 0
                    async for delta in stream:
                        seen += len(delta.token_ids)
                        if seen >= leave_after:
                            break
            await assert_nothing_held(engine)
            assert engine.snapshot().speculative.draft_tokens > 0


async def test_a_draft_model_with_another_tokenizer_is_refused_at_load(
    tmp_path: pathlib.Path, target: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = gguf_files.tiny_tokens

    def renamed() -> tuple[list[str], list[str], list[int]]:
        tokens, merges, types = real()
        return [*tokens[:-1], "Hellx"], merges[:-1], types

    monkeypatch.setattr(gguf_files, "tiny_tokens", renamed)
    stranger = write_tiny_gguf(tmp_path / "stranger.gguf", seed=3)
    with trio.fail_after(120):
        async with open_engine(config(target, draft=stranger), hooks=UNGATED, wait_ready=False) as engine:
            with pytest.raises(RuntimeError, match="draft model's tokenizer is not the target's: token 265"):
                await engine.wait_ready()
            assert engine.state == EngineState.ERROR


def test_the_tokenizer_check_names_the_first_difference(target: pathlib.Path) -> None:
    from dataclasses import replace

    from ft.model.loader import load_model

    spec = load_model(target, __import__("torch").float32).tokenizer
    check_same_tokenizer(spec, spec, 100, 100)
    with pytest.raises(TokenizerMismatch, match="vocabulary rows"):
        check_same_tokenizer(spec, spec, 100, 101)
    with pytest.raises(TokenizerMismatch, match="eos_token_ids"):
        check_same_tokenizer(spec, replace(spec, eos_token_ids=(7,)), 100, 100)
    with pytest.raises(TokenizerMismatch, match="bos_token"):
        check_same_tokenizer(spec, replace(spec, bos_token="<x>"), 100, 100)


@pytest.mark.slow  # the real default model, twice over
async def test_the_default_model_drafting_for_itself_edits_the_same() -> None:
    from ft.bench import EDIT_PROMPTS
    from ft.model.pull import default_model_path

    params = SamplingParams(max_tokens=64, temperature=0.0)

    async def edits(**kw: Any) -> tuple[list[list[int]], Any]:
        with trio.fail_after(600):
            async with open_engine(EngineConfig(compute_threads=1, **kw), hooks=UNGATED) as engine:
                out = []
                for prompt in EDIT_PROMPTS[:2]:
                    messages = [{"role": "user", "content": prompt}]
                    async with engine.open_request(PromptSpec(messages=messages), params=params) as stream:
                        (choice,) = await stream.collect()
                    out.append(choice.token_ids)
                await assert_nothing_held(engine)
                return out, engine.snapshot().speculative

    without, _ = await edits()
    with_spec, spec = await edits(speculative_method="draft", speculative_model=str(default_model_path()))
    assert with_spec == without
    assert spec.draft_tokens > 20 and spec.acceptance_rate >= 0.95


async def test_a_prefix_cache_hit_skips_feeding_the_draft_model_the_cached_pages(
    target: pathlib.Path, other: pathlib.Path
) -> None:
    """The same long prompt twice: the second request's draft model is fed only what follows
    the cached pages (they hold the draft's KV from the first), and the tokens are unchanged."""
    prompt = " ".join(["the hello there"] * 30)  # long: many full pages
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fed: list[tuple[int, int]] = []  # (draft_pos, tokens) of each draft feed

    def note(works: list[Any]) -> None:
        fed.extend((w.draft_pos, len(w.draft_feed)) for w in works if w.draft_feed)

    async def twice(cfg: EngineConfig) -> tuple[list[list[int]], list[list[tuple[int, int]]], int]:
        out, feeds = [], []
        with trio.fail_after(180):
            async with open_engine(
                cfg, hooks=EngineHooks(before_step=note, step_costs=no_step_costs)
            ) as engine:
                for _ in range(2):
                    fed.clear()
                    out.append((await generate(engine, params, prompt))[0])
                    feeds.append(list(fed))
                await assert_nothing_held(engine)
                return out, feeds, engine.snapshot().scheduler.prefix_hit_tokens

    [plain, _], _, _ = await twice(config(target))
    tokens, feeds, hits = await twice(config(target, draft=other))
    assert tokens == [plain, plain]
    assert hits > 0
    assert min(pos for pos, _ in feeds[0]) == 0
    assert min(pos for pos, _ in feeds[1]) == hits  # starts after the cached pages
    assert sum(n for _, n in feeds[1]) < sum(n for _, n in feeds[0]) - hits // 2
