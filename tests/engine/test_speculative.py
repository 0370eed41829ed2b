"""Speculative decoding through the whole engine: the output is the output without it (text,
token ids, finish reasons, usage), the limits land where they would, and every exit frees."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import re
from typing import Any

import pytest
import trio
import trio.testing
from test_request_scope import assert_nothing_held

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.engine import Engine, open_engine
from ft.engine.fake import FakeRunner, text_script
from ft.engine.loading import EngineHooks
from ft.engine.stream import Choice
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine, no_step_costs
from tests.support.gguf_files import write_tiny_gguf

PASSAGE = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
ANSWER = PASSAGE.replace("width", "w") + "done"  # most of it copied from the prompt
SPEC = {"speculative_method": "ngram", "speculative_tokens": 6}
# Real models without the measured cost model: every small step drafts, whatever the timings.
UNGATED = EngineHooks(step_costs=no_step_costs)


async def answer(engine: Engine, params: SamplingParams, prompt: str = PASSAGE) -> list[Any]:
    async with engine.open_request(PromptSpec(text=prompt), params=params) as stream:
        choices = await stream.collect()
    return [(c.text, c.token_ids, c.finish_reason, stream.num_completion_tokens) for c in choices]


async def both(
    params: SamplingParams, script: str = ANSWER, **config: Any
) -> tuple[list[Any], list[Any], Engine]:
    """The answer without speculation, then with it (and the engine that speculated)."""
    async with fake_engine(FakeRunner(text_script(script)), **config) as plain:
        without = await answer(plain, params)
        await assert_nothing_held(plain)
    async with fake_engine(FakeRunner(text_script(script)), **SPEC, **config) as engine:
        with_spec = await answer(engine, params)
        await assert_nothing_held(engine)
    return without, with_spec, engine


async def test_the_answer_is_the_answer_without_speculation(autojump_clock: trio.testing.MockClock) -> None:
    without, with_spec, engine = await both(SamplingParams(max_tokens=200, logprobs=True))
    assert with_spec == without and without[0][0] == ANSWER
    spec = engine.snapshot().speculative
    assert spec.method == "ngram" and spec.accepted_tokens > 20  # the copy was drafted
    assert spec.draft_tokens >= spec.accepted_tokens and spec.mean_accepted_length > 1


@pytest.mark.parametrize("stop", [(), ("print",)], ids=["eos", "stop-string"])
async def test_each_choice_logs_what_speculation_gave_it(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, stop: tuple[str, ...]
) -> None:
    caplog.set_level(logging.DEBUG, logger="ft.scheduler")
    async with fake_engine(FakeRunner(text_script(ANSWER)), **SPEC) as engine:
        await answer(engine, SamplingParams(max_tokens=200, n=2, stop=stop))
        spec = engine.snapshot().speculative
    lines = [r.getMessage() for r in caplog.records if "speculative:" in r.getMessage()]
    assert sorted(line.split(":")[1] for line in lines) == [" choice 0 speculative", " choice 1 speculative"]
    drafted = sum(int(line.split("speculative: ")[1].split()[0]) for line in lines)
    assert drafted == spec.draft_tokens


async def test_speculation_takes_fewer_steps(autojump_clock: trio.testing.MockClock) -> None:
    runner = FakeRunner(text_script(ANSWER), record=True)
    async with fake_engine(runner, **SPEC) as engine:
        await answer(engine, SamplingParams(max_tokens=200))
    plain = FakeRunner(text_script(ANSWER), record=True)
    async with fake_engine(plain) as engine:
        await answer(engine, SamplingParams(max_tokens=200))
    assert len(runner.steps) < len(plain.steps) * 0.7


async def test_a_step_gives_each_choice_one_delta(autojump_clock: trio.testing.MockClock) -> None:
    """The tokens one verification accepts arrive as one delta (one SSE event), not one each."""
    params = SamplingParams(max_tokens=200, logprobs=True, n=2)

    async def deltas(runner: FakeRunner, **config: Any) -> list[Any]:
        async with fake_engine(runner, **config) as engine:
            async with engine.open_request(PromptSpec(text=PASSAGE), params=params) as stream:
                return [d async for d in stream]

    plain = await deltas(FakeRunner(text_script(ANSWER)))
    runner = FakeRunner(text_script(ANSWER), record=True)
    spec = await deltas(runner, **SPEC)
    for index in (0, 1):
        mine, alone = Choice(index), Choice(index)
        for d in (d for d in spec if d.index == index):
            mine.add(d)
        for d in (d for d in plain if d.index == index):
            alone.add(d)
        assert mine == alone and mine.text == ANSWER and len(mine.logprobs) > 20
        # the prompt's step, then one delta a verification; only the last says why it ended
        finishes = [d.finish_reason for d in spec if d.index == index]
        assert len(finishes) == len(runner.steps) < len([d for d in plain if d.index == index])
        assert finishes[:-1] == [None] * (len(finishes) - 1)
    assert max(len(d.token_ids) for d in spec) > 2


@pytest.mark.parametrize("stop", ["* h", "print", "done"])
async def test_a_stop_string_inside_a_draft_ends_the_text_where_it_would(
    autojump_clock: trio.testing.MockClock, stop: str
) -> None:
    without, with_spec, engine = await both(SamplingParams(max_tokens=200, stop=(stop,)))
    assert with_spec == without and without[0][2] == "stop"
    assert stop not in without[0][0] and ANSWER.startswith(without[0][0])
    assert engine.snapshot().speculative.accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 9, 30, 31])
async def test_max_tokens_inside_a_draft_ends_the_output_there(
    autojump_clock: trio.testing.MockClock, max_tokens: int
) -> None:
    without, with_spec, _ = await both(SamplingParams(max_tokens=max_tokens))
    assert with_spec == without
    assert without[0][2] == "length" and len(without[0][1]) == max_tokens


async def test_a_stop_token_inside_a_draft_is_hidden_and_ends_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stop_id = 3 + ord("*")  # the byte tokenizer's id of "*"
    without, with_spec, _ = await both(SamplingParams(max_tokens=200, stop_token_ids=(stop_id,)))
    assert with_spec == without and without[0][2] == "stop"
    assert without[0][0] == ANSWER[: ANSWER.index("*")]


async def test_n_choices_each_speculate_and_match(autojump_clock: trio.testing.MockClock) -> None:
    without, with_spec, engine = await both(SamplingParams(max_tokens=120, n=3))
    assert with_spec == without and len(without) == 3
    assert engine.snapshot().speculative.accepted_tokens > 0


async def test_a_request_can_turn_speculation_off(autojump_clock: trio.testing.MockClock) -> None:
    runner = FakeRunner(text_script(ANSWER), record=True)
    async with fake_engine(runner, **SPEC) as engine:
        await answer(engine, SamplingParams(max_tokens=200, speculative=False))
        assert engine.snapshot().speculative.draft_tokens == 0
    assert all(w.num_draft == 0 for step in runner.steps for w in step)


async def test_speculation_is_off_by_default(autojump_clock: trio.testing.MockClock) -> None:
    runner = FakeRunner(text_script(ANSWER), record=True)
    async with fake_engine(runner) as engine:
        await answer(engine, SamplingParams(max_tokens=200))
        snap = engine.snapshot().speculative
    assert snap.method is None and snap.draft_tokens == 0 and snap.acceptance_rate == 0.0
    assert all(w.num_draft == 0 for step in runner.steps for w in step)


async def test_preemption_with_speculation_changes_no_token(autojump_clock: trio.testing.MockClock) -> None:
    tight = {"page_size": 4, "num_pages": 40, "max_running_requests": 4, "max_prefill_tokens": 16}

    async def run(engine: Engine) -> list[list[Any]]:
        results: dict[int, list[Any]] = {}

        async def one(i: int) -> None:
            results[i] = await answer(engine, SamplingParams(max_tokens=90, ignore_eos=True), PASSAGE[i:])

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        await assert_nothing_held(engine)
        return [results[i] for i in range(3)]

    async with fake_engine(FakeRunner(text_script(ANSWER)), **tight) as plain:
        without = await run(plain)
    async with fake_engine(FakeRunner(text_script(ANSWER)), **tight, **SPEC) as engine:
        assert engine.core is not None
        assert await run(engine) == without
        assert engine.core.num_preemptions > 0 and engine.core.num_accepted_tokens > 0


async def test_cancelling_while_drafts_are_verified_frees_everything(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drafted = trio.Event()

    def before_step(works: list[SeqWork]) -> None:
        if any(w.num_draft for w in works):
            drafted.set()

    runner = FakeRunner(text_script(ANSWER * 20), step_s=0.5)
    async with fake_engine(runner, before_step=before_step, **SPEC) as engine:
        assert engine.core is not None
        async with trio.open_nursery() as nursery:

            async def client(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    await answer(engine, SamplingParams(max_tokens=1000), PASSAGE * 3)

            scope = await nursery.start(client)
            await drafted.wait()
            await trio.sleep(0.25)  # mid-step: the drafts' pages are taken, the step not done
            assert engine.core.pool.num_used > 0
            scope.cancel()
        await trio.sleep(1.0)  # the step in flight returns for a request that left
        await assert_nothing_held(engine)
        assert engine.snapshot().requests.aborted == 1


# --- a real (tiny, random) model on the packed GGUF kernels ----------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", seed=3)


async def test_a_tiny_model_gives_the_same_tokens_and_logprobs_with_speculation(
    tiny_gguf: pathlib.Path,
) -> None:
    """Greedy on the packed kernels: bit for bit the same tokens and logprobs, with drafts
    accepted (a random model falls into loops the n-gram drafts copy)."""
    prompts = ["the the the hello hello the", "Hello there, Hello there, Hello"]

    async def run(**config: Any) -> tuple[list[Any], int]:
        params = SamplingParams(
            max_tokens=48, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True
        )
        cfg = EngineConfig(model=str(tiny_gguf), compute_threads=1, num_pages=64, **config)
        with trio.fail_after(120):
            async with open_engine(cfg, hooks=UNGATED) as engine:
                out = []
                for prompt in prompts:
                    async with engine.open_request(PromptSpec(text=prompt), params=params) as stream:
                        (choice,) = await stream.collect()
                    out.append((choice.token_ids, [(lp.logprob, lp.top) for lp in choice.logprobs]))
                return out, engine.snapshot().speculative.accepted_tokens

    without, _ = await run()
    with_spec, accepted = await run(**SPEC)
    assert with_spec == without
    assert accepted > 0


@pytest.mark.parametrize(
    "knobs",
    [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8, "frequency_penalty": 0.4},
        {"logit_bias": {40: 3.0, 41: -5.0}},
    ],
    ids=["repetition", "presence-frequency", "logit-bias"],
)
async def test_penalties_and_bias_apply_per_drafted_position(
    tiny_gguf: pathlib.Path, knobs: dict[str, Any]
) -> None:
    """Greedy with penalties (counting the drafts before each row) or a bias: the same tokens."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **knobs)

    async def run(**config: Any) -> tuple[list[int], int]:
        cfg = EngineConfig(model=str(tiny_gguf), compute_threads=1, num_pages=64, **config)
        with trio.fail_after(120):
            async with open_engine(cfg, hooks=UNGATED) as engine:
                async with engine.open_request(
                    PromptSpec(text="the the the hello hello the"), params=params
                ) as s:
                    (choice,) = await s.collect()
                return choice.token_ids, engine.snapshot().speculative.draft_tokens

    without, _ = await run()
    with_spec, drafted = await run(**SPEC)
    assert with_spec == without and drafted > 0


