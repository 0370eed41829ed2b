"""Time to first token, cold against after a restart with the prompt cache's disk tier.

    python3 tools/bench_prompt_cache.py                        # ~2,400 and ~4,000 tokens, 3 runs
    python3 tools/bench_prompt_cache.py --tokens 600 --runs 1  # a quick smoke check
    python3 tools/bench_prompt_cache.py --model llama-1b-Q4_K_M.gguf

For each prompt length and run, in this process (the embedded API, no HTTP): an engine on an
empty `--prompt-cache-dir` serves the prompt (cold: the whole prefill), is stopped, and a new
engine on the same directory serves it again (its RAM cache is empty: the prefix comes from
disk). Each TTFT is from `open_request` to the first token (tokenizing included). Prints one
JSON line per run and one per length (medians, the ratio), and checks that both answers (8
greedy tokens) agree. Engine starts are not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import trio

from ft.config import EngineConfig
from ft.engine.engine import Engine, open_engine
from ft.params import SamplingParams
from ft.prompt import PromptSpec

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompt_of(num_tokens: int) -> str:
    """About `num_tokens` tokens of counting (SmolLM2 splits digits one by one: a number costs
    its digits and a space)."""
    numbers: list[str] = []
    cost = 0
    while cost < num_tokens:
        numbers.append(str(len(numbers)))
        cost += len(numbers[-1]) + 1
    return "Continue the list: " + " ".join(numbers)


async def serve_once(config: EngineConfig, text: str) -> tuple[float, list[int], int, int]:
    """(TTFT s, greedy tokens, cached prompt tokens, prompt tokens) of `text` on a new engine."""
    async with open_engine(config) as engine:
        return await timed(engine, text)


async def timed(engine: Engine, text: str) -> tuple[float, list[int], int, int]:
    started = time.perf_counter()
    ttft = 0.0
    tokens: list[int] = []
    async with engine.open_request(PromptSpec(text=text), params=GREEDY) as stream:
        async for delta in stream:
            if delta.token_ids and not ttft:
                ttft = time.perf_counter() - started
            tokens.extend(delta.token_ids)
    return ttft, tokens, stream.num_cached_tokens, len(stream.prompt_ids)


async def main(args: argparse.Namespace) -> None:
    for num_tokens in args.tokens:
        text = prompt_of(num_tokens)
        colds, warms = [], []
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="ft-bench-pc-") as directory:
                config = EngineConfig(
                    model=args.model,
                    prompt_cache_dir=directory,
                    compute_threads=args.compute_threads,
                    max_model_len=args.max_model_len,
                )
                cold, cold_tokens, cold_cached, length = await serve_once(config, text)
                warm, warm_tokens, warm_cached, _ = await serve_once(config, text)
            colds.append(cold)
            warms.append(warm)
            print(
                json.dumps(
                    {
                        "prompt_tokens": length,
                        "run": run + 1,
                        "cold_ttft_s": round(cold, 3),
                        "restart_ttft_s": round(warm, 3),
                        "cold_cached": cold_cached,
                        "restart_cached": warm_cached,
                        "same_answer": cold_tokens == warm_tokens,
                    }
                ),
                flush=True,
            )
        cold_p50, warm_p50 = statistics.median(colds), statistics.median(warms)
        print(
            json.dumps(
                {
                    "prompt_tokens": length,
                    "cold_ttft_p50_s": round(cold_p50, 3),
                    "restart_ttft_p50_s": round(warm_p50, 3),
                    "ratio": round(warm_p50 / cold_p50, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GGUF or HF directory (default: the default model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2400, 4000], help="prompt lengths")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compute-threads", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    trio.run(main, parser.parse_args())
