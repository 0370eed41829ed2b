"""Draft-model speculative decoding: a smaller model with the target's tokenizer drafts tokens
that the target verifies in its ordinary step.

`SpeculativeRunner` is the `Runner` the engine sees: for each work with `num_model_draft > 0`
its `DraftModel` drafts that many tokens after the work's last one (greedy requests take the
draft model's argmax; sampled ones draw from its processed distribution q, kept for the
residual), then the target runs the works with the drafts appended as `num_draft` drafts, and
`ft.model.speculative` accepts or refuses them. The output is the target's: greedy text is
the text without speculation, sampled text keeps the target's distribution.

The draft model's KV cache has the target's pages and slots (a second `TorchRunner` over the
same `num_pages` and `page_size`), so a sequence's pages hold both models' KV and the
scheduler frees both at once (finish, abort, preemption). The scheduler tracks how far the
draft's KV is valid (`Sequence.num_draft_computed`) and feeds it what it lacks (`draft_feed`):
prefill chunks are mirrored, a refused draft's KV is past the valid length and overwritten
next step; a prefix-cache hit keeps the draft's KV of the cached pages it was fed
(`PagePool.mark_drafted`). A draft's KV only ever changes which tokens are proposed, never the
output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ft.core.batch import SeqWork, StepOutput
from ft.model.plan import ConfigError
from ft.model.sampler import apply_logit_bias, filter_logits, row_generator
from ft.model.torch_runner import TorchRunner
from ft.params import mix_seed
from ft.tokenizer.spec import TokenizerSpec

# Salt of the draft model's sampling generators: a seeded request's drafts are reproducible
# and drawn apart from the target's verification draws.
DRAFT_SEED_SALT = 0x5EED_D2AF
# Ids compared at each end of the vocabulary when checking that two tokenizers agree.
CHECKED_END_IDS = 64


class TokenizerMismatch(ConfigError):
    """The draft model's tokenizer is not the target's: its drafts would be other tokens."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the draft model's tokenizer is not the target's: {why}")


def check_same_tokenizer(
    target: TokenizerSpec, draft: TokenizerSpec, target_vocab: int, draft_vocab: int
) -> None:
    """Refuse a draft model whose tokens are not the target's.

    Compared: the embedding rows, the tokenizers' vocabulary sizes, the token strings of the
    first and last `CHECKED_END_IDS` ids, the added (special) tokens, bos/eos and the eos ids.

    Raises:
        TokenizerMismatch: naming the first difference.
    """
    if target_vocab != draft_vocab:
        raise TokenizerMismatch(
            f"the draft model has {draft_vocab} vocabulary rows, the target {target_vocab}"
        )
    a, b = target.build(), draft.build()
    size_a, size_b = a.get_vocab_size(with_added_tokens=True), b.get_vocab_size(with_added_tokens=True)
    if size_a != size_b:
        raise TokenizerMismatch(f"the draft tokenizer has {size_b} tokens, the target's {size_a}")
    ids = [*range(min(CHECKED_END_IDS, size_a)), *range(max(0, size_a - CHECKED_END_IDS), size_a)]
    for i in ids:
        if a.id_to_token(i) != b.id_to_token(i):
            raise TokenizerMismatch(
                f"token {i} is {b.id_to_token(i)!r} for the draft model, {a.id_to_token(i)!r} for the target"
            )
    added_a = {i: t.content for i, t in a.get_added_tokens_decoder().items()}
    added_b = {i: t.content for i, t in b.get_added_tokens_decoder().items()}
    if added_a != added_b:
        differ = sorted(set(added_a.items()) ^ set(added_b.items()))[:3]
        raise TokenizerMismatch(f"the special tokens differ: {differ}")
    for name in ("bos_token", "eos_token", "eos_token_ids"):
        if getattr(target, name) != getattr(draft, name):
            mine, theirs = getattr(draft, name), getattr(target, name)
            raise TokenizerMismatch(f"{name} is {mine!r} for the draft model, {theirs!r} for the target")


def check_tokenizer_files(target: str | None, draft: str) -> None:
    """`check_same_tokenizer` on the two models' files (None: the default model), before any
    weight of either is read.

    Raises:
        TokenizerMismatch: naming the first difference.
    """
    from ft.model.loader import read_tokenizer

    target_spec, target_vocab = read_tokenizer(target)
    draft_spec, draft_vocab = read_tokenizer(draft)
    check_same_tokenizer(target_spec, draft_spec, target_vocab, draft_vocab)


@dataclass(frozen=True, slots=True)
class Drafts:
    """What the draft model proposed for one work: its tokens and, for a sampled request, the
    distributions `[k, vocab]` they were drawn from (None: argmax drafts, one-hot)."""

    tokens: tuple[int, ...]
    probs: torch.Tensor | None