async def test_a_seeded_sampled_request_repeats_itself_with_speculation(tiny_gguf: pathlib.Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    cfg = EngineConfig(model=str(tiny_gguf), compute_threads=1, num_pages=64, **SPEC)
    with trio.fail_after(120):
        async with open_engine(cfg, hooks=UNGATED) as engine:
            runs = []
            for _ in range(2):
                async with engine.open_request(
                    PromptSpec(text="the the the hello hello the"), params=params
                ) as s:
                    runs.append((await s.collect())[0].token_ids)
            assert engine.snapshot().speculative.accepted_tokens > 0
    assert runs[0] == runs[1] and len(runs[0]) == 40


@pytest.mark.slow  # the real default model
async def test_the_default_model_edits_the_same_with_speculation() -> None:
    """Edit prompts on the default model: greedy tokens identical, with drafts accepted."""
    from ft.bench import EDIT_PROMPTS

    async def run(**config: Any) -> tuple[list[list[int]], int]:
        params = SamplingParams(max_tokens=96, temperature=0.0)
        with trio.fail_after(300):
            async with open_engine(EngineConfig(compute_threads=1, **config), hooks=UNGATED) as engine:
                out = []
                for prompt in EDIT_PROMPTS[:2]:
                    messages = [{"role": "user", "content": prompt}]
                    async with engine.open_request(PromptSpec(messages=messages), params=params) as stream:
                        (choice,) = await stream.collect()
                    out.append(choice.token_ids)
                await assert_nothing_held(engine)
                return out, engine.snapshot().speculative.accepted_tokens

    without, _ = await run()
    with_spec, accepted = await run(**SPEC)
    assert with_spec == without
    assert accepted > 20


async def test_the_edit_bench_runs_every_prompt_at_each_level(autojump_clock: trio.testing.MockClock) -> None:
    from ft.bench import EDIT_PROMPTS, run_level

    runner = FakeRunner(text_script(ANSWER), record=True)
    async with fake_engine(runner, **SPEC) as engine:
        level = await run_level(engine, 2, 40, prompts="edit")
        await assert_nothing_held(engine)
    assert level["requests"] == len(EDIT_PROMPTS) and level["output_tokens"] == len(EDIT_PROMPTS) * 40
    assert level["decode_tokens_per_s"] is None  # waves of requests: no S_TG to compare
    assert max(sum(w.sample for w in step) for step in runner.steps) <= 2  # two at a time


async def test_the_edit_bench_also_runs_without_speculation(autojump_clock: trio.testing.MockClock) -> None:
    """`ft bench --speculative-method` compares each level against the same requests with the
    per-request switch off, in the same engine: those draft nothing."""
    from ft.bench import run_level

    async with fake_engine(FakeRunner(text_script(ANSWER)), **SPEC) as engine:
        off = await run_level(engine, 1, 40, prompts="edit", speculative=False)
        assert engine.snapshot().speculative.draft_tokens == 0
        on = await run_level(engine, 1, 40, prompts="edit")
        assert engine.snapshot().speculative.accepted_tokens > 0
    assert off["output_tokens"] == on["output_tokens"]


async def test_ft_bench_reports_each_levels_speedup(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    autojump_clock: trio.testing.MockClock,
) -> None:
    from ft import bench

    def engine(config: EngineConfig) -> Any:
        return fake_engine(FakeRunner(text_script(ANSWER)), **SPEC)

    monkeypatch.setattr(bench, "open_engine", engine)
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    argv = "--prompts edit --concurrency 1 2 --max-tokens 40 --speculative-method ngram"
    await bench.main(parser.parse_args(argv.split()))
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [level["concurrency"] for level in out["levels"]] == [1, 2]
    for level in out["levels"]:
        assert level["output_tokens"] == len(bench.EDIT_PROMPTS) * 40
        assert level["without_speculation"] > 0 and level["speculative_speedup"] > 0
    assert out["speculative"]["accepted_tokens"] > 0


async def test_a_grammar_row_beside_drafted_rows_keeps_its_mask(tiny_gguf: pathlib.Path) -> None:
    """A constrained request shares steps with another drafted one: each gives what it gives
    without speculation, the constrained one within its grammar."""
    from ft.grammar import spec

    prompt = "the the the hello hello the"
    pattern = "(hello|the| ){60}"  # it cannot end early: the steps overlap the other request's
    plain = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=100, temperature=0.0, grammar=spec.regex(pattern, "x"))
    shared: list[int] = []

    def note(works: list[SeqWork]) -> None:
        if any(w.num_draft for w in works) and any(w.matcher is not None for w in works):
            shared.append(len(works))

    async def run(**config: Any) -> tuple[list[Any], int]:
        cfg = EngineConfig(model=str(tiny_gguf), compute_threads=1, num_pages=64, **config)
        out: dict[str, Any] = {}
        with trio.fail_after(120):
            async with open_engine(
                cfg, hooks=EngineHooks(before_step=note, step_costs=no_step_costs)
            ) as engine:

                async def free() -> None:
                    async with engine.open_request(PromptSpec(text=prompt), params=plain) as s:
                        (choice,) = await s.collect()
                    out["free"] = choice.token_ids

                async with trio.open_nursery() as nursery:
                    async with engine.open_request(PromptSpec(text=prompt), params=constrained) as s:
                        text, ids = "", []
                        async for delta in s:
                            if not ids:  # generating: start the other one beside it
                                nursery.start_soon(free)
                            text += delta.text
                            ids += delta.token_ids
                    out["constrained"] = (ids, text)
                return [out["free"], out["constrained"]], engine.snapshot().speculative.draft_tokens

    without, _ = await run()
    with_spec, drafted = await run(**SPEC)
    assert with_spec == without and drafted > 0
    assert shared  # steps with both a drafted and a constrained row
    assert re.fullmatch(pattern, with_spec[1][1])


SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"enum": ["the", "hello", "the hello"]},
                             "minItems": 8, "maxItems": 10}},
    "required": ["words"], "additionalProperties": False,
}  # fmt: skip


# A loose grammar the tiny model's own argmax mostly keeps to (the draft model knows no grammar:
# under the schema its unconstrained drafts are refused from the first).
PRINTABLE = "[ -~]{40}"


@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_a_constrained_request_drafts_and_gives_the_same_tokens(
    tiny_gguf: pathlib.Path, method: str
) -> None:
    """Greedy under a grammar: the drafts (n-grams copying the output's repeats under a JSON
    schema, or the model drafting for itself under a loose regex) are checked against each
    position's mask: the tokens are those without speculation, and drafts are accepted."""
    import json

    import jsonschema

    from ft.grammar import spec

    grammar = spec.json_schema(SCHEMA, "x") if method == "ngram" else spec.regex(PRINTABLE, "x")
    params = SamplingParams(max_tokens=160, temperature=0.0, grammar=grammar)
    drafted: list[int] = []

    def note(works: list[SeqWork]) -> None:
        drafted.extend(w.num_draft + w.num_model_draft for w in works if w.matcher is not None)

    async def run(**config: Any) -> tuple[list[int], str, int]:
        cfg = EngineConfig(model=str(tiny_gguf), compute_threads=1, num_pages=64, **config)
        hooks = EngineHooks(before_step=note, step_costs=no_step_costs)
        with trio.fail_after(120):
            async with open_engine(cfg, hooks=hooks) as engine:
                async with engine.open_request(PromptSpec(text="the hello the hello"), params=params) as s:
                    (choice,) = await s.collect()
                await assert_nothing_held(engine)
                return choice.token_ids, choice.text, engine.snapshot().speculative.accepted_tokens

    without, text, _ = await run()
    spec_config: dict[str, Any] = {"speculative_method": method, "speculative_tokens": 4}
    if method == "draft":
        spec_config["speculative_model"] = str(tiny_gguf)
    drafted.clear()
    with_spec, _, accepted = await run(**spec_config)
    assert with_spec == without
    if method == "ngram":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(PRINTABLE, text)
    assert sum(drafted) > 0 and accepted > 0
