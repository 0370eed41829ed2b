"""Which request to preempt? Victim policies compared on the synchronous core (no model).

    python3 tools/sim_victim_policy.py

Simulates `--requests` chat requests (30-60 prompt tokens, answers of 50-600 tokens, no
max_tokens) arriving at once on a 16-wide engine with a small pool, for three victim policies:
the most recently admitted request (ft's, as vLLM), the one with the fewest computed tokens,
and the one with the most. Each excludes the oldest running request. Prints, averaged over
seeds: steps to finish everything, preemptions, recomputed tokens, tokens fed, and the mean
step of each request's first token.
"""

from __future__ import annotations

import argparse
import random
import statistics

from ft.core.batch import Sampled
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.messages import StepDone
from ft.params import SamplingParams


class ByComputed(Scheduler):
    """Preempt the younger request with the fewest (or most) computed tokens."""

    most = False

    def _pick_victim(self) -> int:
        oldest = next(iter(self.running.values())).uid
        computed: dict[int, int] = {}
        for seq in self.running.values():
            computed[seq.uid] = computed.get(seq.uid, 0) + seq.num_computed
        candidates = [uid for uid in computed if uid != oldest] or [oldest]
        pick = max if self.most else min
        return pick(candidates, key=lambda uid: computed[uid])


class MostComputed(ByComputed):
    most = True


def simulate(cls: type[Scheduler], seed: int, pages: int, requests: int) -> tuple[float, ...]:
    rng = random.Random(seed)
    s = cls(
        PagePool(pages, 16), max_running=16, max_model_len=8192, max_prefill_tokens=512, eos_token_ids=[0]
    )
    lengths: dict[int, int] = {}
    for uid in range(1, requests + 1):
        lengths[uid] = rng.randint(50, 600)
        prompt = [rng.randint(1, 999) for _ in range(rng.randint(30, 60))]
        s.add(uid, prompt, SamplingParams(max_tokens=700))
    steps = fed = 0
    first: dict[int, int] = {}
    while s.has_work:
        batch = s.schedule()
        assert batch is not None
        steps += 1
        fed += sum(len(w.token_ids) for w in batch.works)
        sampled = []
        for w in batch.works:
            if w.sample:
                uid = s.running[w.seq_id].uid
                sampled.append(Sampled(w.seq_id, 0 if w.num_generated + 1 >= lengths[uid] else 5))
                first.setdefault(uid, steps)
        s.on_step_done(batch, StepDone(batch.step, tuple(sampled)))
    return steps, s.num_preemptions, s.num_recomputed_tokens, fed, statistics.fmean(first.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--pages", type=int, nargs="+", default=[120, 200])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    policies: dict[str, type[Scheduler]] = {
        "newest-admitted": Scheduler,
        "fewest-computed": ByComputed,
        "most-computed": MostComputed,
    }
    for pages in args.pages:
        for name, cls in policies.items():
            runs = [simulate(cls, seed, pages, args.requests) for seed in range(args.seeds)]
            mean = [statistics.fmean(r[i] for r in runs) for i in range(5)]
            print(
                f"pages={pages:4d} {name:16s} steps {mean[0]:7.0f}  preemptions {mean[1]:5.0f}  "
                f"recomputed {mean[2]:7.0f}  fed {mean[3]:7.0f}  mean first-token step {mean[4]:6.1f}"
            )


if __name__ == "__main__":
    main()
