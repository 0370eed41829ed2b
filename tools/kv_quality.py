"""Quality of a narrower KV cache against float16 KV on the packed path (docs/performance.md).

    python3 tools/kv_quality.py                  # default model: 20 prompts x 64 tokens, README
    python3 tools/kv_quality.py --prompts 4 --tokens 8 --text-tokens 64   # a quick smoke check

For each KV kind, on the default model's packed weights (one `TorchRunner` each):

- **greedy agreement**: every prompt decoded greedily for `--tokens` tokens; against float16 KV,
  the tokens before the first difference (summed over prompts) and the outputs identical whole;
- **max |logit diff|**: float16's greedy tokens fed to the other kind (teacher forcing), the
  largest logit difference over the first 8 steps and over all;
- **perplexity** of the first `--text-tokens` tokens of `--text`, fed one token a step.

Kinds: float32, float16, q8_0 (the real kernels), and simulated ones: a float32 cache whose new
slots are rounded to q8_0 or q4_0 (GGUF's Q4_0: 4-bit, a scale per 32) after every step, keys
and values separately (`q8_0-sim`, `q4_0-sim`, `k8v4-sim`: keys q8_0 and values q4_0,
`k4v8-sim`). A token's own KV is unrounded in the step that writes it (only its own position:
the text goes one token a step, the prompts' prefill excepted); `q8_0-sim` against `q8_0` shows
how much that changes. Prints one JSON line per kind.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.loader import LoadedModel, load_model
from ft.model.quantized_llama import StepIndex
from ft.model.runners import build_runner
from ft.params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\n\nx = np.",
    "The theory of relativity states that",
    "Q: What is 12 times 7?\nA:",
    "The best way to learn a new language is",
    "SELECT name FROM users WHERE",
    "In 1969, the first humans",
    "A haiku about the sea:\n",
    "The mitochondria is",
    "Dear hiring manager,\n\nI am writing to",
    "The quick brown fox",
    "Water boils at 100 degrees Celsius because",
    "Here is a list of fruits: apple, banana,",
    "The main causes of the French Revolution were",
    "function add(a, b) {",
    "Photosynthesis is the process by which",
]
PAGE = 16
THREADS = 1  # NOTE: on a shared, oversubscribed machine one thread avoids OpenMP barrier stalls
Rounding = Callable[[torch.Tensor], torch.Tensor]  # float32 [..., 32 * n] -> its rounded values


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded as a q8_0 KV block stores it (the kernel's rounding)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return ((blocks * inv).round().clamp(-127, 127) * d).reshape(x.shape)


def round_q4_0(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded as GGUF's Q4_0 (ggml's quantize_row_q4_0): d = the signed extreme / -8."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = (extreme / -8).half().float()
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = (blocks * inv + 8.5).trunc().clamp(0, 15)
    return ((q - 8) * d).reshape(x.shape)


@dataclass(frozen=True)
class Kind:
    """A KV cache kind: what the runner stores, and how a float32 cache is rounded after a step."""

    name: str
    kv_dtype: kernels.KVDtype
    k_round: Rounding | None = None
    v_round: Rounding | None = None


KINDS = [
    Kind("float32", torch.float32),
    Kind("float16", torch.float16),
    Kind("q8_0", kernels.Q8_0_KV),
    Kind("q8_0-sim", torch.float32, round_q8_0, round_q8_0),
    Kind("q4_0-sim", torch.float32, round_q4_0, round_q4_0),
    Kind("k8v4-sim", torch.float32, round_q8_0, round_q4_0),
    Kind("k4v8-sim", torch.float32, round_q4_0, round_q8_0),
]


class Session:
    """One runner of a kind over pages enough for every prompt (or the text) at once."""

    def __init__(self, loaded: LoadedModel, kind: Kind, num_seqs: int, max_len: int) -> None:
        self.kind = kind
        self.pages_per_seq = -(-max_len // PAGE)
        self.runner = build_runner(
            loaded,
            num_pages=num_seqs * self.pages_per_seq,
            page_size=PAGE,
            dtype=torch.float32,
            kv_dtype=kind.kv_dtype,
            threads=THREADS,
        )

    def pages(self, seq: int) -> tuple[int, ...]:
        return tuple(range(seq * self.pages_per_seq, (seq + 1) * self.pages_per_seq))

    def step(self, feeds: list[tuple[int, tuple[int, ...], int]]) -> torch.Tensor:
        """Feed `(seq, tokens, start)` for each sequence; logits `[S, vocab]` of each last token."""
        greedy = SamplingParams(temperature=0.0)
        works = [SeqWork(s, toks, start, self.pages(s), True, greedy, 0) for s, toks, start in feeds]
        logits = self.runner.forward(works)
        assert logits is not None
        self._round(feeds)
        return logits

    def _round(self, feeds: list[tuple[int, tuple[int, ...], int]]) -> None:
        if self.kind.k_round is None or self.kind.v_round is None:
            return
        slots = [
            self.pages(s)[p // PAGE] * PAGE + p % PAGE for s, t, st in feeds for p in range(st, st + len(t))
        ]
        index = torch.tensor(slots)
        for cache, rounding in (
            (self.runner.k_cache, self.kind.k_round),
            (self.runner.v_cache, self.kind.v_round),
        ):
            cache[:, index] = rounding(cache[:, index])

    def all_logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits after each of `tokens` (sequence 0), fed one token a step → `[N, vocab]`."""
        packed = self.runner.packed
        assert packed is not None
        rows = []
        for p, token in enumerate(tokens):
            slot = self.pages(0)[p // PAGE] * PAGE + p % PAGE
            index = StepIndex(
                slot_of=torch.tensor([slot]),
                seq=torch.tensor([0]),
                positions=torch.tensor([p]),
                block_tables=torch.tensor([self.pages(0)], dtype=torch.int32),
            )
            hidden = packed.forward(
                torch.tensor([token]), index, self.runner.k_cache, self.runner.v_cache, PAGE
            )
            self._round([(0, (token,), p)])
            rows.append(packed.logits(hidden)[0])
        return torch.stack(rows)


def greedy(session: Session, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt decoded greedily for `num_tokens` (all prompts batched, step by step)."""
    logits = session.step([(i, tuple(p), 0) for i, p in enumerate(prompts)])
    out = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(num_tokens - 1):
        logits = session.step(
            [(i, (o[-1],), len(p) + len(o) - 1) for i, (p, o) in enumerate(zip(prompts, out, strict=True))]
        )
        for o, t in zip(out, logits.argmax(-1), strict=True):
            o.append(int(t))
    return out


def forced(session: Session, prompts: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
    """Logits at each step with `outputs` fed (teacher forcing) → per step `[S, vocab]`."""
    steps = [session.step([(i, tuple(p), 0) for i, p in enumerate(prompts)])]
    for k in range(len(outputs[0]) - 1):
        steps.append(
            session.step(
                [(i, (o[k],), len(p) + k) for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
            )
        )
    return steps


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:]))
    return math.exp(float(nll))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--text", default=str(pathlib.Path(__file__).parent.parent / "README.md"))
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--kinds", default=",".join(k.name for k in KINDS))
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(None, torch.float32, quantized=True)
    tokenizer = loaded.tokenizer.build()
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[: args.prompts]]
    text = tokenizer.encode(pathlib.Path(args.text).read_text()).ids[: args.text_tokens]
    max_len = max(len(p) for p in prompts) + args.tokens
    kinds = {k.name: k for k in KINDS}
    chosen = [kinds[name] for name in args.kinds.split(",")]
    with torch.inference_mode():
        base = Session(loaded, kinds["float16"], len(prompts), max_len)
        ref_out = greedy(base, prompts, args.tokens)
        ref_logits = forced(Session(loaded, kinds["float16"], len(prompts), max_len), prompts, ref_out)
        for kind in chosen:
            out = greedy(Session(loaded, kind, len(prompts), max_len), prompts, args.tokens)
            steps = forced(Session(loaded, kind, len(prompts), max_len), prompts, ref_out)
            diffs = [float((a - b).abs().max()) for a, b in zip(steps, ref_logits, strict=True)]
            prefix = sum(
                next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
                for o, r in zip(out, ref_out, strict=True)
            )
            ppl = perplexity(Session(loaded, kind, 1, len(text)).all_logits(text), text)
            print(json.dumps({
                "kind": kind.name,
                "agree_before_first_difference": f"{prefix}/{len(prompts) * args.tokens}",
                "identical_outputs": f"{sum(map(list.__eq__, out, ref_out))}/{len(prompts)}",
                "max_logit_diff_first_8_steps": round(max(diffs[:8]), 4),
                "max_logit_diff_all_steps": round(max(diffs), 4),
                "perplexity": round(ppl, 4),
                "text_tokens": len(text),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
