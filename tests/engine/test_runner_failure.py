"""A runner that can run no more steps (a rank died or hangs) fails every request and frees all."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ft.core.batch import RunnerFailure, SeqWork
from ft.engine.engine import EngineState
from ft.engine.fake import FakeRunner, text_script
from ft.errors import EngineStopping, InvalidRequest, RequestFailed
from ft.grammar import spec
from ft.model.masks import GrammarError
from ft.params import SamplingParams
from tests.engine.test_request_scope import assert_nothing_held
from tests.support.engine import fake_engine


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
                    prompt=f"p{i}", params=SamplingParams(max_tokens=500)
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
            async with engine.open_request(prompt="late", params=SamplingParams(max_tokens=5)):
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
        async with engine.open_request(prompt="a", params=SamplingParams(max_tokens=2)) as stream:
            await stream.collect()
        with pytest.raises(RequestFailed):
            async with engine.open_request(prompt="b", params=SamplingParams(max_tokens=2, seed=13)) as s:
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
                async with engine.open_request(prompt="p", params=SamplingParams(max_tokens=500)) as s:
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
