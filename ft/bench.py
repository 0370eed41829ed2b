"""Output tokens/s through the embedded API (no HTTP) at several concurrency levels.

    ft bench [--concurrency 1 4 16] [--max-tokens 128] [--model PATH] [--structured] [--prefill 512]
             [--prompts short|edit] [--speculative-method ngram|draft [--speculative-model PATH]]
    python tools/bench_engine.py ...        (the same)

Prints one JSON line: for each concurrency, output tokens/s, mean TTFT and wall time, plus the
16-vs-1 speed-up. All levels run in the same process against the same loaded engine, so the
ratios are comparable even on a noisy machine.

`--structured` runs each level twice more, alternating free and grammar-constrained requests
(`BENCH_SCHEMA`: JSON that never ends before `--max-tokens`, so both write as many tokens),
and reports the constrained throughput as a fraction of the free one.

`--prompts edit` runs `EDIT_PROMPTS` instead, each of them at every level (`concurrency` at a
time): a passage and an instruction whose answer copies most of it (rename a variable, fix a
typo, reformat), greedy and ended by the model, where prompt-lookup drafts are accepted.

`--speculative-method ngram|draft` runs each level five times in the same engine: once
untimed (its prompts then come from the prefix cache, so no level's figures include their
prefill), then with speculation off, on, on, off (the per-request switch); the level reports
the last on-run's figures plus `without_speculation` and `speculative_speedup` (the means'
ratio), and the JSON line the engine's speculative counters (every run's, the untimed ones
included).

`--prefill N` also times one N-token prompt (fresh token ids, so no prefix-cache hit) to its
first token: prompt tokens/s, the figure `llama-bench -p N` reports.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import NotRequired, TypedDict

import trio

from ft.config import (
    ENGINE_DEFAULTS,
    KV_CACHE_DTYPES,
    EngineConfig,
    add_model_arguments,
    model_config_fields,
    positive_int,
)
from ft.engine.engine import Engine, open_engine
from ft.grammar import spec
from ft.grammar.spec import GrammarSpec
from ft.params import SamplingParams
from ft.prompt import PromptSpec

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "List some facts about the moon.",
    "Describe your ideal weekend.",
]


_CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def average_price(items):
    if not items:
        return 0
    subtotal = 0
    for item in items:
        subtotal += item.price
    return subtotal / len(items)
"""

_PROSE = (
    "The lighthouse stood at the edge of the cliff for more then a hundred years. Every night "
    "its keeper climbed the the spiral stairs, lit the great lamp and watched the ships pass "
    "safely by. In winter the storms were fierce, but the light never went out."
)

_CONFIG = "name: web\nport: 8080\nworkers: 4\ndebug: false\nhosts: [alpha, beta, gamma]\ntimeout: 30\n"

# Edits whose answers copy most of the passage: prompt lookup's best case (issue 24).
EDIT_PROMPTS = [
    f"Rename the variable subtotal to base_total in this code. Reply with the whole code only.\n\n{_CODE}",
    f"Fix the typos in this paragraph. Reply with the corrected paragraph only.\n\n{_PROSE}",
    f"Add type hints to this code. Reply with the whole code only.\n\n{_CODE}",
    f"Rewrite this configuration as JSON. Reply with the JSON only.\n\n{_CONFIG}",
]

PROMPT_SETS = {"short": PROMPTS, "edit": EDIT_PROMPTS}


# Objects with a few bounded fields, at least 1000 of them: output a model cannot end early.
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}


class Level(TypedDict):
    """One concurrency level's figures (`run_level`)."""

    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    decode_tokens_per_s: float | None  # None: requests ran in waves (see decode_rate)
    # With --speculative-method: tokens/s of the same requests with speculation off (the mean
    # of two runs alternated with two on), and the two on-runs' mean over it.
    without_speculation: NotRequired[float]
    speculative_speedup: NotRequired[float]
    ttft_mean_s: float


async def run_level(
    engine: Engine,
    concurrency: int,
    max_tokens: int,
    grammar: GrammarSpec | None = None,
    prompts: str = "short",
    speculative: bool = True,
) -> Level:
    """Run `concurrency` requests at once (following `grammar` when given) over the prompt set
    `prompts`; return tokens/s and latency figures. `speculative=False` turns speculation off
    for these requests (the per-request switch)."""
    edit = prompts == "edit"
    texts = PROMPT_SETS[prompts]
    ttfts: list[float] = []
    tokens = 0
    # (seconds since the level's start, tokens so far) at each chunk of each request
    progress: list[list[tuple[float, int]]] = []

    # Every edit prompt runs at each level (`concurrency` at a time): one alone says little.
    num_requests = max(concurrency, len(texts)) if edit else concurrency
    slots = trio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            await request(i)

    async def request(i: int) -> None:
        nonlocal tokens
        start = time.perf_counter()
        first = None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if edit else 0.8,
            seed=i,
            ignore_eos=grammar is None and not edit,  # an edit's answer ends with its copy
            grammar=grammar,
            speculative=speculative,
        )
        content = texts[i % len(texts)] if edit else texts[i % len(texts)] + f" ({i})"
        messages: list[dict[str, object]] = [{"role": "user", "content": content}]
        marks: list[tuple[float, int]] = []
        progress.append(marks)
        async with engine.open_request(PromptSpec(messages=messages), params=params) as stream:
            async for _ in stream:
                now = time.perf_counter()
                if first is None:
                    first = now - start
                marks.append((now - level_start, stream.num_completion_tokens))
        ttfts.append(first or 0.0)
        tokens += stream.num_completion_tokens

    level_start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(num_requests):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - level_start
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "decode_tokens_per_s": decode_rate(progress, wall) if num_requests == concurrency else None,
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 3),
    }


