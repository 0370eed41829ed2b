"""The default model served over a q8_0 KV cache: pages from the memory budget follow its bytes,
prefix hits reuse its pages, and preempted requests recompute into it as if uninterrupted."""

from __future__ import annotations

import pytest
import torch
import trio

from ft.config import EngineConfig
from ft.engine.engine import Engine, open_engine
from ft.model import kernels
from ft.model.loader import load_model
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from ft.prompt import PromptSpec

pytestmark = [
    pytest.mark.slow,  # the real default model
    pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels"),
]

CHAT = [{"role": "user", "content": "Name three colors."}]
BUDGET = 2 << 20  # 10 pages of q8_0 on the default model (5 of float16)


async def tokens(engine: Engine, params: SamplingParams) -> tuple[list[int], int]:
    async with engine.open_request(PromptSpec(messages=CHAT), params=params) as stream:
        (choice,) = await stream.collect()
    return choice.token_ids, stream.num_cached_tokens


async def test_default_model_serves_over_q8_0_kv() -> None:
    """q8_0 KV: the budget's pages are counted in its bytes; a repeated prompt hits the prefix
    cache and decodes the same tokens; requests preempted for pages continue as they would alone."""
    config = EngineConfig(
        kv_cache_dtype="q8_0", kv_cache_memory=BUDGET, max_running_requests=4, compute_threads=1
    )
    with trio.fail_after(600):
        async with open_engine(config) as engine:
            assert engine.core is not None
            snap = engine.snapshot()
            model = load_model(None, torch.float32, quantized=True).config
            q8_page = TorchRunner.bytes_per_page(model, config.page_size, kernels.Q8_0_KV)
            f16_page = TorchRunner.bytes_per_page(model, config.page_size, torch.float16)
            assert snap.kv.dtype == "q8_0" and snap.kv.total_pages == BUDGET // q8_page
            assert snap.kv.total_pages >= 1.8 * (BUDGET // f16_page)

            greedy = SamplingParams(max_tokens=24, temperature=0)
            first, cached = await tokens(engine, greedy)
            assert cached == 0 and len(first) > 0
            again, cached = await tokens(engine, greedy)
            assert cached > 0 and again == first

            def seeded(seed: int) -> SamplingParams:
                return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)

            seeds = (11, 22, 33)
            alone = [(await tokens(engine, seeded(seed)))[0] for seed in seeds]
            assert engine.core.num_preemptions == 0
            together: dict[int, list[int]] = {}

            async def one(seed: int) -> None:
                together[seed] = (await tokens(engine, seeded(seed)))[0]

            async with trio.open_nursery() as nursery:
                for seed in seeds:
                    nursery.start_soon(one, seed)
            assert engine.core.num_preemptions > 0
            assert [together[seed] for seed in seeds] == alone
            # NOTE: the victim's pages may come back from the prefix cache instead of a recompute.
            assert engine.snapshot().kv.used_pages == 0
