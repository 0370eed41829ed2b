"""Preemption through the whole engine: streams pause and continue, and every exit frees once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing
from test_request_scope import assert_nothing_held

from ft.core.batch import SeqWork
from ft.core.scheduler import Scheduler
from ft.core.sequence import SeqStatus
from ft.engine.engine import Engine
from ft.engine.fake import FakeRunner, text_script
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine

TEXT = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Page size 4, 12 pages: two requests of 4 + 40 tokens (11 pages each) are admitted together
# and collide once each holds 6 pages; the newer one is preempted and waits for the older one.
TIGHT = {
    "page_size": 4,
    "num_pages": 12,
    "max_running_requests": 4,
    "max_prefill_tokens": 16,
    "enable_prefix_caching": False,
}


def victim_stage(core: Scheduler, uid: int, works: list[SeqWork]) -> str | None:
    """Where request `uid` stands in its preemption, seen at the start of a step."""
    if core.num_preemptions == 0:
        return None
    waiting = [seq for group in core.waiting for seq in group if seq.uid == uid]
    if waiting and waiting[0].status is SeqStatus.PREEMPTED:
        return "preempted"
    running = [seq for seq in core.running.values() if seq.uid == uid]
    if not running or running[0].num_preemptions == 0:
        return None
    mine = [w for w in works if w.seq_id == running[0].seq_id]
    if mine and len(mine[0].token_ids) > 1:
        return "recomputing"
    if mine:
        return "resumed"
    return None


async def consume(engine: Engine, prompt: str, max_tokens: int) -> str:
    async with engine.open_request(
        PromptSpec(text=prompt), params=SamplingParams(max_tokens=max_tokens)
    ) as stream:
        (choice,) = await stream.collect()
    assert choice.finish_reason == "length"
    return choice.text


async def test_a_preempted_stream_pauses_then_continues_with_nothing_resent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A preempted request's stream pauses, then continues where it was: no text is sent twice."""
    async with fake_engine(FakeRunner(text_script(TEXT), step_s=0.01), **TIGHT) as engine:
        assert engine.core is not None
        texts: dict[str, str] = {}

        async def one(name: str, delay: float) -> None:
            await trio.sleep(delay)
            texts[name] = await consume(engine, name * 4, 40)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a", 0)
            nursery.start_soon(one, "b", 0.001)
        assert texts == {"a": TEXT[:40], "b": TEXT[:40]}
        snap = engine.snapshot()
        assert snap.scheduler.preemptions >= 1 and snap.scheduler.recomputed_tokens > 0
        await assert_nothing_held(engine)


@pytest.mark.parametrize("stage", ["preempted", "recomputing", "resumed"])
async def test_cancel_at_each_preemption_stage_frees_everything_once(
    autojump_clock: trio.testing.MockClock, stage: str
) -> None:
    """Cancelling at each stage of a preemption frees every page exactly once."""
    seen: list[str] = []
    reached = trio.Event()
    state: dict[str, Callable[[list[SeqWork]], str | None]] = {}

    def before_step(works: list[SeqWork]) -> None:
        now = state["stage"](works)
        if now is not None:
            seen.append(now)
        if now == stage:
            reached.set()

    runner = FakeRunner(text_script(TEXT), step_s=0.01)
    async with fake_engine(runner, before_step=before_step, **TIGHT) as engine:
        core = engine.core
        assert core is not None
        victim_uid: list[int] = []
        state["stage"] = lambda works: victim_stage(core, victim_uid[0], works) if victim_uid else None
        older: list[str] = []

        async def oldest() -> None:
            older.append(await consume(engine, "aaaa", 40))

        async def victim(cancel_scope: trio.CancelScope) -> None:
            await trio.sleep(0.001)
            with cancel_scope:
                async with engine.open_request(
                    PromptSpec(text="bbbb"), params=SamplingParams(max_tokens=40)
                ) as s:
                    victim_uid.append(s.uid)
                    await s.collect()

        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(oldest)
            nursery.start_soon(victim, scope)
            with trio.fail_after(60):
                await reached.wait()
            scope.cancel()  # the client leaves while the request is at `stage`
        assert scope.cancelled_caught
        assert older == [TEXT[:40]]  # the older request never noticed
        await assert_nothing_held(engine)
        snap = engine.snapshot()
        assert snap.requests.aborted == 1 and snap.requests.completed == 1
        assert snap.kv.used_pages == 0


async def test_cancelling_the_older_request_lets_the_preempted_one_finish_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """When the older request leaves, the preempted one is re-admitted and finishes whole."""
    runner = FakeRunner(text_script(TEXT), step_s=0.01)
    async with fake_engine(runner, **TIGHT) as engine:
        core = engine.core
        assert core is not None
        texts: list[str] = []

        async def victim() -> None:
            await trio.sleep(0.001)
            texts.append(await consume(engine, "bbbb", 40))

        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as older_scope:
                nursery.start_soon(victim)
                async with engine.open_request(
                    PromptSpec(text="aaaa"), params=SamplingParams(max_tokens=40)
                ) as s:
                    async for _ in s:
                        if core.num_preemptions:
                            older_scope.cancel()
        assert older_scope.cancelled_caught and core.num_preemptions >= 1
        assert texts == [TEXT[:40]]
        assert engine.snapshot().requests.aborted == 1
        await assert_nothing_held(engine)


async def test_reserve_admission_never_preempts(autojump_clock: trio.testing.MockClock) -> None:
    """With admission "reserve" (the whole budget at admission) nothing is ever preempted."""
    runner = FakeRunner(text_script(TEXT), step_s=0.01)
    async with fake_engine(runner, admission="reserve", **TIGHT) as engine:
        texts: list[str] = []

        async def one() -> None:
            texts.append(await consume(engine, "cccc", 40))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        assert texts == [TEXT[:40]] * 3
        assert engine.snapshot().scheduler.preemptions == 0
        await assert_nothing_held(engine)
