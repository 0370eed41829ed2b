"""The sampler: per-row params, stateless seeding, penalties, bias and logprobs."""

from __future__ import annotations

import torch

from ft.core.batch import SeqWork
from ft.model.sampler import sample
from ft.params import SamplingParams

VOCAB = 50


def work(seq_id: int, params: SamplingParams, num_generated: int = 0, history: tuple[int, ...] = (),
         num_prompt_tokens: int = 0) -> SeqWork:  # fmt: skip
    return SeqWork(seq_id, (1,), 0, (0,), True, params, num_generated, history, num_prompt_tokens)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_seeded_tokens_do_not_depend_on_batch_composition() -> None:
    p = SamplingParams(temperature=1.0, seed=1234)
    x = logits(4)
    for step in range(5):
        alone = sample(x[2:3], [work(7, p, step)])[0].token_id
        batch = sample(x, [work(1, SamplingParams(temperature=0.8)), work(2, SamplingParams(temperature=0)),
                           work(7, p, step), work(3, SamplingParams(seed=9, top_p=0.5))])  # fmt: skip
        assert batch[2].token_id == alone


def test_seed_gives_varied_tokens_across_steps_and_seeds() -> None:
    x = torch.zeros(1, VOCAB)  # uniform: draws must differ across steps
    tokens = {sample(x, [work(1, SamplingParams(seed=5), step)])[0].token_id for step in range(20)}
    assert len(tokens) > 5


def test_top_k_one_equals_greedy() -> None:
    x = logits(3)
    greedy = sample(x, [work(i, SamplingParams(temperature=0)) for i in range(3)])
    top1 = sample(x, [work(i, SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(3)])
    assert [s.token_id for s in top1] == [s.token_id for s in greedy] == x.argmax(-1).tolist()


def test_logit_bias_forces_a_token_and_ignores_out_of_vocab_ids() -> None:
    x = logits(1)
    p = SamplingParams(temperature=1.0, logit_bias={13: 100.0, VOCAB + 5: 100.0})
    assert {sample(x, [work(1, p, n)])[0].token_id for n in range(10)} == {13}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 4] = 2.0
    x[0, 9] = 1.9
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(x, [work(1, p, history=(4,), num_prompt_tokens=1)])[0].token_id == 9


def test_frequency_and_presence_penalties_apply_to_output_only() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 4] = 1.0
    x[0, 9] = 0.9
    p = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.1)
    # 4 only in the prompt: no penalty.
    assert sample(x, [work(1, p, history=(4, 4, 9), num_prompt_tokens=2)])[0].token_id == 4
    # 4 in the output: penalised below 9.
    assert sample(x, [work(1, p, history=(9, 4), num_prompt_tokens=1)])[0].token_id == 9


def test_top_logprobs_are_sorted_and_counted() -> None:
    x = logits(2)
    out = sample(x, [work(1, SamplingParams(temperature=0, logprobs=True, top_logprobs=5)),
                     work(2, SamplingParams(temperature=0))])  # fmt: skip
    first = out[0]
    assert len(first.top_logprobs) == 5
    values = [lp for _, lp in first.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert first.top_logprobs[0][0] == first.token_id
    expected = torch.log_softmax(x[0], -1)[first.token_id].item()
    assert abs(first.logprob - expected) < 1e-6  # type: ignore[operator]
    assert out[1].logprob is None and out[1].top_logprobs == ()


def test_top_p_and_min_p_keep_only_likely_tokens() -> None:
    x = torch.full((1, VOCAB), -10.0)
    x[0, 3] = 5.0
    x[0, 8] = 4.5
    for p in (SamplingParams(top_p=0.5, seed=1), SamplingParams(min_p=0.5, seed=1)):
        tokens = {sample(x, [work(1, p, n)])[0].token_id for n in range(30)}
        assert tokens <= {3, 8} and 3 in tokens


def test_vanishing_temperature_is_argmax_not_token_zero() -> None:
    x = torch.tensor([[0.0, 1.0, 3.0, -2.0, 2.9]])
    for t in (1e-40, 1e-300, 1e-6):
        (s,) = sample(x, [work(0, SamplingParams(temperature=t, seed=1))])
        assert s.token_id == 2


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    x = probs.clamp_min(1e-30).log().unsqueeze(0)
    counts = torch.zeros(5)
    trials = 4000
    for step in range(trials):
        (s,) = sample(x, [work(0, SamplingParams(temperature=1.0, seed=7), num_generated=step)])
        counts[s.token_id] += 1
    freq = counts / trials
    assert counts[4] == 0  # zero probability is never drawn
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_nucleus_matches_a_full_sort_even_when_it_is_wide() -> None:
    from ft.model.sampler import _nucleus

    gen = torch.Generator().manual_seed(0)
    for scale, top_p in ((0.01, 0.99), (1.0, 0.9), (8.0, 0.5)):
        x = torch.randn(49152, generator=gen) * scale
        got = torch.isfinite(_nucleus(x, top_p))
        probs = x.softmax(-1)
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) <= top_p
        want = torch.zeros_like(got)
        want[order[keep]] = True
        assert torch.equal(got, want), (scale, top_p, int(got.sum()), int(want.sum()))
