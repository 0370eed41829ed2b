"""Pooling requests through the whole engine (fake model): counted, batched, cancelled."""

from __future__ import annotations

import trio
import trio.testing

from ft.engine.fake import FakeRunner, byte_token, fake_hidden, text_script
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine


async def test_embed_returns_the_pooled_vector_and_counts_a_completed_request() -> None:
    async with fake_engine() as engine:
        vector = await engine.embed("hey")
        assert vector == fake_hidden(byte_token(ord("y")), 2)  # last-token pooling by default
        mean = await engine.embed("hey", pooling="mean")
        rows = [fake_hidden(byte_token(b), p) for p, b in enumerate(b"hey")]
        assert mean == tuple(sum(col) / 3 for col in zip(*rows, strict=True))
        snap = engine.snapshot()
        assert snap.requests.completed == 2 and snap.requests.active == 0


async def test_pooling_and_generation_run_in_the_same_steps() -> None:
    runner = FakeRunner(script=text_script("a long answer " * 20), record=True)
    async with fake_engine(runner) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(engine.generate, "hello", SamplingParams(max_tokens=200))
        with trio.fail_after(30):
            while not runner.steps:
                await trio.sleep(0.005)
        await engine.embed("x" * 100)
        nursery.cancel_scope.cancel()
    mixed = [s for s in runner.steps if any(w.num_pool_rows for w in s) and any(w.sample for w in s)]
    assert mixed  # one step carried a pooling chunk beside a sampled row


async def test_a_cancelled_pooling_request_frees_its_pages() -> None:
    runner = FakeRunner(step_s=1.0)
    async with fake_engine(runner, max_prefill_tokens=16) as engine:
        params = SamplingParams(pooling="mean")
        with trio.move_on_after(1.5):
            async with engine.open_request(PromptSpec(text="z" * 100), params=params) as stream:
                await stream.wait_embedding()
        await trio.testing.wait_all_tasks_blocked()
        core = engine.core
        assert core is not None
        with trio.fail_after(30):
            while core.has_work:
                await trio.sleep(0.01)
        assert core.pool.num_used == 0 and len(engine.registry) == 0
        assert engine.snapshot().requests.aborted == 1
