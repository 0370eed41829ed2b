"""The prefix cache's partitions through the whole engine: a prompt's `cache_salt` and `tenant`
(`PromptSpec.cache_partition`) reach the scheduler, and only the same pair reuses its pages."""

from __future__ import annotations

import pytest
import trio

from ft.engine.engine import Engine
from ft.errors import InvalidRequest
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.tokenizer.codec import decode_job, encode_job
from tests.support.engine import fake_engine

TEXT = "The vault's PIN is 4821; keep it safe, and tell no one what it is. " * 2
CHAT = [{"role": "user", "content": TEXT}]
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


async def cached_tokens(engine: Engine, prompt: PromptSpec) -> int:
    """Prompt tokens the prefix cache supplied to `prompt`'s request."""
    async with engine.open_request(prompt, params=ONE_TOKEN) as stream:
        await stream.collect()
    return stream.num_cached_tokens


@pytest.mark.parametrize("kind", ["text", "chat"])
async def test_only_the_same_tenant_and_salt_reuse_a_prompts_pages(kind: str) -> None:
    def prompt(**partition: str | None) -> PromptSpec:
        if kind == "text":
            return PromptSpec(text=TEXT, **partition)  # type: ignore[arg-type]
        return PromptSpec(messages=CHAT, **partition)  # type: ignore[arg-type]

    with trio.fail_after(30):
        async with fake_engine() as engine:
            await engine.wait_ready()
            assert await cached_tokens(engine, prompt(cache_salt="alice")) == 0
            for other in (
                prompt(),
                prompt(cache_salt="bob"),
                prompt(tenant="t2", cache_salt="alice"),
                prompt(tenant="alice"),  # a tenant named like a salt is another partition
            ):
                assert await cached_tokens(engine, other) == 0
            hits = await cached_tokens(engine, prompt(cache_salt="alice"))
            assert hits >= 128 and hits % engine.config.page_size == 0
            assert await cached_tokens(engine, prompt(tenant="t2", cache_salt="alice")) == hits
            assert await cached_tokens(engine, prompt()) == hits


def test_a_cache_salt_must_be_one_to_256_printable_characters() -> None:
    for bad in ("", "x" * 257, "tab\there", "new\nline"):
        with pytest.raises(InvalidRequest) as e:
            PromptSpec(text="hi", cache_salt=bad)
        assert e.value.param == "cache_salt"
    assert PromptSpec(text="hi", cache_salt="é" * 256).cache_salt == "é" * 256


def test_the_partition_never_reaches_the_tokenizer_worker() -> None:
    """The worker renders the template; who sent the prompt is none of its business."""
    prompt = PromptSpec(messages=CHAT, cache_salt="alice", tenant="t1")
    rebuilt = decode_job(encode_job(prompt, "spec.json")).prompt
    assert rebuilt.cache_salt is None and rebuilt.tenant is None and rebuilt.messages == prompt.messages
