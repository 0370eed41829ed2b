"""Per-row sampling for a batch whose rows each carry their own `SamplingParams`.

Logprobs are those of the model's distribution after `logit_bias` and the penalties, before
temperature, top-k, top-p and min-p (the distribution the sampling knobs then reshape): a greedy
and a sampled request report the same numbers for the same tokens.

Seeded rows are stateless: the generator of a row is seeded from `(seed, num_generated)`, so a
request's tokens depend only on its logits, its params and how far it has got, never on what
else shares the batch or on earlier steps' random draws.
"""

from __future__ import annotations

import torch

from ft.core.batch import Sampled, SeqWork, TokenScore
from ft.params import SamplingParams, mix_seed

_SEED_MASK = (1 << 63) - 1


def row_generator(seed: int | None, num_generated: int) -> torch.Generator | None:
    """A generator seeded from `(seed, num_generated)`; None (global RNG) when unseeded."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(mix_seed(seed, num_generated) & _SEED_MASK)
    return g


def _needs_row_work(p: SamplingParams) -> bool:
    return not p.is_greedy or p.logprobs or bool(p.logit_bias) or p.uses_penalties


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """Add each bias in place; ids outside the vocabulary are ignored."""
    vocab = logits.shape[-1]
    items = [(i, b) for i, b in bias.items() if i < vocab]
    if items:
        ids = torch.tensor([i for i, _ in items], dtype=torch.long, device=logits.device)
        bias_values = torch.tensor([b for _, b in items], dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids, bias_values)


def apply_penalties(logits: torch.Tensor, work: SeqWork) -> None:
    """Repetition (HF, over prompt + output) and frequency/presence (OpenAI, over output) in place."""
    p = work.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0 and work.history:
        ids = torch.tensor(
            sorted({i for i in work.history if i < vocab}), dtype=torch.long, device=logits.device
        )
        score = logits[ids]
        logits[ids] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        output = [i for i in work.history[work.num_prompt_tokens :] if i < vocab]
        if output:
            ids = torch.tensor(output, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
            logits -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty


TOP_P_CANDIDATES = 512  # first guess at the nucleus size; grown when the nucleus is larger


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (masked entries become -inf)."""
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        x = _nucleus(x, p.top_p)
    if p.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose mass above them is at most `top_p` (the first always).

    NOTE: a full sort of a 49k vocabulary costs ~5 ms a row here; the nucleus is almost always
    within the top few hundred tokens, so look there first and widen only when it is not.
    """
    probs = x.softmax(-1)
    k = min(TOP_P_CANDIDATES, probs.numel())
    while True:
        top, order = torch.topk(probs, k)
        cum = top.cumsum(0)
        if cum[-1] > top_p or k == probs.numel():
            break
        k = min(k * 8, probs.numel())
    keep = order[(cum - top) <= top_p]
    keep = keep if keep.numel() else order[:1]
    out = torch.full_like(x, float("-inf"))
    out[keep] = x[keep]
    return out


def sample_token(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from the filtered distribution by inverse CDF with one uniform number.

    NOTE: one uniform and a cumsum cost ~0.1 ms a row; exponential noise over the vocabulary
    (Gumbel-max) cost 1.3 ms.
    """
    probs = filter_logits(logits, p).softmax(-1)
    cdf = probs.cumsum(0)
    # NOTE: row generators live on the CPU (seeded per row and step); one number crosses over.
    u = torch.rand(1, generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[-1]
    # side="right": the first index whose cdf exceeds u, which has non-zero probability.
    return min(int(torch.searchsorted(cdf, u, side="right")), probs.numel() - 1)


def sample(logits: torch.Tensor, works: list[SeqWork]) -> list[Sampled]:
    """One `Sampled` per row of `logits` `[R, vocab]`, row i following `works[i].params`."""
    if not any(_needs_row_work(w.params) for w in works):
        ids = logits.argmax(-1).tolist()
        return [Sampled(w.seq_id, int(t)) for w, t in zip(works, ids, strict=True)]
    logits = logits.float()
    out: list[Sampled] = []
    for row, work in enumerate(works):
        p = work.params
        x = logits[row]  # [vocab]
        if p.logit_bias or p.uses_penalties:
            x = x.clone()
            apply_logit_bias(x, p.logit_bias)
            apply_penalties(x, work)
        if p.is_greedy:
            token = int(x.argmax())
        else:
            token = sample_token(x, p, row_generator(p.seed, work.num_generated))
        out.append(sampled_token(work.seq_id, token, x, p))
    return out


def sampled_token(seq_id: int, token: int, x: torch.Tensor, p: SamplingParams) -> Sampled:
    """The `Sampled` of `token` drawn from the processed logits `x` `[vocab]` (float32), with
    its logprob and top alternatives when `p` asks for them."""
    if not p.logprobs:
        return Sampled(seq_id, token)
    logprobs = x.log_softmax(-1)
    top: tuple[tuple[int, float], ...] = ()
    if p.top_logprobs:
        best = torch.topk(logprobs, p.top_logprobs)
        top = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return Sampled(seq_id, token, float(logprobs[token]), top)


def score_tokens(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenScore]:
    """Each target's logprob under its row of `logits` `[S, vocab]`, with the `top` best.

    Prompt logprobs are the model's own distribution: no bias, penalty or temperature applies
    to a prompt (vLLM's prompt logprobs are the raw ones too).
    """
    logprobs = logits.float().log_softmax(-1)  # [S, vocab]
    ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    if not top:
        return [TokenScore(t, lp) for t, lp in zip(targets, chosen, strict=True)]
    best = torch.topk(logprobs, top, dim=-1)
    return [
        TokenScore(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(targets, chosen, best.indices.tolist(), best.values.tolist(), strict=True)
    ]
