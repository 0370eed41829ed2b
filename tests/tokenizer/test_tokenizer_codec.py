"""Encoding tokenizer jobs: off the event loop, linear, and naming the field it cannot send
(issue 18: 47 ms of CBOR work per 0.9 MB of kwargs ran on the loop)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

import ft.actors.tokenizer as tokenizer_actor
from ft.errors import InvalidRequest
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.tokenizer.codec import INLINE_JOB_CHARS, INLINE_JOB_VALUES, decode_job, encode_job, is_small_job
from tests.support.engine import fake_engine


def job(**fields: Any) -> PromptSpec:
    base: dict[str, Any] = {"messages": ({"role": "user", "content": "hi"},)}
    return PromptSpec(**base | fields)


def test_a_job_round_trips_with_a_large_kwargs_value() -> None:
    """0.9 MB of integers in `chat_template_kwargs` arrive whole on the worker side."""
    kwargs = {"zzz": [7] * 300_000, "nested": [{"a": [1, 2]}]}
    decoded = decode_job(encode_job(job(chat_template_kwargs=kwargs), "spec"))
    assert decoded.prompt == job(chat_template_kwargs=kwargs)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": {"a": [{"b": [1, 2**64]}]}}, "chat_template_kwargs.a.b"),
        ({"chat_template_kwargs": {"zzz": [7] * 10_000 + [-(2**63) - 1]}}, "chat_template_kwargs.zzz"),
        ({"messages": ({"role": "user", "content": "a\ud800"},)}, "messages"),
        ({"chat_template_kwargs": {"x": object()}}, "chat_template_kwargs"),
    ],
)
def test_an_unsendable_field_is_named(fields: dict[str, Any], param: str) -> None:
    """An integer past 64 bits, a lone surrogate or an object CBOR cannot carry names its field."""
    with pytest.raises(InvalidRequest) as refused:
        encode_job(job(**fields), "spec")
    assert refused.value.param == param


def test_a_job_is_small_by_its_values_and_characters() -> None:
    """Jobs past a bounded count of values or characters are large, however they nest."""
    assert is_small_job(job(chat_template_kwargs={"a": [1] * (INLINE_JOB_VALUES // 2)}))
    assert not is_small_job(job(chat_template_kwargs={"a": [1] * 300_000}))
    assert not is_small_job(job(chat_template_kwargs={str(i): i for i in range(300_000)}))
    assert not is_small_job(job(chat_template_kwargs={"a": [[[1] * 100] * 100]}))
    assert not is_small_job(job(text="x" * (INLINE_JOB_CHARS + 1), messages=None))
    assert is_small_job(job(text="x" * 1000, messages=None))


async def test_large_jobs_are_encoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer actor encodes a large job in a thread, never on the loop's."""
    threads: list[threading.Thread] = []
    real = tokenizer_actor.encode_job

    def recorded(prompt: PromptSpec, spec_path: str, max_tokens: int | None = None) -> bytes:
        threads.append(threading.current_thread())
        return real(prompt, spec_path, max_tokens)

    monkeypatch.setattr(tokenizer_actor, "encode_job", recorded)
    with trio.fail_after(30):
        async with fake_engine() as engine:
            async with engine.open_request(
                PromptSpec(
                    messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"zzz": [7] * 300_000}
                ),
                params=SamplingParams(max_tokens=2),
            ) as stream:
                await stream.collect()
    assert threads and threading.main_thread() not in threads
