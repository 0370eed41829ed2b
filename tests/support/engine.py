"""Engines on the fake model (byte tokenizer, scripted async runner); the hooks built once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.engine import Engine, open_engine
from ft.engine.fake import FAKE_HIDDEN, FakeRunner, byte_tokenizer_spec, run_inline
from ft.engine.loading import EngineHooks, ModelParts
from ft.tokenizer.job import Executor


def fake_parts(runner: FakeRunner, context_length: int = 2048) -> Callable[[EngineConfig], ModelParts]:
    """A `load_model` hook that serves `runner` with the byte tokenizer."""

    def load(config: EngineConfig) -> ModelParts:
        def make(num_pages: int, page_size: int) -> FakeRunner:
            runner.num_pages, runner.page_size = num_pages, page_size
            return runner

        if runner.recurrent:  # as the real loader sizes them: running slots plus snapshots
            runner.num_state_slots = config.max_running_requests + config.state_snapshots
        return ModelParts(
            tokenizer=byte_tokenizer_spec(context_length),
            make_runner=make,
            bytes_per_page=lambda ps: 1024 * ps,
            vocab_size=runner.vocab_size,
            generation_defaults={},
            hidden_size=FAKE_HIDDEN,
            num_state_slots=runner.num_state_slots,
            state_slot_bytes=64 if runner.recurrent else 0,
        )

    return load


def with_template(template: str) -> Callable[[EngineConfig], ModelParts]:
    """The fake model, its tokenizer carrying the chat template `template`."""
    load = fake_parts(FakeRunner())

    def load_with_template(config: EngineConfig) -> ModelParts:
        parts = load(config)
        return replace(parts, tokenizer=replace(parts.tokenizer, chat_template=template))

    return load_with_template


def fake_hooks(
    runner: FakeRunner | None = None,
    *,
    before_step: Callable[[list[SeqWork]], None] | None = None,
    tokenize_job: Callable[[bytes], bytes] | None = None,
    executor: Executor | None = run_inline,
    context_length: int = 2048,
    load_model: Callable[[EngineConfig], ModelParts] | None = None,
) -> EngineHooks:
    """The engine hooks for the fake model: every test engine and server is built with these.

    `executor=None` tokenizes in real worker processes; `load_model` replaces the fake model's
    loader (a slow or a failing load); `tokenize_job` the worker's job (a test double,
    `tests.support.faulty_worker`).
    """
    return EngineHooks(
        load_model=load_model or fake_parts(runner or FakeRunner(), context_length),
        tokenize_executor=executor,
        before_step=before_step,
        tokenize_job=tokenize_job,
        step_costs=no_step_costs,
    )


def no_step_costs() -> None:
    """No speculation cost model: the fake runner's step times are not a model's."""
    return None


@asynccontextmanager
async def fake_engine(
    runner: FakeRunner | None = None,
    *,
    before_step: Callable[[list[SeqWork]], None] | None = None,
    tokenize_job: Callable[[bytes], bytes] | None = None,
    executor: Executor | None = run_inline,
    context_length: int = 2048,
    load_model: Callable[[EngineConfig], ModelParts] | None = None,
    **config: Any,
) -> AsyncIterator[Engine]:
    """An engine on the fake model; `config` overrides `EngineConfig` fields.

    `executor=None` tokenizes in real worker processes; `load_model` replaces the fake model.
    """
    hooks = fake_hooks(
        runner,
        before_step=before_step,
        tokenize_job=tokenize_job,
        executor=executor,
        context_length=context_length,
        load_model=load_model,
    )
    async with open_engine(
        replace(EngineConfig(num_pages=64, served_model_name="fake"), **config), hooks=hooks
    ) as engine:
        yield engine
