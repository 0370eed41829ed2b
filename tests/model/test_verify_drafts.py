"""Verifying drafts: greedy rows give the tokens of plain decoding, sampled rows keep the target
distribution (speculative sampling with the residual), measured over many seeded draws."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ft.core.batch import Sampled, SeqWork
from ft.model.sampler import filter_logits, row_generator, sample
from ft.model.speculative import accept_draft, verify
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.model.test_runner import GREEDY, PROMPT_A, PROMPT_B, generate, make_runner

DRAWS = 20_000
# The chi-square critical value at p = 1e-4 for `dof` degrees of freedom (Wilson-Hilferty): the
# seeds are fixed, so a pass is not luck that changes between runs; a wrong residual (e.g. the
# draft's mass left in, or the rejected token sampled again) is off by hundreds.
CHI2_1E4 = {3: 21.1, 4: 23.5, 5: 25.7, 6: 27.9, 7: 29.9}


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    stat = 0.0
    for c, p in zip(counts, probs, strict=True):
        if p == 0.0:
            assert c == 0, "a token of probability 0 was drawn"
            continue
        stat += (c - total * p) ** 2 / (total * p)
    return stat


TARGET = [0.30, 0.25, 0.20, 0.15, 0.07, 0.03, 0.0]


@pytest.mark.parametrize("draft", [0, 1, 5, 6], ids=["likeliest", "likely", "rare", "impossible"])
def test_accept_and_residual_sampling_keeps_the_target_distribution(draft: int) -> None:
    probs = torch.tensor(TARGET, dtype=torch.float32)
    counts = [0] * len(TARGET)
    accepted = 0
    for i in range(DRAWS):
        g = torch.Generator()
        g.manual_seed(i)
        token, is_draft = accept_draft(probs, draft, g)
        counts[token] += 1
        accepted += is_draft
        assert is_draft == (token == draft)
    support = sum(p > 0 for p in TARGET)
    assert chi_square(counts, TARGET) < CHI2_1E4[support - 1]
    # The draft is kept with probability p(draft): within 5 standard deviations.
    p = TARGET[draft]
    assert abs(accepted / DRAWS - p) <= 5 * (p * (1 - p) / DRAWS) ** 0.5 + 1e-9


def test_accept_draft_with_all_mass_on_the_draft_always_keeps_it() -> None:
    probs = torch.tensor([0.0, 1.0, 0.0])
    for i in range(200):
        g = torch.Generator()
        g.manual_seed(i)
        assert accept_draft(probs, 1, g) == (1, True)


def test_seeded_acceptance_is_reproducible() -> None:
    probs = torch.tensor(TARGET)
    draws = [accept_draft(probs, 2, row_generator(99, k)) for k in range(50)]
    assert draws == [accept_draft(probs, 2, row_generator(99, k)) for k in range(50)]


def test_verified_tokens_follow_the_processed_distribution_at_each_position() -> None:
    """Through `verify`: temperature, top-k and logit_bias shape the distribution drafts are
    judged against; the first token is distributed as it, and so is the second given the first."""
    torch.manual_seed(0)
    logits = torch.randn(2, 9) * 1.5  # [k + 1, vocab], one draft
    params = SamplingParams(temperature=0.7, top_k=6, logit_bias={3: 1.0})
    biased = logits.clone()
    biased[:, 3] += 1.0
    target = [filter_logits(biased[j], params).softmax(-1).tolist() for j in range(2)]
    draft = int(torch.tensor(target[0]).argsort()[-2])  # the second likeliest: often refused
    first = [0] * 9
    second = [0] * 9
    for seed in range(DRAWS):
        work = SeqWork(0, (1, draft), 10, (0,), True, SamplingParams(**{**vars_of(params), "seed": seed}), 0,
                       num_draft=1)  # fmt: skip
        out = verify(logits, work)
        first[out[0].token_id] += 1
        if out[0].token_id == draft:
            assert len(out) == 2  # accepted: the bonus token from the last row
            second[out[1].token_id] += 1
        else:
            assert len(out) == 1
    dof = sum(p > 0 for p in target[0]) - 1
    assert chi_square(first, target[0]) < CHI2_1E4[dof]
    assert chi_square(second, target[1]) < CHI2_1E4[sum(p > 0 for p in target[1]) - 1]


def vars_of(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_greedy_verification_accepts_exactly_the_argmax_prefix() -> None:
    logits = torch.full((4, 8), -1.0)
    for row, best in enumerate([3, 5, 1, 7]):
        logits[row, best] = 2.0
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)

    def tokens(drafts: tuple[int, ...]) -> list[int]:
        out = verify(logits[: len(drafts) + 1], SeqWork(4, (9, *drafts), 0, (0,), True, params, 0,
                                                        num_draft=len(drafts)))  # fmt: skip
        assert all(s.logprob is not None and len(s.top_logprobs) == 2 for s in out)
        return [s.token_id for s in out]

    assert tokens((3, 5, 1)) == [3, 5, 1, 7]  # all accepted, then the bonus
    assert tokens((3, 4, 1)) == [3, 5]  # the second refused: the argmax there instead
    assert tokens((0, 5, 1)) == [3]
    assert tokens(()) == [3]


# --- the real runner on a tiny random model --------------------------------------------------


def speculative_generate(
    runner: TorchRunner,
    prompt: tuple[int, ...],
    pages: tuple[int, ...],
    plan: list[list[int]],
    params: SamplingParams = GREEDY,
) -> list[Sampled]:
    """Greedy decoding where step i feeds the drafts `plan[i]` after the last token, rolling
    back (by position) whatever the model refused."""
    first = runner.step([SeqWork(0, prompt, 0, pages, True, params, 0)])
    out = [s for s in first if isinstance(s, Sampled)]
    for drafts in plan:
        pos = len(prompt) + len(out) - 1
        work = SeqWork(0, (out[-1].token_id, *drafts), pos, pages, True, params, len(out),
                       num_draft=len(drafts))  # fmt: skip
        got = [s for s in runner.step([work]) if isinstance(s, Sampled)]
        assert 1 <= len(got) <= len(drafts) + 1
        out += got
    return out


def test_runner_greedy_with_drafts_gives_the_plain_tokens_and_logprobs(tiny_dir: pathlib.Path) -> None:
    pages = tuple(range(12))
    plain, _ = generate(make_runner(tiny_dir), PROMPT_A, pages, 14)
    # Right drafts, wrong ones and mixed, fed where they belong (each plan built from the plain
    # output, so the right ones are accepted and the wrong ones refused).
    runner = make_runner(tiny_dir)
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    out: list[Sampled] = list(speculative_generate(runner, PROMPT_A, pages, [], params))
    schedule = [(3, 0), (2, 1), (4, 4), (1, 0), (3, 2)]  # (drafts fed, how many of them right)
    for fed, right in schedule:
        n = len(out)
        drafts = plain[n : n + right] + [(t + 1) % 96 for t in plain[n + right : n + fed]]
        pos = len(PROMPT_A) + n - 1
        work = SeqWork(0, (out[-1].token_id, *drafts), pos, pages, True, params, n, num_draft=len(drafts))
        got = [s for s in runner.step([work]) if isinstance(s, Sampled)]
        expected = min(right, len(plain) - n) + 1
        assert len(got) == expected
        out += got
    assert [s.token_id for s in out] == plain[: len(out)]
    # The logprobs of each accepted token are those of the plain step at its position.
    reference = make_runner(tiny_dir)
    ref = speculative_generate(reference, PROMPT_A, pages, [[]] * (len(out) - 1), params)
    for mine, theirs in zip(out, ref, strict=True):
        assert mine.token_id == theirs.token_id
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top_logprobs] == [t for t, _ in theirs.top_logprobs]


def test_a_verify_row_shares_its_step_with_other_rows(tiny_dir: pathlib.Path) -> None:
    """A draft work beside a plain decode and a prefill chunk: each gets its own tokens."""
    pages_a, pages_b, pages_c = tuple(range(0, 8)), tuple(range(8, 16)), tuple(range(16, 20))
    plain_a, _ = generate(make_runner(tiny_dir), PROMPT_A, pages_a, 6)
    prompt_b = PROMPT_A[:7]
    plain_b, _ = generate(make_runner(tiny_dir), prompt_b, pages_b, 2)
    runner = make_runner(tiny_dir)
    first = runner.step([SeqWork(1, PROMPT_A, 0, pages_a, True, GREEDY, 0)])
    assert first[0].token_id == plain_a[0]
    got = runner.step([
        SeqWork(3, PROMPT_B[:4], 0, pages_c, False, GREEDY, 0),
        SeqWork(1, (plain_a[0], *plain_a[1:4]), len(PROMPT_A), pages_a, True, GREEDY, 1, num_draft=3),
        SeqWork(2, prompt_b, 0, pages_b, True, GREEDY, 0),
    ])  # fmt: skip
    assert [(s.seq_id, s.token_id) for s in got if isinstance(s, Sampled)] == [
        *((1, t) for t in plain_a[1:5]),
        (2, plain_b[0]),
    ]


@pytest.mark.parametrize(
    "knobs",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5}, {"repetition_penalty": 3.0}],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_count_the_drafts_before_each_row(knobs: dict[str, float]) -> None:
    """Each row is penalized as plain decoding would penalize it: with the drafts before it
    counted as output. The same logits at every row: 3 is best until it has been produced."""
    row = torch.tensor([0.0, 0.1, 0.2, 2.0, 0.3, 1.5, 0.4, 0.5])
    logits = row.repeat(4, 1)  # [k + 1, vocab]
    params = SamplingParams(temperature=0.0, logprobs=True, **knobs)
    prompt = (1, 2)
    drafts = (3, 5, 3)

    # Plain decoding: one position at a time, the history growing by each token.
    plain: list[Sampled] = []
    history = list(prompt)
    for j in range(4):
        work = SeqWork(
            0, (history[-1],), len(history) - 1, (0,), True, params, j, tuple(history), len(prompt)
        )
        (s,) = sample(row[None].clone(), [work])
        plain.append(s)
        history.append(s.token_id)
    assert [s.token_id for s in plain][:2] == [3, 5]  # the penalty moved the second token

    work = SeqWork(0, (2, *drafts), 1, (0,), True, params, 0, prompt, len(prompt), num_draft=3)
    got = verify(logits, work)
    n = len(got)
    assert [s.token_id for s in got] == [s.token_id for s in plain[:n]]
    assert [s.logprob for s in got] == pytest.approx([s.logprob for s in plain[:n]])
    assert n >= 2  # 3 and 5 were right


# A draft model's distributions: near the target, far from it, and one that puts mass where the
# target has none and none on some of the target's tokens (the residual must supply those).
DRAFTS_Q = {
    "close": [0.28, 0.27, 0.18, 0.15, 0.08, 0.04, 0.0],
    "far": [0.02, 0.03, 0.05, 0.10, 0.20, 0.30, 0.30],
    "disjoint": [0.0, 0.5, 0.0, 0.0, 0.0, 0.2, 0.3],
}


@pytest.mark.parametrize("name", list(DRAFTS_Q))
def test_sampled_drafts_with_their_distribution_keep_the_target_distribution(name: str) -> None:
    """Draft x drawn from q, accepted with min(1, p(x)/q(x)), else the residual max(0, p - q):
    the token is distributed as p, and accepted with probability sum(min(p, q))."""
    probs = torch.tensor(TARGET, dtype=torch.float64)
    q = torch.tensor(DRAFTS_Q[name], dtype=torch.float64)
    counts = [0] * len(TARGET)
    accepted = 0
    for i in range(DRAWS):
        g = torch.Generator()
        g.manual_seed(i)
        draft = int(torch.multinomial(q, 1, generator=g))
        token, is_draft = accept_draft(probs.float(), draft, g, q)
        counts[token] += 1
        accepted += is_draft
        assert is_draft == (token == draft)
    support = sum(p > 0 for p in TARGET)
    assert chi_square(counts, TARGET) < CHI2_1E4[support - 1]
    rate = float(torch.minimum(probs, q).sum())
    assert abs(accepted / DRAWS - rate) <= 5 * (rate * (1 - rate) / DRAWS) ** 0.5


def test_a_draft_the_drafters_distribution_could_not_give_is_refused_loudly() -> None:
    probs = torch.tensor(TARGET)
    with pytest.raises(ValueError, match="probability 0"):
        accept_draft(probs, 0, None, torch.tensor(DRAFTS_Q["disjoint"]))


def test_verify_uses_each_positions_draft_distribution() -> None:
    """Through `verify` with two sampled drafts: the first and, given it, the second token
    follow the target's processed rows whatever q was."""
    torch.manual_seed(1)
    logits = torch.randn(3, 7) * 1.2  # [k + 1, vocab], two drafts
    params = SamplingParams(temperature=0.9)
    target = [filter_logits(logits[j], params).softmax(-1).tolist() for j in range(3)]
    q = torch.tensor([DRAFTS_Q["far"], DRAFTS_Q["close"]], dtype=torch.float64)
    first, second = [0] * 7, [0] * 7
    for seed in range(DRAWS):
        g = torch.Generator()
        g.manual_seed(10_000_000 + seed)
        drafts = tuple(int(torch.multinomial(q[j], 1, generator=g)) for j in range(2))
        seeded = SamplingParams(**{**vars_of(params), "seed": seed})
        work = SeqWork(0, (1, *drafts), 10, (0,), True, seeded, 0, num_draft=2)
        out = verify(logits, work, q)
        first[out[0].token_id] += 1
        if out[0].token_id == drafts[0]:
            second[out[1].token_id] += 1
    assert chi_square(first, target[0]) < CHI2_1E4[6]
    assert chi_square(second, target[1]) < CHI2_1E4[6]
