"""A scored prompt position (prompt logprobs) costs more of a step's prefill budget than a fed
one, so a step that scores does about the work of a plain prefill step."""

from __future__ import annotations

from ft.core.batch import Batch, Sampled, Scored, TokenScore
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.messages import StepDone
from ft.params import SamplingParams

EOS = 0
SCORED = SamplingParams(max_tokens=1, prompt_logprobs=0)


def make(score_cost: float) -> Scheduler:
    return Scheduler(
        PagePool(64, 4),
        max_running=4,
        max_model_len=128,
        max_prefill_tokens=16,
        eos_token_ids=[EOS],
        enable_prefix_caching=False,
        score_cost=score_cost,
    )


def run_step(s: Scheduler) -> Batch:
    """One step, each sampled row given token 7 and each scored position a logprob."""
    batch = s.schedule()
    assert batch is not None
    sampled = tuple(Sampled(w.seq_id, 7) for w in batch.works if w.sample)
    scored = tuple(
        Scored(w.seq_id, tuple(TokenScore(t, -1.0) for t in w.score_ids)) for w in batch.works if w.score_ids
    )
    s.on_step_done(batch, StepDone(batch.step, sampled, scored=scored))
    return batch


def chunks(s: Scheduler, num_steps: int) -> list[list[int]]:
    return [[len(w.token_ids) for w in run_step(s).works] for _ in range(num_steps)]


def test_a_scored_chunk_is_shorter_by_what_scoring_costs() -> None:
    """Scoring as dear as feeding: 8 scored tokens a step where a plain prompt takes 16."""
    s = make(score_cost=1.0)
    s.add(1, list(range(1, 41)), SCORED)  # before: chunks of 16, 16, 8
    assert chunks(s, 5) == [[8]] * 5  # the last: 7 scored positions and the prompt's last
    s.add(2, list(range(1, 41)), SamplingParams(max_tokens=1))
    assert chunks(s, 3) == [[16], [16], [8]]


def test_a_scored_prompt_beside_a_plain_one_shares_the_budget_by_cost() -> None:
    """A 6-token prompt whose 5 scored positions make it cost 11 of the 16: the plain prompt
    beside it gets 5."""
    s = make(score_cost=1.0)
    s.add(1, list(range(1, 7)), SCORED)  # 5 positions scored, the last not: costs 11
    s.add(2, list(range(1, 30)), SamplingParams(max_tokens=1))
    assert chunks(s, 1) == [[6, 5]]


def test_positions_scored_before_a_preemption_cost_a_plain_token_in_the_recompute() -> None:
    """After a preemption the prompt is fed again but what was scored is not scored again:
    those positions cost one token each, the unscored ones after them two."""
    s = make(score_cost=1.0)
    s.add(1, list(range(1, 41)), SCORED)
    assert chunks(s, 2) == [[8], [8]]  # 16 positions scored
    s.preempt(1)
    assert chunks(s, 2) == [[16], [8]]


def test_without_a_score_cost_a_scored_prompt_is_chunked_as_a_plain_one() -> None:
    s = make(score_cost=0.0)
    s.add(1, list(range(1, 41)), SCORED)
    assert chunks(s, 3) == [[16], [16], [8]]