class DraftModel:
    """Drafts tokens with a smaller model whose KV cache shares the target's page layout."""

    def __init__(self, runner: TorchRunner) -> None:
        self.runner = runner

    def draft(self, works: list[SeqWork]) -> dict[int, Drafts]:
        """Feed each work's `draft_feed`, then draft `num_model_draft` tokens for those that ask.

        One forward per drafted position (all works together): the feed and the first
        position, then each draft fed back to get the next. Returns seq id -> `Drafts`.
        """
        fed = [w for w in works if w.draft_feed]
        if not fed:
            return {}
        drafting = {w.seq_id: w for w in fed if w.num_model_draft > 0}
        tokens: dict[int, list[int]] = {seq_id: [] for seq_id in drafting}
        probs: dict[int, list[torch.Tensor]] = {seq_id: [] for seq_id in drafting}
        step = [
            SeqWork(
                seq_id=w.seq_id,
                token_ids=w.draft_feed,
                start_pos=w.draft_pos,
                page_ids=w.page_ids,
                sample=w.seq_id in drafting,
                params=w.params,
                num_generated=w.num_generated,
            )
            for w in fed
        ]
        while step:
            logits = self.runner.forward(step)
            following: list[SeqWork] = []
            rows = iter(logits if logits is not None else ())
            for w in step:
                if not w.sample:
                    continue
                work = drafting[w.seq_id]
                drawn = tokens[w.seq_id]
                token, q = _draw(next(rows), work, len(drawn))
                drawn.append(token)
                if q is not None:
                    probs[w.seq_id].append(q)
                if len(drawn) < work.num_model_draft:
                    following.append(replace(w, token_ids=(token,), start_pos=w.start_pos + len(w.token_ids)))
            step = following
        return {
            seq_id: Drafts(tuple(tokens[seq_id]), torch.stack(probs[seq_id]) if probs[seq_id] else None)
            for seq_id in drafting
        }


def _draw(logits: torch.Tensor, work: SeqWork, j: int) -> tuple[int, torch.Tensor | None]:
    """Draft `j` of `work` from the draft model's logits `[vocab]`: its argmax for a greedy
    request, else a draw from the request's processed distribution, returned with it."""
    p = work.params
    x = logits.float()
    if p.logit_bias:
        x = x.clone()
        apply_logit_bias(x, p.logit_bias)
    if p.is_greedy:
        return int(x.argmax()), None
    q = filter_logits(x, p).softmax(-1).double()
    seed = None if p.seed is None else mix_seed(p.seed, DRAFT_SEED_SALT)
    generator = row_generator(seed, work.num_generated + j)
    cdf = q.cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    token = min(int(torch.searchsorted(cdf, u, side="right")), q.numel() - 1)
    while float(q[token]) <= 0.0:  # rounding at the end of the cdf: the last token with mass
        token -= 1
    return token, q


class SpeculativeRunner:
    """The target `TorchRunner` with a `DraftModel` in front: the `Runner` of
    `--speculative-method draft`. `last_draft_s` is the time the last step spent drafting."""

    def __init__(self, target: TorchRunner, draft: TorchRunner) -> None:
        if (draft.num_pages, draft.page_size) != (target.num_pages, target.page_size):
            raise ValueError("the draft model's KV cache must have the target's pages")
        self.target = target
        draft.heartbeat = self.heartbeat = target.heartbeat  # either model's forward is progress
        self.drafter = DraftModel(draft)
        self.kv_dtype = target.kv_dtype
        self.last_draft_s = 0.0

    @property
    def page_size(self) -> int:
        """Slots per KV page (both models)."""
        return self.target.page_size

    @property
    def num_pages(self) -> int:
        """KV pages allocated (in each model's cache)."""
        return self.target.num_pages

    @property
    def vocab_size(self) -> int:
        """Rows of the target's lm_head (the draft's are the same)."""
        return self.target.vocab_size

    def step(self, works: list[SeqWork]) -> list[StepOutput]:
        """Draft, then run the target step with the drafts appended and verified."""
        started = time.perf_counter()
        try:
            drafts = self.drafter.draft(works)
        finally:
            self.last_draft_s = time.perf_counter() - started
        if not drafts:
            return self.target.step(works)
        verified = [
            replace(
                w, token_ids=w.token_ids + drafts[w.seq_id].tokens, num_draft=len(drafts[w.seq_id].tokens)
            )
            if w.seq_id in drafts
            else w
            for w in works
        ]
        probs = {seq_id: d.probs for seq_id, d in drafts.items() if d.probs is not None}
        return self.target.step(verified, probs)

    def close(self, timeout_s: float = 10.0) -> None:
        """Nothing to stop here: the draft model runs in this process (rank 0's, under tensor
        parallelism: the loader stops the target's ranks)."""
