"""A runner that can run no more steps (a rank died or hangs) fails every request and frees all;
the watchdog notices a step that never returns, a scheduler that stops, a model that died."""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from ft.actors.runner import RunnerActor
from ft.config import EngineConfig
from ft.core.batch import RowsFailed, RunnerFailure, Sampled, SeqWork
from ft.engine.engine import Engine, EngineState
from ft.engine.fake import FakeRunner, text_script
from ft.engine.loading import ModelParts
from ft.engine.watchdog import Watchdog
from ft.errors import EngineStopping, InvalidRequest, RequestFailed
from ft.grammar import spec
from ft.messages import Batch, SchedulerIn, StepDone
from ft.model.masks import GrammarError
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.engine.test_request_scope import assert_nothing_held
from tests.support.engine import fake_engine, fake_parts
from tests.support.watchdog import Pending, Steps


async def test_a_runner_failure_fails_every_request_and_frees_their_pages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Running, queued and mid-stream requests all end with a server error; nothing is held."""
    dead = False
    steps: list[int] = []

    def before_step(works: list[SeqWork]) -> None:
        steps.append(len(works))
        if dead:
            raise RunnerFailure("rank 1 left the group")

    runner = FakeRunner(text_script("lorem ipsum " * 50), step_s=0.01)
    async with fake_engine(runner, before_step=before_step, max_running_requests=2) as engine:
        errors: list[BaseException] = []
        got_tokens = trio.Event()

        async def one(i: int) -> None:
            try:
                async with engine.open_request(
                    PromptSpec(text=f"p{i}"), params=SamplingParams(max_tokens=500)
                ) as stream:
                    async for _ in stream:
                        got_tokens.set()
            except RequestFailed as e:
                errors.append(e)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(4):  # 2 running, 2 queued
                    nursery.start_soon(one, i)
                await got_tokens.wait()
                dead = True
                reason = await engine.wait_failed()
        assert len(errors) == 4 and all(e.status == 500 for e in errors)  # type: ignore[attr-defined]
        assert "rank 1 left the group" in reason and engine.state == EngineState.ERROR
        assert engine.error == reason
        await assert_nothing_held(engine)
        steps_then = len(steps)
        with pytest.raises(EngineStopping):  # nothing new is admitted
            async with engine.open_request(PromptSpec(text="late"), params=SamplingParams(max_tokens=5)):
                pass
        await trio.sleep(1)
        assert len(steps) == steps_then  # and no step ran again


async def test_an_ordinary_step_error_still_fails_only_its_sequence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Not every exception is fatal: a plain error is isolated to the sequence that raised it."""

    def before_step(works: list[SeqWork]) -> None:
        if any(w.params.seed == 13 for w in works):
            raise ValueError("bad row")

    async with fake_engine(FakeRunner(text_script("ok")), before_step=before_step) as engine:
        async with engine.open_request(PromptSpec(text="a"), params=SamplingParams(max_tokens=2)) as stream:
            await stream.collect()
        with pytest.raises(RequestFailed):
            async with engine.open_request(
                PromptSpec(text="b"), params=SamplingParams(max_tokens=2, seed=13)
            ) as s:
                await s.collect()
        assert engine.state == EngineState.READY and not engine.has_failed
        await assert_nothing_held(engine)