def decode_rate(progress: list[list[tuple[float, int]]], wall: float) -> float:
    """Tokens per second once every request has its first token, to the end: what
    llama-batched-bench reports as S_TG (its sequences' prompts first, then all of them
    generating together). Meant for requests started together: with waves of requests (the edit
    set at a lower concurrency) it would see only the last wave, so run_level reports None there.
    `progress`: per request, (seconds since the level's start, tokens so far) at each chunk."""
    marks = [m for m in progress if m]
    if not marks:
        return 0.0
    begin = max(m[0][0] for m in marks)  # the last first token
    after = sum(m[-1][1] - max(n for t, n in m if t <= begin) for m in marks)
    return round(after / (wall - begin), 2) if wall > begin else 0.0


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(
        **model_config_fields(args),
        max_running_requests=max(args.concurrency),
        kv_cache_dtype=args.kv_cache_dtype,
    )
    async with open_engine(config) as engine:
        await run_level(engine, 1, 8)  # warm-up
        levels = []
        for c in args.concurrency:
            if not args.speculative_method:
                levels.append(await run_level(engine, c, args.max_tokens, prompts=args.prompts))
                continue
            # The same requests with speculation off and on, in the same engine, alternated
            # (off, on, on, off) so neither side gets the quieter moments. An untimed run first
            # puts the prompts in the prefix cache (and a draft model's KV) for both.
            await run_level(engine, c, args.max_tokens, prompts=args.prompts)
            runs: dict[bool, list[Level]] = {False: [], True: []}
            for on in (False, True, True, False):
                run = await run_level(engine, c, args.max_tokens, prompts=args.prompts, speculative=on)
                runs[on].append(run)
            level = runs[True][-1]
            with_spec, without = (sum(r["tokens_per_s"] for r in runs[on]) / 2 for on in (True, False))
            level["without_speculation"] = round(without, 2)
            level["speculative_speedup"] = round(with_spec / without, 3)
            levels.append(level)
        speculative = engine.snapshot().speculative
        prefill = await run_prefill(engine, args.prefill) if args.prefill else None
        structured = (
            [await compare_structured(engine, c, args.max_tokens) for c in args.concurrency]
            if args.structured
            else []
        )
    base = levels[0]["tokens_per_s"]
    result: dict[str, object] = {
        "bench": "engine",
        "model": engine.model_id,
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
        "levels": levels,
        "speedup_vs_first": {str(x["concurrency"]): round(x["tokens_per_s"] / base, 2) for x in levels},
    }
    if prefill is not None:
        result["prefill"] = prefill
    if structured:
        result["structured"] = structured
    if speculative.method is not None:
        result["speculative"] = asdict(speculative)
    print(json.dumps(result))


async def run_prefill(engine: Engine, num_tokens: int) -> dict[str, float]:
    """One prompt of `num_tokens` token ids to its first token, best of three (fresh ids each
    time: a prefix-cache hit would time nothing)."""
    vocab = engine.vocab_size
    best = float("inf")
    for run in range(3):
        ids = [(7919 * (i + 1) + 104729 * run) % vocab for i in range(num_tokens)]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        start = time.perf_counter()
        async with engine.open_request(PromptSpec(token_ids=ids), params=params) as stream:
            async for _ in stream:
                break
        best = min(best, time.perf_counter() - start)
    return {
        "prompt_tokens": num_tokens,
        "seconds": round(best, 3),
        "prompt_tokens_per_s": round(num_tokens / best, 1),
    }


async def compare_structured(engine: Engine, concurrency: int, max_tokens: int) -> dict[str, float]:
    """Free and constrained rounds, alternated (free, constrained, free, constrained)."""
    grammar = spec.json_schema(BENCH_SCHEMA, "bench")
    await run_level(engine, 1, 4, grammar)  # compile it outside the timing
    free: list[float] = []
    constrained: list[float] = []
    for _ in range(2):
        free.append((await run_level(engine, concurrency, max_tokens))["tokens_per_s"])
        constrained.append((await run_level(engine, concurrency, max_tokens, grammar))["tokens_per_s"])
    return {
        "concurrency": concurrency,
        "free_tokens_per_s": round(sum(free) / len(free), 2),
        "constrained_tokens_per_s": round(sum(constrained) / len(constrained), 2),
        "constrained_vs_free": round(sum(constrained) / sum(free), 3),
    }


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `ft bench`."""
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--prompts",
        choices=sorted(PROMPT_SETS),
        default="short",
        help="short: open questions, sampled, run to --max-tokens; edit: a passage and an edit "
        "whose answer copies it, greedy (default: %(default)s)",
    )
    add_model_arguments(parser)  # `--compute-threads` among them, as for `ft serve`
    parser.add_argument("--prefill", type=int, default=0, metavar="N", help="also time one N-token prompt")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=ENGINE_DEFAULTS.kv_cache_dtype,
        help="KV cache element type, as for `ft serve` (default: %(default)s)",
    )
    # NOTE: the old spelling, kept so recorded bench commands still run.
    parser.add_argument("--threads", type=int, dest="compute_threads", help=argparse.SUPPRESS)
    parser.add_argument(
        "--structured",
        action="store_true",
        help="also compare grammar-constrained (JSON schema) against free requests at each level",
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and print its JSON line."""
    trio.run(main, args)
    return 0
