"""Tokenization in real worker processes: leaving while tokenizing, and a worker that dies."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ft.errors import RequestFailed
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine
from tests.support.faulty_worker import EXIT, faulty_tokenize_job


async def test_worker_death_fails_only_its_request_and_the_engine_carries_on() -> None:
    """A tokenizer worker that dies fails its request only; the engine serves the next one."""
    with trio.fail_after(60):
        async with fake_engine(executor=None, tokenize_job=faulty_tokenize_job) as engine:
            with pytest.raises(RequestFailed, match="worker died") as failed:
                async with engine.open_request(PromptSpec(text=EXIT)) as stream:
                    await stream.collect()
            assert "pid" not in str(failed.value) and "Process" not in str(failed.value)
            for _ in range(2):
                async with engine.open_request(PromptSpec(text="fine")) as stream:
                    assert (await stream.collect())[0].finish_reason == "stop"
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert len(engine.registry) == 0
            assert engine.core is not None and engine.core.pool.num_used == 0


async def test_leaving_while_the_worker_tokenizes_never_enqueues() -> None:
    """Requests that leave while a real worker tokenizes are never enqueued."""
    with trio.fail_after(60):
        async with fake_engine(executor=None) as engine:
            assert engine.core is not None
            for _ in range(5):
                with trio.move_on_after(0.001):
                    async with engine.open_request(PromptSpec(text="x" * 1000)) as stream:
                        await stream.collect()
            await trio.sleep(1.0)  # let the worker answer the abandoned jobs
            assert len(engine.registry) == 0
            assert not engine.core.waiting and not engine.core.running
            assert engine.core.pool.num_used == 0


async def test_a_grammar_compiler_killed_in_the_shared_workers_leaves_tokenization_working() -> None:
    """Grammar checks run in the engine's worker processes, beside tokenization: one whose
    worker is killed (past its deadline) or dies costs that worker only."""
    from dataclasses import replace

    from ft.config import EngineConfig
    from ft.engine.engine import open_engine
    from ft.engine.fake import FakeRunner
    from ft.engine.grammars import Grammars
    from ft.errors import InvalidRequest
    from ft.grammar import spec
    from ft.tokenizer.job import check_grammar_job
    from tests.support.engine import fake_hooks
    from tests.support.faulty_worker import crashing_grammar_job

    with trio.fail_after(60):
        hooks = replace(fake_hooks(FakeRunner(), executor=None), grammar_job=crashing_grammar_job)
        async with open_engine(EngineConfig(num_pages=64), hooks=hooks) as engine:
            with pytest.raises(InvalidRequest, match="crashed its compiler"):
                await engine.compile_grammar(spec.json_object("response_format"))
            for _ in range(3):
                async with engine.open_request(PromptSpec(text="fine")) as stream:
                    assert (await stream.collect())[0].finish_reason == "stop"
            # A compile past its deadline: the worker running it is killed.
            grammars = engine._started().grammars
            assert isinstance(grammars, Grammars)
            grammars._check_job, grammars._timeout_s = check_grammar_job, 0.0
            with pytest.raises(InvalidRequest, match="longer than"):
                await engine.compile_grammar(spec.regex("a+", "regex"))
            for _ in range(3):
                async with engine.open_request(PromptSpec(text="fine")) as stream:
                    assert (await stream.collect())[0].finish_reason == "stop"
            grammars._timeout_s = 30.0
            assert await engine.compile_grammar(spec.regex("b+", "regex"))