async def test_a_grammar_failing_mid_generation_is_the_requests_fault(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A grammar that exceeds its limits mid-generation fails only its own request, as an
    invalid request (400), not a server error (500); the engine carries on."""

    def before_step(works: list[SeqWork]) -> None:
        if any(w.matcher is not None for w in works):
            raise GrammarError("seq 0: structured output failed: lexer fuel exhausted")

    async with fake_engine(FakeRunner(text_script("abc")), before_step=before_step) as engine:
        constrained = SamplingParams(max_tokens=5, grammar=spec.regex("[a-z]+", "guided_regex"))
        with pytest.raises(InvalidRequest, match="structured output failed") as err:
            await engine.generate("p", constrained)
        assert err.value.status == 400
        assert await engine.generate("q", SamplingParams(max_tokens=3)) == "abc"
        await assert_nothing_held(engine)


@pytest.mark.parametrize("drain_first", [True, False])
async def test_a_failed_engine_stays_in_error_through_a_drain(
    autojump_clock: trio.testing.MockClock, drain_first: bool
) -> None:
    """A drain (begun before or after the runner failed) never hides the failure: the state
    stays "error", so /health keeps saying why the server cannot serve."""
    dead = False

    def before_step(works: list[SeqWork]) -> None:
        if dead:
            raise RunnerFailure("rank 1 left the group")

    runner = FakeRunner(text_script("lorem ipsum " * 50), step_s=0.01)
    async with fake_engine(runner, before_step=before_step) as engine:
        got_tokens = trio.Event()

        async def one() -> None:
            with pytest.raises(RequestFailed):
                async with engine.open_request(
                    PromptSpec(text="p"), params=SamplingParams(max_tokens=500)
                ) as s:
                    async for _ in s:
                        got_tokens.set()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                await got_tokens.wait()
                if drain_first:
                    engine.begin_stop(drain_timeout_s=20)
                dead = True
                await engine.wait_failed()
                if not drain_first:
                    engine.begin_stop(drain_timeout_s=20)
            await engine.wait_stopped()
        assert engine.state == EngineState.ERROR and engine.has_failed


async def _stream_until_failed(
    engine: Engine, num_requests: int, on_tokens: trio.Event
) -> list[RequestFailed]:
    """Open `num_requests` long requests; set `on_tokens` once tokens flow; return the errors
    they all ended with (each must end with one)."""
    errors: list[RequestFailed] = []

    async def one(i: int) -> None:
        with pytest.raises(RequestFailed) as err:
            async with engine.open_request(
                PromptSpec(text=f"p{i}"), params=SamplingParams(max_tokens=500)
            ) as stream:
                async for _ in stream:
                    on_tokens.set()
        errors.append(err.value)

    async with trio.open_nursery() as nursery:
        for i in range(num_requests):
            nursery.start_soon(one, i)
    return errors


async def test_a_step_that_never_returns_fails_every_request_after_the_step_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One process, no ranks: a step that hangs turns the engine to error within the step
    timeout (plus one check period), fails running and queued requests with a server error,
    frees what they held, and gives the step up so no other runs."""
    runner = FakeRunner(text_script("lorem ipsum " * 50), step_s=0.01, record=True)
    async with fake_engine(runner, max_running_requests=2, step_timeout_s=5) as engine:
        got_tokens = trio.Event()
        failed_at: list[float] = []

        async def hang_then_wait() -> None:
            await got_tokens.wait()
            runner.hangs = True
            hung_at = trio.current_time()
            await engine.wait_failed()
            failed_at.append(trio.current_time() - hung_at)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hang_then_wait)
                errors = await _stream_until_failed(engine, 4, got_tokens)  # 2 running, 2 queued
        assert len(errors) == 4 and all(e.status == 500 for e in errors)
        assert 4.9 <= failed_at[0] <= 5.6  # the step in flight began up to step_s before
        assert engine.state == EngineState.ERROR and engine.error is not None
        assert "no step completed for 5 s" in engine.error and "a step has run for" in engine.error
        assert all(engine.error in e.message for e in errors)
        await assert_nothing_held(engine)
        runner.hangs = False
        num_steps = len(runner.steps)
        assert num_steps > 0
        await trio.sleep(10)
        assert len(runner.steps) == num_steps  # halted: no step runs again


