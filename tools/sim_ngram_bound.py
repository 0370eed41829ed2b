"""How far can n-gram speculation take one stream? Measured outputs replayed under draft policies.

    python3 tools/sim_ngram_bound.py [--model PATH] [--requests 8] [--max-tokens 128]

Runs the default model (or `--model`) over `../shared/bench/prompts.py`'s edit prompts as
`side_by_side.py --cells c1e` does (greedy, EOS banned, `--max-tokens` each, one at a time)
with `--speculative-method ngram`, recording the engine's own decode-step times by rows fed
(`StepCosts`). It then replays those exact outputs through `NgramIndex`/`DraftLength` under a
grid of policies (most drafted tokens, shortest n-gram), with every step
costing the measured t(1 + drafts), and prints the speed-up each policy gives over the same
outputs decoded one token a step. The replay ignores the cost gate, so it is an upper bound
for the policy: what acceptance and the step's cost curve allow, before any gate or overhead.
Last, `hindsight`'s bound for any drafter that copies from earlier in the context.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from ft import EngineConfig, EngineHooks, PromptSpec, SamplingParams, open_engine
from ft.core.ngram import DraftLength, NgramIndex
from ft.core.spec_cost import StepCosts

BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "bench"


@dataclass(frozen=True, slots=True)
class Replay:
    """One policy's replay over every output."""

    steps: int
    verifications: int
    drafted: int
    accepted: int
    seconds: float


Outputs = list[list[int]]


async def measure(
    model: str | None, num_requests: int, max_tokens: int
) -> tuple[Outputs, Outputs, StepCosts]:
    """The edit prompts' ids, their greedy outputs and the measured step costs."""
    sys.path.insert(0, str(BENCH))
    import prompts  # ../shared/bench/prompts.py

    costs = StepCosts()
    config = EngineConfig(model=model, speculative_method="ngram")
    prompt_ids, outputs = [], []
    async with open_engine(config, hooks=EngineHooks(step_costs=lambda: costs)) as engine:
        for text in prompts.EDIT_PROMPTS[:num_requests]:
            # side_by_side.py's ban: ids 0 and 2 (the default vocabulary's end tokens)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias={0: -100.0, 2: -100.0})
            spec = PromptSpec(messages=prompts.chat_messages(text))
            async with engine.open_request(spec, params=params) as stream:
                tokens = [t async for delta in stream for t in delta.token_ids]
                prompt_ids.append(list(stream.prompt_ids))
                outputs.append(tokens)
    return prompt_ids, outputs, costs


def replay(
    prompts: list[list[int]], outputs: list[list[int]], step_s: dict[int, float], max_tokens: int, min_n: int
) -> Replay:  # fmt: skip
    """Every output decoded under one draft policy, each step costing `step_s[rows]`."""
    steps = verifications = drafted = accepted = 0
    seconds = 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        index = NgramIndex(max_n=max(3, min_n), min_n=min_n)
        index.extend([*prompt, output[0]])
        length = DraftLength(max_tokens)
        known = 1
        while known < len(output):
            proposal = index.propose(length.current)
            hits = 0
            while (
                hits < len(proposal) and known + hits < len(output) and proposal[hits] == output[known + hits]
            ):
                hits += 1
            if proposal:
                length.update(len(proposal), hits)
                verifications += 1
                drafted += len(proposal)
                accepted += hits
            gained = min(hits + 1, len(output) - known)
            index.extend(output[known : known + gained])
            known += gained
            steps += 1
            seconds += step_s[1 + len(proposal)]
    return Replay(steps, verifications, drafted, accepted, seconds)


def hindsight(
    prompts: list[list[int]], outputs: list[list[int]], step_s: dict[int, float], max_tokens: int, min_n: int
) -> Replay:  # fmt: skip
    """The bound no lookup drafter passes: each step drafts, from whichever earlier occurrence
    of the last `min_n` tokens continues the output furthest, exactly the tokens that will be
    accepted (up to `max_tokens`; knowing which occurrence and where to stop takes the future)."""
    steps = accepted = 0
    seconds = 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        context = [*prompt, output[0]]
        known = 1
        while known < len(output):
            best = 0
            tail = context[-min_n:]
            for start in range(min_n, len(context)):
                if context[start - min_n : start] != tail:
                    continue
                hits = 0
                while (
                    hits < max_tokens
                    and known + hits < len(output)
                    and start + hits < len(context)
                    and context[start + hits] == output[known + hits]
                ):
                    hits += 1
                best = max(best, hits)
            gained = min(best + 1, len(output) - known)
            context += output[known : known + gained]
            known += gained
            steps += 1
            accepted += best
            seconds += step_s[1 + best]
    return Replay(steps, steps, accepted, accepted, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompt_ids, outputs, costs = trio.run(measure, args.model, args.requests, args.max_tokens)
    measured = {rows: costs.estimate(rows) for rows in range(1, 18)}
    step_s = {rows: s for rows, s in measured.items() if s is not None}
    print("measured step ms by rows:", {rows: round(s * 1e3, 2) for rows, s in step_s.items()})
    widest = max(step_s)  # past it, the measured slope carries on
    slope = (step_s[widest] - step_s[1]) / max(1, widest - 1)
    for rows in range(widest + 1, 18):
        step_s[rows] = step_s[widest] + (rows - widest) * slope
    plain = sum(len(output) - 1 for output in outputs) * step_s[1]
    for max_tokens in (4, 8, 16):
        for min_n in (1, 2, 3):
            r = replay(prompt_ids, outputs, step_s, max_tokens, min_n)
            print(
                f"max {max_tokens:2d} min_n {min_n}: steps {r.steps} verifications "
                f"{r.verifications} drafted {r.drafted} accepted {r.accepted} -> {plain / r.seconds:.2f}x"
            )
    for min_n in (1, 2, 3):
        r = hindsight(prompt_ids, outputs, step_s, 8, min_n)
        print(
            f"hindsight bound, max 8, the last {min_n} token(s) matched: steps {r.steps} "
            f"accepted {r.accepted} -> {plain / r.seconds:.2f}x"
        )


if __name__ == "__main__":
    main()
