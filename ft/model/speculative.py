"""Verifying drafted tokens: which drafts the target model accepts, and the token after them.

A work with `num_draft = k` fed its last accepted token and k drafts, so its logits have k + 1
rows: row j is the target's distribution for the token after fed token j. Draft j + 1 is
checked against row j, in order; the first refused draft is replaced by the target's own
token there, and when all k are accepted row k gives one more (the bonus token).

Greedy rows accept a draft iff it is the argmax at its position, so the text is the text
without speculation (the packed kernels give a row the same numbers whatever shares its step).
Sampled rows use speculative sampling for a one-hot draft (Leviathan et al. 2023; Chen et al.
2023): accept draft x with probability p(x), the target's processed probability; on refusal
draw from p with x removed, renormalized. The token at each position is then distributed as p
exactly. Row j draws from the generator seeded by `(seed, num_generated + j)`, so a seeded
request gives the same tokens again.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ft.core.batch import Sampled, SeqWork
from ft.model.masks import StepMasks
from ft.model.sampler import (
    apply_logit_bias,
    apply_penalties,
    filter_logits,
    row_generator,
    sample,
    sampled_token,
)


def accept_draft(probs: torch.Tensor, draft: int, generator: torch.Generator | None) -> tuple[int, bool]:
    """Speculative sampling of one position with the one-hot draft `draft`.

    Args:
        probs: the target's processed distribution `[vocab]` (sums to 1).
        draft: the drafted token.
        generator: the position's generator (None: the global RNG).

    Returns:
        (the token, whether it is the draft). The token is distributed as `probs`.
    """
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    p_draft = float(probs[draft])
    if u < p_draft:
        return draft, True
    residual = probs.double().clone()
    residual[draft] = 0.0
    cdf = residual.cumsum(0)
    if float(cdf[-1]) <= 0.0:  # all mass on the draft (u fell on rounding): it is the token
        return draft, True
    v = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    token = min(int(torch.searchsorted(cdf, v, side="right")), probs.numel() - 1)
    return token, False


def verify(logits: torch.Tensor, work: SeqWork) -> list[Sampled]:
    """The accepted drafts of `work` and the token after them, from its logits `[k + 1, vocab]`."""
    p = work.params
    k = work.num_draft
    drafts = work.token_ids[len(work.token_ids) - k :]
    rows = logits.float()
    out: list[Sampled] = []
    for j in range(k + 1):
        x = rows[j]  # [vocab]
        draft = drafts[j] if j < k else None
        if p.logit_bias or p.uses_penalties:
            # As `sample` does, with the drafts before this row counted as output (they are,
            # when this row is reached).
            x = x.clone()
            apply_logit_bias(x, p.logit_bias)
            apply_penalties(x, replace(work, history=work.history + drafts[:j]) if j else work)
        if p.is_greedy:
            token = int(x.argmax())
        else:
            generator = row_generator(p.seed, work.num_generated + j)
            probs = filter_logits(x, p).softmax(-1)
            if draft is None:
                cdf = probs.cumsum(0)
                u = torch.rand(1, generator=generator, dtype=cdf.dtype) * cdf[-1]
                token = min(int(torch.searchsorted(cdf, u, side="right")), probs.numel() - 1)
            else:
                token, _ = accept_draft(probs, draft, generator)
        out.append(sampled_token(work.seq_id, token, x, p))
        if token != draft:
            break
    return out


def sample_with_drafts(
    logits: torch.Tensor, works: list[SeqWork], masks: StepMasks | None
) -> list[list[Sampled]]:
    """Each sampling work's tokens, in order, from `logits` `[sum(1 + num_draft), vocab]`.

    Works without drafts are sampled together as in a plain step; grammar masks (only works
    without drafts carry one) go on their rows.
    """
    first: list[int] = []  # each work's first logits row
    row = 0
    for work in works:
        first.append(row)
        row += 1 + work.num_draft
    if masks is not None:
        index = torch.tensor(first, device=logits.device)
        own = logits[index]  # [R, vocab], a copy
        masks.apply(own)
        logits[index] = own
    plain = [i for i, w in enumerate(works) if not w.num_draft]
    plain_sampled = iter(
        sample(logits[[first[i] for i in plain]], [works[i] for i in plain]) if plain else []
    )
    out: list[list[Sampled]] = []
    for i, work in enumerate(works):
        if work.num_draft:
            out.append(verify(logits[first[i] : first[i] + 1 + work.num_draft], work))
        else:
            out.append([next(plain_sampled)])
    return out
