"""End to end on the real default model (SmolLM2-135M-Instruct GGUF), through the embedded API.

One engine serves every check (loading it takes seconds), each check a block of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from ft.config import EngineConfig
from ft.engine.engine import Engine, open_engine
from ft.params import SamplingParams
from ft.prompt import PromptSpec

pytestmark = pytest.mark.slow  # the real default model, or a long soak

CHAT = [{"role": "user", "content": "Name three colors."}]


async def greedy(engine: Engine, **kw: object) -> list[int]:
    params = SamplingParams(max_tokens=24, temperature=0)
    async with engine.open_request(PromptSpec(messages=CHAT), params=params, **kw) as stream:  # type: ignore[arg-type]
        return (await stream.collect())[0].token_ids


async def test_default_model_generates_batches_and_frees_everything() -> None:
    """The default model answers in text; batching changes no seeded or greedy token; all is freed."""
    config = EngineConfig(max_running_requests=8, compute_threads=1)
    with trio.fail_after(240):
        async with open_engine(config) as engine:
            assert engine.core is not None
            # Greedy chat output is real text and stable.
            async with engine.open_request(
                PromptSpec(messages=CHAT), params=SamplingParams(max_tokens=24, temperature=0)
            ) as stream:
                (choice,) = await stream.collect()
            assert choice.finish_reason in ("stop", "length")
            assert any(c in choice.text.lower() for c in ("red", "blue", "green"))
            assert stream.num_prompt_tokens > 10

            # The same seed gives the same tokens alone and inside a busy batch.
            seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
            alone = await _sample(engine, seeded)
            results: list[list[int]] = []

            async def noise(i: int) -> None:
                await _sample(engine, SamplingParams(max_tokens=20, temperature=1.0, seed=i))

            async def target() -> None:
                results.append(await _sample(engine, seeded))

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(noise, i)
                nursery.start_soon(target)
            assert results == [alone]

            # Greedy output does not depend on the batch either.
            solo = await greedy(engine)
            batch: list[list[int]] = []

            async def one() -> None:
                batch.append(await greedy(engine))

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(one)
            assert batch == [solo] * 3

            # A stop string ends the text before it; a cancelled request frees its pages.
            text = engine.detokenize(solo)
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            async with engine.open_request(
                PromptSpec(messages=CHAT), params=SamplingParams(max_tokens=24, temperature=0, stop=(stop,))
            ) as stream:
                (choice,) = await stream.collect()
            assert stop not in choice.text and text.startswith(choice.text)
            with trio.move_on_after(1.0):
                async with engine.open_request(
                    PromptSpec(messages=CHAT), params=SamplingParams(max_tokens=2000, ignore_eos=True)
                ) as stream:
                    async for _ in stream:
                        pass
            with trio.fail_after(30):  # the abort waits for the step in flight
                while (snap := engine.snapshot()).requests.active or snap.kv.used_pages:
                    await trio.sleep(0.05)
            assert snap.requests.active == 0
            assert snap.kv.used_pages == 0  # cached prefix pages are counted apart
            assert snap.kv.cached_pages > 0


@pytest.mark.parametrize("dtype", ["auto", "float32"])  # packed GGUF kernels, float weights
async def test_default_model_preempted_requests_continue_as_if_uninterrupted(dtype: str) -> None:
    """On the default model, preempted requests produce the tokens they would have alone."""
    # 8 pages of 16 tokens: each request (~50 prompt tokens + 40) fits alone; three together
    # collide, so at least one is preempted, recomputed from its prompt + output, and resumed.
    config = EngineConfig(dtype=dtype, num_pages=8, max_running_requests=4, compute_threads=1)
    seeds = (11, 22, 33)
    with trio.fail_after(240):
        async with open_engine(config) as engine:
            assert engine.core is not None

            def params(seed: int) -> SamplingParams:
                return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)

            alone = [await _sample(engine, params(seed)) for seed in seeds]
            assert engine.core.num_preemptions == 0
            together: dict[int, list[int]] = {}

            async def one(seed: int) -> None:
                together[seed] = await _sample(engine, params(seed))

            async with trio.open_nursery() as nursery:
                for seed in seeds:
                    nursery.start_soon(one, seed)
            assert engine.core.num_preemptions > 0
            assert [together[seed] for seed in seeds] == alone
            snap = engine.snapshot()
            assert snap.scheduler.recomputed_tokens > 0 and snap.kv.used_pages == 0


async def _sample(engine: Engine, params: SamplingParams) -> list[int]:
    async with engine.open_request(PromptSpec(messages=CHAT), params=params) as stream:
        return (await stream.collect())[0].token_ids


def test_cli_generate_prints_the_completion() -> None:
    """`ft generate` prints a completion from the default model."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ft.cli",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "16",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert "Paris" in out.stdout


def test_cli_reports_a_corrupt_default_model_with_what_to_run(tmp_path: Path) -> None:
    """A corrupt cached default model is reported with the command that fixes it."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"garbage")
    out = subprocess.run(
        [sys.executable, "-m", "ft.cli", "generate", "hi", "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"FT_CACHE_DIR": str(tmp_path)},
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and "ft pull" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_generate_with_int8_weights() -> None:
    """`ft generate --quantize int8` runs and prints a completion."""
    out = subprocess.run(
        [sys.executable, "-m", "ft.cli", "generate", "What is the capital of France?", "--chat",
         "--quantize", "int8", "--max-tokens", "12", "--temperature", "0"],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    assert "Paris" in out.stdout
