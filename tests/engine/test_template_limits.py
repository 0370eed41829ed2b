"""Hostile chat templates in real tokenizer workers: deadlines, the memory bound, load checks,
and workers that never hold up (or outlive) the engine's stop."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import trio

from ft.engine import lifetime
from ft.engine.engine import Engine
from ft.engine.fake import CHATML
from ft.errors import InvalidRequest, RequestAborted
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine, with_template
from tests.support.faulty_worker import HANG, faulty_tokenize_job

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING = (  # 1 MiB doubled 12 times: 4 GiB, past the worker's memory bound
    "{% set ns = namespace(s='x' * 1048576) %}"
    "{% for i in range(12) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}"
)
SMALL_BOUND = 512 << 20  # the tests' worker memory bound: reached in a fraction of a second
# Loops or grows only for a chosen last message, so that the load check passes.
HOSTILE = (
    "{% set last = messages[-1]['content'] %}"
    f"{{% if last == 'loop' %}}{NESTED_LOOPS}{{% elif last == 'grow' %}}{DOUBLING}{{% endif %}}" + CHATML
)


def chat(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def worker_pids() -> set[int]:
    """This process's trio-parallel workers (not multiprocessing's resource tracker); take those
    running before an engine starts away to get the engine's (other tests leave idle ones)."""
    children = psutil.Process().children(recursive=True)
    return {p.pid for p in children if "spawn_main" in " ".join(p.cmdline())}


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def answer(engine: Engine, content: str) -> str:
    async with engine.open_request(PromptSpec(messages=chat(content))) as stream:
        return (await stream.collect())[0].text


async def test_a_template_that_loops_is_a_400_after_its_deadline_and_the_worker_serves_on() -> None:
    """Two nested `range(100000)` loops hung every text request and /v1/tokenize for good."""
    elsewhere = worker_pids()
    with trio.fail_after(60):
        async with fake_engine(
            executor=None, load_model=with_template(HOSTILE), template_timeout_s=1.0
        ) as engine:
            before = worker_pids() - elsewhere
            with pytest.raises(InvalidRequest, match="chat template took longer than 1 s") as info:
                await answer(engine, "loop")  # before: never (the block's 60 s bound fails it)
            assert info.value.param == "messages"
            with pytest.raises(InvalidRequest, match="chat template took longer than 1 s"):
                await engine.tokenize(PromptSpec(messages=chat("loop")))
            assert await answer(engine, "hi")
            assert worker_pids() - elsewhere == before  # the render stopped; its worker lives on


async def test_a_template_past_the_memory_bound_is_a_400_and_its_worker_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifetime, "WORKER_MEMORY_BYTES", SMALL_BOUND)
    elsewhere = worker_pids()
    with trio.fail_after(60):
        async with fake_engine(
            executor=None, load_model=with_template(HOSTILE), template_timeout_s=30
        ) as engine:
            before = worker_pids() - elsewhere
            with pytest.raises(InvalidRequest, match="needs more memory than a tokenizer worker may use"):
                await answer(engine, "grow")
            assert await answer(engine, "hi")
            assert (worker_pids() - elsewhere).isdisjoint(before)


async def test_a_text_too_long_to_encode_within_the_memory_bound_is_a_400_before_encoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A render of up to 16 Mi characters was encoded, but encoding costs up to ~160 bytes of
    memory per byte of text: past the worker's bound the tokenizer aborted the process (a 500
    "the tokenizer worker died; retry", and a respawn for every such request)."""
    monkeypatch.setattr(lifetime, "WORKER_MEMORY_BYTES", SMALL_BOUND)
    long = "{% if messages[-1]['content'] == 'long' %}{{ '\u00e9' * 3000000 }}{% endif %}"  # 6 MB
    elsewhere = worker_pids()
    with trio.fail_after(60):
        async with fake_engine(executor=None, load_model=with_template(long + CHATML)) as engine:
            before = worker_pids() - elsewhere
            with pytest.raises(InvalidRequest, match="template rendered more than 4194304 bytes") as info:
                await answer(engine, "long")
            assert info.value.param == "messages"
            with pytest.raises(InvalidRequest, match="prompt is more than 4194304 bytes") as info:
                await engine.generate("\u00e9" * 2_500_000)
            assert info.value.param == "prompt"
            assert await answer(engine, "hi")
            assert worker_pids() - elsewhere == before  # refused before encoding: no worker died


async def test_a_job_past_its_deadline_has_its_worker_killed_and_is_a_400(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job that ignores the render deadline (a C call that never returns) is killed."""
    # NOTE: the deadline counts a fresh worker's start too (seconds on a busy machine).
    monkeypatch.setattr(lifetime, "TOKENIZE_GRACE_S", 5.0)
    elsewhere = worker_pids()
    with trio.fail_after(60):
        async with fake_engine(
            executor=None, tokenize_job=faulty_tokenize_job, template_timeout_s=0.5
        ) as engine:
            before = worker_pids() - elsewhere
            with pytest.raises(InvalidRequest, match="tokenizing took too long.*5.5 s") as info:
                await engine.generate(HANG)
            assert info.value.param == "prompt"
            assert await engine.generate("fine")
            assert (worker_pids() - elsewhere).isdisjoint(before)


