"""The watchdog tells a slow step from a hung one by the runner's heartbeat: a step that runs
past the step timeout while its forward beats is left to finish; one whose beats stop is a stall."""

from __future__ import annotations

import trio
import trio.testing

from ft.engine.engine import EngineState
from ft.engine.fake import FakeRunner, text_script
from ft.engine.watchdog import Watchdog
from ft.params import SamplingParams
from tests.support.engine import fake_engine
from tests.support.watchdog import Pending, Steps


async def test_a_step_past_the_timeout_is_no_stall_while_its_heartbeat_moves() -> None:
    """A step that beats every 2 s runs for 10 x the 10 s timeout unjudged; once its beats
    stop, it is a stall one timeout later (within a check period)."""
    runner, core = Steps(), Pending()
    watchdog = Watchdog(runner, core, step_timeout_s=10, on_stall=lambda _: None)
    t0 = trio.current_time()
    runner.step_started_at, now = t0, t0
    while now < t0 + 100:
        now += watchdog.period_s
        if round((now - t0) / watchdog.period_s) % 4 == 0:
            runner.progress += 1
        assert watchdog.check(now) is None, now - t0  # before: "a step has run for 10.0 s" at 10 s
    beat_at = now
    while (reason := watchdog.check(now)) is None and now < beat_at + 60:  # its beats stop
        now += watchdog.period_s
    assert reason is not None and "without progress" in reason and "a step has run for" in reason
    assert 10 <= now - beat_at <= 10 + watchdog.period_s


async def test_a_step_that_never_beats_is_a_stall_after_the_timeout() -> None:
    """Without beats (a runner with no heartbeat, or a forward hung in its first layer) the
    timeout counts from the step's start, as before."""
    runner, core = Steps(), Pending()
    watchdog = Watchdog(runner, core, step_timeout_s=10, on_stall=lambda _: None)
    t0 = trio.current_time()
    runner.step_started_at, now = t0, t0
    while (reason := watchdog.check(now)) is None and now < t0 + 60:
        now += watchdog.period_s
    assert reason is not None and "no step completed for 10 s" in reason
    assert 10 <= now - t0 <= 10 + watchdog.period_s


async def test_an_engine_whose_steps_outlast_the_timeout_but_beat_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Steps of 3 x the step timeout, beating every second as a forward beats once a layer:
    the request completes and the engine stays ready."""
    runner = FakeRunner(text_script("long steps"), step_s=15, beat_s=1)
    async with fake_engine(runner, step_timeout_s=5) as engine:
        with trio.fail_after(600):
            text = await engine.generate("p", SamplingParams(max_tokens=4))
        assert text == "long"
        assert engine.state == EngineState.READY and not engine.has_failed
