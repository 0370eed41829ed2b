"""Output tokens/s through the embedded API (no HTTP) at several concurrency levels.

    ft bench [--concurrency 1 4 16] [--max-tokens 128] [--model PATH]
    python tools/bench_engine.py ...        (the same)

Prints one JSON line: for each concurrency, output tokens/s, mean TTFT and wall time, plus the
16-vs-1 speed-up. All levels run in the same process against the same loaded engine, so the
ratios are comparable even on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import time

import trio

from ft.config import EngineConfig, add_model_arguments, model_config_fields
from ft.engine.engine import Engine, open_engine
from ft.params import SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "List some facts about the moon.",
    "Describe your ideal weekend.",
]


async def run_level(engine: Engine, concurrency: int, max_tokens: int) -> dict[str, float]:
    """Run `concurrency` requests at once; return tokens/s and latency figures."""
    ttfts: list[float] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        start = time.perf_counter()
        first = None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" ({i})"}]
        async with engine.open_request(messages=messages, params=params) as stream:
            async for _ in stream:
                if first is None:
                    first = time.perf_counter() - start
        ttfts.append(first or 0.0)
        tokens += stream.num_completion_tokens

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 3),
    }


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(
        **model_config_fields(args),
        max_running_requests=max(args.concurrency),
        compute_threads=args.threads,
    )
    async with open_engine(config) as engine:
        await run_level(engine, 1, 8)  # warm-up
        levels = [await run_level(engine, c, args.max_tokens) for c in args.concurrency]
    base = levels[0]["tokens_per_s"]
    result = {
        "bench": "engine",
        "model": engine.model_id,
        "max_tokens": args.max_tokens,
        "levels": levels,
        "speedup_vs_first": {str(x["concurrency"]): round(x["tokens_per_s"] / base, 2) for x in levels},
    }
    print(json.dumps(result))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `ft bench`."""
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    add_model_arguments(parser)
    parser.add_argument("--threads", type=int, default=None)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and print its JSON line."""
    trio.run(main, args)
    return 0