async def test_a_cancelled_caller_waits_for_its_job_rather_than_kill_the_worker() -> None:
    """A client hanging up while its prompt renders costs no worker (a respawn takes seconds):
    the call ends with the job, which its deadline bounds."""
    elsewhere = worker_pids()
    with trio.fail_after(60):
        async with fake_engine(
            executor=None, load_model=with_template(HOSTILE), template_timeout_s=1.0
        ) as engine:
            before = worker_pids() - elsewhere
            with pytest.raises(InvalidRequest, match="took longer than 1 s"), trio.move_on_after(0.2):
                await engine.tokenize(PromptSpec(messages=chat("loop")))
            assert worker_pids() - elsewhere == before
            assert await answer(engine, "hi")


async def test_stopping_the_engine_kills_a_busy_worker_and_aborts_its_requests() -> None:
    """A job that never ends held the engine's stop (and SIGTERM) forever: now the drain and
    the abort grace bound the stop, then the busy worker is killed."""
    elsewhere = worker_pids()
    with trio.fail_after(30):
        async with fake_engine(executor=None, tokenize_job=faulty_tokenize_job) as engine:
            busy = worker_pids() - elsewhere
            outcomes: list[type[BaseException]] = []

            async def stuck(call: Callable[[], Any]) -> None:
                with pytest.raises(RequestAborted) as info:
                    await call()
                outcomes.append(info.type)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stuck, lambda: engine.generate(HANG))
                nursery.start_soon(stuck, lambda: engine.tokenize(PromptSpec(text=HANG)))
                await trio.sleep(0.5)
                await engine.prepare_stop(drain_timeout_s=0.2, abort_timeout_s=0.2)  # before: never
            assert outcomes == [RequestAborted, RequestAborted]
        assert busy and all(is_gone(pid) for pid in busy)


async def test_leaving_the_engine_kills_a_busy_worker_at_once() -> None:
    elsewhere = worker_pids()
    with trio.fail_after(30):
        async with fake_engine(executor=None, tokenize_job=faulty_tokenize_job) as engine:
            busy = worker_pids() - elsewhere
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.generate, HANG)
                await trio.sleep(0.5)
                nursery.cancel_scope.cancel()  # before: leaving never ended (the 30 s bound fails it)
        assert busy and all(is_gone(pid) for pid in busy)


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{% for m in messages %}", "chat template error"),
        ("{{ raise_exception('nothing renders') }}", "nothing renders"),
        ("{{ 7 ** 77777777 }}", "power"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        (NESTED_LOOPS, "took longer than 1 s to render a sample conversation"),
        (DOUBLING, "needs more memory"),
    ],
)
async def test_a_template_that_cannot_render_fails_the_engine_at_load(
    template: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifetime, "WORKER_MEMORY_BYTES", SMALL_BOUND)
    timeout_s = 1.0 if template == NESTED_LOOPS else 30.0  # the memory bound first, in the others
    failed = pytest.RaisesExc(RuntimeError, match=f"chat template cannot be used: .*{re.escape(reason)}")
    with trio.fail_after(60), pytest.RaisesGroup(failed, flatten_subgroups=True):
        async with fake_engine(
            executor=None, load_model=with_template(template), template_timeout_s=timeout_s
        ):
            pass


async def test_a_template_that_refuses_a_system_message_loads() -> None:
    template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
    )
    async with fake_engine(load_model=with_template(template + CHATML)) as engine:
        assert await answer(engine, "hi")


async def test_a_template_that_reads_tools_is_checked_with_tools() -> None:
    template = "{{ tools[0]['function']['name'] }}" + CHATML
    async with fake_engine(load_model=with_template(template)) as engine:
        assert engine.state == "ready"