async def test_slow_steps_that_each_complete_are_not_a_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The timeout bounds one step, not a request: steps of 0.9 x the timeout (a slow model, a
    grammar's masks within their budget) make progress, for 20 x the timeout in all."""
    runner = FakeRunner(text_script("slow but steady"), step_s=4.5)
    async with fake_engine(runner, step_timeout_s=5) as engine:
        with trio.fail_after(200):
            text = await engine.generate("p", SamplingParams(max_tokens=20))
        assert text == "slow but steady"
        assert engine.state == EngineState.READY and not engine.has_failed


async def test_a_scheduler_that_stops_scheduling_while_work_waits_is_a_stall(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No step in flight, but requests wait: after the step timeout the watchdog fails them."""
    runner = FakeRunner(text_script("lorem ipsum " * 50), step_s=0.01)
    async with fake_engine(runner, step_timeout_s=3) as engine:
        got_tokens = trio.Event()

        async def stop_scheduling() -> None:
            await got_tokens.wait()
            assert engine.core is not None
            monkeypatch.setattr(engine.core, "schedule", lambda: None)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_scheduling)
                errors = await _stream_until_failed(engine, 2, got_tokens)
        assert len(errors) == 2 and all(e.status == 500 for e in errors)
        assert engine.error is not None and "none was scheduled" in engine.error
        await assert_nothing_held(engine)


async def test_a_model_that_dies_while_idle_fails_the_engine_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A rank process that exits while no request runs is noticed within the watchdog's
    period, not at the next request: the engine is in error before anyone asks."""
    dead: list[str] = []
    load = fake_parts(FakeRunner())

    def load_with_ranks(config: EngineConfig) -> ModelParts:
        return dataclasses.replace(load(config), failure=lambda: dead[0] if dead else None)

    async with fake_engine(load_model=load_with_ranks, step_timeout_s=5) as engine:
        assert await engine.generate("p", SamplingParams(max_tokens=3)) == "Hel"
        await trio.sleep(30)
        assert engine.state == EngineState.READY  # idle for 6 x the timeout: no stall
        dead.append("tensor-parallel rank 1 (pid 4242) died: killed by SIGKILL")
        died_at = trio.current_time()
        with trio.fail_after(60):
            reason = await engine.wait_failed()
        assert trio.current_time() - died_at <= 0.6
        assert reason == dead[0] and engine.state == EngineState.ERROR
        with pytest.raises(EngineStopping, match="rank 1"):
            await engine.generate("late", SamplingParams(max_tokens=3))


async def test_a_step_that_ended_while_the_loop_was_blocked_is_no_stall() -> None:
    """A step whose thread returned while the event loop was blocked past the step timeout is
    not yet counted when the watchdog wakes (the runner's task has not run): the watchdog waits
    one period before it judges, and a step that really hangs is still a stall."""
    stalls: list[str] = []
    runner, core = Steps(), Pending()
    watchdog = Watchdog(runner, core, step_timeout_s=10, on_stall=stalls.append)
    t0 = trio.current_time()
    runner.step_started_at = t0
    assert watchdog.check(t0 + 0.5) is None
    # The loop is blocked for 30 s; the step ended at once, but nothing has recorded it yet.
    assert watchdog.check(t0 + 30.5) is None  # before: "a step has run for 30.5 s"
    runner.num_steps, runner.step_started_at = 1, t0 + 30.6  # recorded; the next step starts
    now = t0 + 31.0
    assert watchdog.check(now) is None
    while (reason := watchdog.check(now)) is None and now < t0 + 60:  # that one hangs
        now += watchdog.period_s
    assert reason is not None and "a step has run for" in reason
    assert 10 <= now - (t0 + 30.6) <= 11


class PartlyFailingRunner:
    """A runner whose steps sample every row but fail the grammar of seq 0 (`RowsFailed`)."""

    page_size, num_pages, vocab_size = 16, 8, 259

    def __init__(self) -> None:
        self.num_steps = 0

    def step(self, works: list[SeqWork]) -> list[Sampled]:
        self.num_steps += 1
        raise RowsFailed(
            [Sampled(w.seq_id, 7) for w in works if w.seq_id != 0], [(0, "seq 0: one token took 30 ms")]
        )


async def test_a_row_whose_grammar_fails_is_a_400_and_its_step_is_not_rerun() -> None:
    """`RowsFailed` fails only its rows, as invalid requests, and keeps the step's other
    samples: the batch is not rerun row by row (which would pay the grammar again)."""
    runner = PartlyFailingRunner()
    batches, inbox = trio.open_memory_channel[Batch](1)
    out, done = trio.open_memory_channel[SchedulerIn](1)
    works = tuple(SeqWork(i, (1,), 0, (i,), True, SamplingParams(), 0) for i in range(3))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(RunnerActor(inbox, out, runner).run)
        await batches.send(Batch(1, works))
        with trio.fail_after(30):
            step = await done.receive()
        batches.close()
    assert isinstance(step, StepDone) and runner.num_steps == 1
    assert [s.seq_id for s in step.sampled] == [1, 2]
    [(seq_id, error)] = step.failed
    assert seq_id == 0 and isinstance(error, InvalidRequest) and error.status == 400
