"""The prompt cache's disk tier on the default model: a long prompt served by one engine is read
back from disk by the next engine on the same directory, and answers exactly as it did cold."""

from __future__ import annotations

import os
import pathlib

import pytest
import trio

from ft.config import EngineConfig
from ft.engine.engine import Engine, open_engine
from ft.model import kernels
from ft.params import SamplingParams
from ft.prompt import PromptSpec

pytestmark = [
    pytest.mark.slow,  # the real default model
    pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels"),
]

# ~1,000 tokens (SmolLM2 splits digits one by one).
LONG = "Count along: " + " ".join(str(i) for i in range(260)) + ". What comes next?"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def config(directory: pathlib.Path, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = {
        "prompt_cache_dir": str(directory),
        "compute_threads": 1,
        "max_prefill_tokens": 512,
    }
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


async def answer(engine: Engine) -> tuple[list[int], int, int]:
    """Greedy tokens, cached prompt tokens and prompt length of the long prompt."""
    async with engine.open_request(PromptSpec(text=LONG), params=GREEDY) as stream:
        (choice,) = await stream.collect()
    return choice.token_ids, stream.num_cached_tokens, len(stream.prompt_ids)


async def wait_written(engine: Engine, files: int) -> None:
    """Wait until the disk tier has written `files` pages (its writer thread is asynchronous)."""
    with trio.fail_after(60):
        while engine.snapshot().prompt_cache.disk.writes < files:
            await trio.sleep(0.05)


async def test_a_restarted_engine_reads_the_prompt_back_from_disk(tmp_path: pathlib.Path) -> None:
    """Cold, then a new engine on the same directory: the prompt's full pages come from disk
    (usage counts them as cached), the greedy answer is the cold one, /v1/stats shows the tier."""
    with trio.fail_after(600):
        async with open_engine(config(tmp_path)) as engine:
            cold, cached, num_prompt = await answer(engine)
            assert cached == 0 and num_prompt > 900
            full_pages = (num_prompt - 1) // engine.config.page_size
            await wait_written(engine, full_pages)
            disk = engine.snapshot().prompt_cache.disk
            assert disk.enabled and disk.files >= full_pages and disk.bytes <= disk.max_bytes
            assert disk.bytes_written == disk.bytes and disk.hits == 0

        async with open_engine(config(tmp_path)) as engine:
            warm, cached, _ = await answer(engine)
            snap = engine.snapshot()
            assert cached == full_pages * engine.config.page_size
            assert warm == cold
            assert snap.prompt_cache.disk.hit_tokens == cached
            assert snap.prompt_cache.disk.hits == full_pages and snap.prompt_cache.disk.corrupt == 0
            assert snap.scheduler.prefix_hit_tokens == cached
            body = snap.as_json()["prompt_cache"]
            assert body["disk"]["hit_tokens"] == cached and body["ram"]["hit_tokens"] == 0
            # Now in RAM too: the next request is a RAM hit, not another read.
            again, cached_again, _ = await answer(engine)
            assert again == cold and cached_again == cached
            assert engine.snapshot().prompt_cache.disk.hits == full_pages


async def test_corrupt_pages_on_disk_are_recomputed_not_served(tmp_path: pathlib.Path) -> None:
    """Every page file flipped in its payload: the restarted engine reads none of them (each
    deleted as corrupt), recomputes the prompt and answers as cold."""
    async with open_engine(config(tmp_path)) as engine:
        cold, _, num_prompt = await answer(engine)
        full_pages = (num_prompt - 1) // engine.config.page_size
        await wait_written(engine, full_pages)
    files = sorted(tmp_path.glob("v*-*/*.kv"))
    assert len(files) >= full_pages
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    async with open_engine(config(tmp_path)) as engine:
        warm, cached, _ = await answer(engine)
        disk = engine.snapshot().prompt_cache.disk
        assert warm == cold and cached == 0
        assert disk.corrupt >= 1 and disk.hits == 0 and disk.hit_tokens == 0


async def test_a_second_engine_on_the_directory_fails_naming_it(tmp_path: pathlib.Path) -> None:
    """Two engines on one directory: the second fails to start, saying which directory is taken."""
    async with open_engine(config(tmp_path)) as first:
        assert first.prompt_cache is not None
        async with open_engine(config(tmp_path), wait_ready=False) as second:
            with pytest.raises(RuntimeError, match="prompt cache directory") as info:
                await second.wait_ready()
            assert str(tmp_path) in str(info.value) and str(os.getpid()) in str(info.value)


async def test_evicted_pages_come_back_from_disk_in_the_same_engine(tmp_path: pathlib.Path) -> None:
    """A KV pool too small to keep the prompt cached: another prompt evicts it from RAM, and
    the next request reads it from disk instead of recomputing it."""
    small = config(tmp_path, num_pages=80)  # 1,280 tokens: one long prompt at a time
    async with open_engine(small) as engine:
        cold, _, num_prompt = await answer(engine)
        full_pages = (num_prompt - 1) // engine.config.page_size
        await wait_written(engine, full_pages)
        other = PromptSpec(text="Say: " + " ".join(str(i) for i in range(500, 760)))
        async with engine.open_request(other, params=GREEDY) as stream:
            await stream.collect()
        warm, cached, _ = await answer(engine)
        snap = engine.snapshot()
        assert warm == cold
        assert snap.prompt_cache.disk.hit_tokens > 0 and cached >= snap.prompt_cache.disk.hit_tokens
