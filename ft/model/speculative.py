"""Verifying drafted tokens: which drafts the target model accepts, and the token after them.

A work with `num_draft = k` fed its last accepted token and k drafts, so its logits have k + 1
rows: row j is the target's distribution for the token after fed token j. Draft j + 1 is
checked against row j, in order; the first refused draft is replaced by the target's own
token there, and when all k are accepted row k gives one more (the bonus token).

Greedy rows accept a draft iff it is the argmax at its position, so the text is the text
without speculation (the packed kernels give a row the same numbers whatever shares its step).
Sampled rows use speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft x, drawn
from the drafter's distribution q, is accepted with probability min(1, p(x) / q(x)), p the
target's processed distribution; on refusal the token is drawn from the residual max(0, p - q),
renormalized. The token at each position is then distributed as p exactly. An n-gram draft is
deterministic (q is one-hot on x: accept with p(x), else draw from p with x removed); a draft
model's sampled drafts come with their q rows (`draft_probs`). Row j draws from the generator
seeded by `(seed, num_generated + j)`, so a seeded request gives the same tokens again.

Under a grammar each drafted position has its own mask (`StepMasks`), so p is the masked
distribution there: a draft the grammar refuses has p = 0 and is refused, and the token drawn
in its place (the residual, masked too) ends the work's tokens. Drafts past the masks computed
in time are not verified (the work is verified as if it had drafted fewer, which keeps p).
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


def accept_draft(
    probs: torch.Tensor,
    draft: int,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, bool]:
    """Speculative sampling of one position with the draft `draft`, drawn from `draft_probs`.

    Args:
        probs: the target's processed distribution `[vocab]` (sums to 1).
        draft: the drafted token.
        generator: the position's generator (None: the global RNG).
        draft_probs: the distribution `[vocab]` the draft was drawn from; None: one-hot on
            `draft` (a deterministic drafter).

    Returns:
        (the token, whether it is the draft). The token is distributed as `probs`.
    """
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    p_draft = float(probs[draft])
    q_draft = 1.0 if draft_probs is None else float(draft_probs[draft])
    if q_draft <= 0.0:
        raise ValueError(f"draft {draft} has probability 0 under the distribution it was drawn from")
    if u * q_draft < p_draft:  # u < min(1, p / q); never when p(draft) = 0 (a grammar refuses it)
        return draft, True
    residual = probs.double().clone()
    if draft_probs is None:
        residual[draft] = 0.0
    else:
        residual = (residual - draft_probs.double()).clamp_(min=0.0)
    cdf = residual.cumsum(0)
    if float(cdf[-1]) <= 0.0:  # all mass on the draft (u fell on rounding): it is the token
        if p_draft > 0.0:
            return draft, True
        cdf = probs.double().cumsum(0)  # q's mass lost to rounding: draw from p itself
    v = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    token = min(int(torch.searchsorted(cdf, v, side="right")), probs.numel() - 1)
    return token, False


def verify(
    logits: torch.Tensor,
    work: SeqWork,
    draft_probs: torch.Tensor | None = None,
    num_verified: int | None = None,
) -> list[Sampled]:
    """The accepted drafts of `work` and the token after them, from its logits `[k + 1, vocab]`;
    `draft_probs` `[k, vocab]`: the distributions its drafts were drawn from (None: one-hot).
    `num_verified`: verify only the first drafts (those a grammar's masks cover)."""
    p = work.params
    k = work.num_draft if num_verified is None else min(num_verified, work.num_draft)
    drafts = work.token_ids[len(work.token_ids) - work.num_draft :][:k]
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
                q = draft_probs[j] if draft_probs is not None else None
                token, _ = accept_draft(probs, draft, generator, q)
        out.append(sampled_token(work.seq_id, token, x, p))
        if token != draft:
            break
    return out


def sample_with_drafts(
    logits: torch.Tensor,
    works: list[SeqWork],
    masks: StepMasks | None,
    draft_probs: dict[int, torch.Tensor] | None = None,
) -> list[list[Sampled]]:
    """Each sampling work's tokens, in order, from `logits` `[sum(1 + num_draft), vocab]`.

    Works without drafts are sampled together as in a plain step; grammar masks go on each
    constrained work's rows, one per position its masks cover. `draft_probs` maps a seq id to
    the `[k, vocab]` distributions its sampled drafts were drawn from (absent: one-hot drafts).
    """
    first: list[int] = []  # each work's first logits row
    row = 0
    for work in works:
        first.append(row)
        row += 1 + work.num_draft
    if masks is not None:
        masks.apply(logits, first)
    plain = [i for i, w in enumerate(works) if not w.num_draft]
    plain_sampled = iter(
        sample(logits[[first[i] for i in plain]], [works[i] for i in plain]) if plain else []
    )
    out: list[list[Sampled]] = []
    for i, work in enumerate(works):
        if work.num_draft:
            q = (draft_probs or {}).get(work.seq_id)
            k = work.num_draft if masks is None else masks.num_verifiable(i, work.num_draft)
            out.append(verify(logits[first[i] : first[i] + 1 + k], work, q, k))
        else:
            out.append([next(plain_sampled)])
    return out
