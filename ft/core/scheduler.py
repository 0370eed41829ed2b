"""The synchronous scheduler: admission, continuous batching, chunked prefill, finish rules.

One `schedule()` builds a batch (decodes first, then prefill chunks within a token budget);
`on_step_done()` folds the runner's samples back in and says which tokens go out. A request is
admitted only when KV pages for its whole budget (prompt + max_tokens, for each of its `n`
sequences) can be allocated, so a running sequence never runs out of pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ft.core.batch import Batch, SeqFailed, SeqWork, StepDone, TokenOut
from ft.core.kv import PagePool, page_hash
from ft.core.sequence import SeqStatus, Sequence
from ft.errors import ContextLengthExceeded, InvalidRequest, RequestFailed
from ft.params import SamplingParams, mix_seed


@dataclass(frozen=True, slots=True)
class Finish:
    """Whether a sampled token ends its sequence: `reason` ("stop" | "length", None while it
    goes on), the stop token id that ended it, and whether the token's text is hidden (eos, a
    stop token)."""

    reason: str | None
    stop_token: int | None = None
    is_hidden: bool = False


NOT_FINISHED = Finish(None)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class Scheduler:
    """Owns the waiting queue, the running set and the page pool."""

    def __init__(
        self,
        pool: PagePool,
        *,
        max_running: int,
        max_model_len: int,
        max_prefill_tokens: int,
        eos_token_ids: Iterable[int],
        enable_prefix_caching: bool = True,
    ) -> None:
        self.pool = pool
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[list[Sequence]] = deque()  # one group of `n` sequences per request
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order
        self._next_seq_id = 0
        self._step = 0
        self.num_prefix_hit_tokens = 0

    # --- admission ---------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Return the resolved max_tokens, or raise when the request can never be served."""
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens"
            )
        if params.max_tokens is None:
            # Up to the end of the context, as OpenAI does, but never more than the pool holds:
            # the whole budget is reserved at admission.
            pool_tokens = self.pool.num_pages // params.n * self.pool.page_size
            max_tokens = min(room, pool_tokens - num_prompt_tokens)
            if max_tokens < 1:
                raise ContextLengthExceeded(
                    f"the prompt has {num_prompt_tokens} tokens; the KV pool holds "
                    f"{pool_tokens} tokens per sequence"
                )
        else:
            max_tokens = params.max_tokens
        if max_tokens > room:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {num_prompt_tokens} and max_tokens asks for {max_tokens} more"
            )
        if params.n > self.max_running:
            raise InvalidRequest(f"n={params.n} exceeds max_running_requests={self.max_running}", param="n")
        needed = params.n * pages_for(num_prompt_tokens + max_tokens, self.pool.page_size)
        if needed > self.pool.num_pages:
            raise ContextLengthExceeded(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) times "
                f"n={params.n} needs {needed} KV pages; the pool has {self.pool.num_pages} "
                f"pages of {self.pool.page_size} tokens"
            )
        return max_tokens

    def add(self, uid: int, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue request `uid`. Raises `InvalidRequest` when it can never fit."""
        max_tokens = self.check_fits(len(prompt_ids), params)
        if max_tokens != params.max_tokens:
            params = replace(params, max_tokens=max_tokens)
        group = []
        for index in range(params.n):
            # Each choice samples its own stream; choice 0 keeps the seed as given, so a seeded
            # n=1 request and choice 0 of the same request with n>1 agree.
            seeded = (
                params
                if params.seed is None or index == 0
                else replace(params, seed=mix_seed(params.seed, index))
            )
            group.append(Sequence(self._next_seq_id, uid, index, list(prompt_ids), seeded))
            self._next_seq_id += 1
        self.waiting.append(group)

    def _try_admit(self, group: list[Sequence]) -> bool:
        """Admit all of a request's sequences, or none: nothing is held unless all fit."""
        if len(self.running) + len(group) > self.max_running:
            return False
        hashes = self._prompt_hashes(group[0]) if self.enable_prefix_caching else []
        matched = [self.pool.match_prefix(hashes) for _ in group]
        fresh = [
            pages_for(seq.max_total_tokens, self.pool.page_size) - len(m)
            for seq, m in zip(group, matched, strict=True)
        ]
        if not self.pool.can_allocate(sum(fresh)):
            for pages in matched:
                self.pool.release(pages)
            return False
        for seq, m, n in zip(group, matched, fresh, strict=True):
            seq.page_ids = m + self.pool.allocate(n)
            seq.page_hashes = hashes[: len(m)]
            seq.num_computed = seq.num_cached_prompt = len(m) * self.pool.page_size
            self.num_prefix_hit_tokens += seq.num_cached_prompt
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
        return True

    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        # The last prompt token is always recomputed (its logits are needed), so only pages
        # wholly before it are reusable.
        size = self.pool.page_size
        hashes: list[int] = []
        parent = None
        for i in range((len(seq.prompt_ids) - 1) // size):
            parent = page_hash(parent, seq.prompt_ids[i * size : (i + 1) * size])
            hashes.append(parent)
        return hashes

    # --- leaving -----------------------------------------------------------------------------

    def abort(self, uid: int) -> int:
        """Drop every sequence of request `uid`, freeing its pages. Returns how many. Idempotent."""
        dropped = 0
        for group in list(self.waiting):
            if group[0].uid == uid:
                self.waiting.remove(group)
                dropped += len(group)
        for seq in [s for s in self.running.values() if s.uid == uid]:
            self._release(seq)
            dropped += 1
        return dropped

    def finish_seq(self, seq_id: int) -> bool:
        """End one running sequence early (stop string). Returns whether it was running."""
        seq = self.running.get(seq_id)
        if seq is None:
            return False
        self._release(seq)
        return True

    def _release(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        del self.running[seq.seq_id]
        self.pool.release(seq.page_ids)
        seq.page_ids = []

    # --- stepping ----------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """True when a step could make progress now or after admission."""
        return bool(self.running or self.waiting)

    @property
    def num_running_requests(self) -> int:
        """Requests with at least one sequence in the running set."""
        return len({seq.uid for seq in self.running.values()})

    @property
    def num_waiting_requests(self) -> int:
        """Tokenized requests waiting for admission."""
        return len(self.waiting)

    def schedule(self) -> Batch | None:
        """Admit what fits, then build the next batch; None when nothing can run."""
        while self.waiting and self._try_admit(self.waiting[0]):
            self.waiting.popleft()
        works: list[SeqWork] = []
        budget = self.max_prefill_tokens
        for seq in self.running.values():
            if not seq.is_prefilling:
                pos = seq.num_tokens - 1
                works.append(self._work(seq, [seq.token_at(pos)], pos, sample=True))
        for seq in self.running.values():
            if budget <= 0:
                break
            if seq.is_prefilling:
                remaining = len(seq.prompt_ids) - seq.num_computed
                chunk = min(remaining, budget)
                start = seq.num_computed
                tokens = seq.prompt_ids[start : start + chunk]
                works.append(self._work(seq, tokens, start, sample=chunk == remaining))
                budget -= chunk
        if not works:
            return None
        self._step += 1
        return Batch(self._step, tuple(works))

    def _work(self, seq: Sequence, tokens: list[int], start: int, *, sample: bool) -> SeqWork:
        history: tuple[int, ...] = ()
        if sample and seq.params.uses_penalties:
            history = tuple(seq.prompt_ids) + tuple(seq.output_ids)
        return SeqWork(
            seq_id=seq.seq_id,
            token_ids=tuple(tokens),
            start_pos=start,
            page_ids=tuple(seq.page_ids),
            sample=sample,
            params=seq.params,
            num_generated=len(seq.output_ids),
            history=history,
            num_prompt_tokens=len(seq.prompt_ids),
        )

    def on_step_done(self, batch: Batch, done: StepDone) -> list[TokenOut | SeqFailed]:
        """Fold a finished step back in; return the tokens and failures to route out."""
        outs: list[TokenOut | SeqFailed] = []
        failed = dict(done.failed)
        for work in batch.works:
            seq = self.running.get(work.seq_id)
            if seq is None or work.seq_id in failed:
                continue
            seq.num_computed = work.start_pos + len(work.token_ids)
            self._register_full_pages(seq)
        for seq_id, message in failed.items():
            seq = self.running.get(seq_id)
            if seq is not None:
                self.abort(seq.uid)
                outs.append(SeqFailed(seq.uid, RequestFailed(message)))
        for sampled in done.sampled:
            seq = self.running.get(sampled.seq_id)
            if seq is None:
                continue
            seq.output_ids.append(sampled.token_id)
            finish = self._finish_check(seq, sampled.token_id)
            outs.append(
                TokenOut(
                    uid=seq.uid,
                    index=seq.index,
                    seq_id=seq.seq_id,
                    token_id=sampled.token_id,
                    logprob=sampled.logprob,
                    top_logprobs=sampled.top_logprobs,
                    finish_reason=finish.reason,
                    stop_reason=finish.stop_token,
                    is_hidden=finish.is_hidden,
                    num_cached_tokens=seq.num_cached_prompt,
                )
            )
            if finish.reason is not None:
                self._release(seq)
        return outs

    def _finish_check(self, seq: Sequence, token: int) -> Finish:
        params = seq.params
        if token in params.stop_token_ids:
            return Finish("stop", stop_token=token, is_hidden=True)
        if token in self.eos_token_ids and not params.ignore_eos:
            return Finish("stop", is_hidden=True)
        assert params.max_tokens is not None
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return Finish("length")
        return NOT_FINISHED

    def _register_full_pages(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        size = self.pool.page_size
        while len(seq.page_hashes) < seq.num_computed // size:
            i = len(seq.page_hashes)
            parent = seq.page_hashes[-1] if seq.page_hashes else None
            h = page_hash(parent, seq.tokens(i * size, (i + 1) * size))
            seq.page_hashes.append(h)
            self.pool.register(seq.page_ids[i], h)
