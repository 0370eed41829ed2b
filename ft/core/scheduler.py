"""The synchronous scheduler: admission by need, preemption by recompute, continuous batching.

One `schedule()` grows the running sequences by the page their next token needs (preempting
when the pool is short), admits what fits, and builds a batch (decodes first, then prefill
chunks within a token budget); `on_step_done()` folds the runner's samples back in and says which
tokens go out.

Admission is by need: a request is admitted when its uncached prompt plus one decode token
(for each of its `n` sequences) fits, leaving a small watermark free; `max_tokens` bounds a
sequence but reserves nothing. When a running sequence needs a page and none is allocatable,
the most recently admitted request is preempted: its pages are freed (full pages stay in the
prefix cache), it goes back to the head of the waiting queue, and when re-admitted it recomputes
its prompt plus the tokens it already generated, then samples where it left off.

Guarantee (no livelock): the oldest running request is never preempted, and `check_fits`
refuses any request whose whole budget could not fit the pool alone, so the oldest request
always gets its next page and advances every step. The queue is FIFO with preempted requests
at its head, so nothing admitted later overtakes an earlier request: every request finishes.

On a model with recurrent layers (a hybrid: `states`, `ft.core.state`) each running sequence
also holds a state slot. Its prefix-cache hits reuse KV only up to a page whose state snapshot
is held (restored into its slot); a prefill chunk that would cross the prompt's last full page
boundary before its last token is cut there, and the state is snapshotted there after the
step, so the next turn of a conversation finds it. The other choices of an `n` > 1 request wait
for choice 0 to get there, then take its state and pages (`state.fork`) instead of computing them.

On a model whose every layer is windowed (`kv_window`), a sequence holds at most
`window_pages` whatever its length (the pages behind the window go back, and it is given pages
a step ahead, never the whole prompt's at once), so that is the budget `check_fits` counts
for it.

NOTE: this module is past the ~400 lines a room keeps to, on purpose: `Scheduler` is one state
machine whose invariants (pages held = pages of running sequences, the oldest request always
advances, prompt scores taken once per position across preemptions) span admission, growth,
preemption and step folding; split across files, each half would hold half an invariant.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ft.core.batch import (
    Batch,
    EmbeddingOut,
    PageLoad,
    PageSave,
    PoolSum,
    SeqFailed,
    SeqWork,
    StepDone,
    TokenOut,
)
from ft.core.kv import PagePool, page_hash, partition_root
from ft.core.ngram import DraftLength, NgramIndex
from ft.core.sequence import SeqStatus, Sequence
from ft.core.spec_cost import MAX_RETRY_EVERY, RETRY_EVERY, StepCosts, expected_accepted
from ft.core.state import StatePool, fork, plan_forks, release_slot, state_boundary, take_slot
from ft.errors import ContextLengthExceeded, InvalidRequest
from ft.params import SamplingParams, mix_seed

if TYPE_CHECKING:
    from ft.core.prompt_cache import PromptCache
    from ft.grammar.compiled import Grammar

# Fewest leading tokens worth a read from the disk tier: a load costs a step of its own.
DEFAULT_DISK_MIN_TOKENS = 64
# The most a scored prompt position may cost beside feeding it, in fed tokens: a step's least
# budget (a quarter of the least max_prefill_tokens, 16) still pays for one scored token.
MAX_SCORE_COST = 3.0


@dataclass(frozen=True, slots=True)
class Finish:
    """Whether a sampled token ends its sequence: `reason` ("stop" | "length", None while it
    goes on), the stop token id that ended it, and whether the token's text is hidden (eos, a
    stop token)."""

    reason: str | None
    stop_token: int | None = None
    is_hidden: bool = False


NOT_FINISHED = Finish(None)


def _num_drafts(proposal: list[int] | int) -> int:
    """Tokens a proposal drafts: its n-gram drafts, or what the draft model is asked for."""
    return proposal if isinstance(proposal, int) else len(proposal)


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
        reserve_full_budget: bool = False,
        speculative_tokens: int = 0,
        speculative_max_batch: int = 4,
        draft_model: bool = False,
        costs: StepCosts | None = None,
        kv_window: int = 0,
        score_cost: float = 0.0,
        disk: PromptCache | None = None,
        disk_min_tokens: int = DEFAULT_DISK_MIN_TOKENS,
        states: StatePool | None = None,
    ) -> None:
        self.pool = pool
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_prefix_caching = enable_prefix_caching
        # The old policy, kept as a measurable baseline: admit only when pages for the whole
        # budget (prompt + max_tokens) are free, so nothing is ever preempted.
        self.reserve_full_budget = reserve_full_budget
        # Pages admission leaves free while something runs, so an admission does not force a
        # preemption on the very next step (vLLM keeps 1% too).
        self.watermark_pages = pool.num_pages // 100
        self.waiting: deque[list[Sequence]] = deque()  # one group of `n` sequences per request
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order
        self._next_seq_id = 0
        self._step = 0
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0  # tokens looked up in the prefix cache at admission
        self.num_preemptions = 0  # requests preempted (one count per request, not per choice)
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption
        # N-gram speculative decoding: the most tokens drafted per sequence and step (0: off),
        # and the most decoding sequences a step drafts for (past it the step is compute-bound
        # already and verify rows would cost more than they save).
        self.speculative_tokens = speculative_tokens
        self.speculative_max_batch = speculative_max_batch
        # Drafts come from the runner's draft model (`SeqWork.num_model_draft`) instead of the
        # n-gram index; its KV lags each sequence's and is fed what it lacks, at most this many
        # tokens a step (a quarter of the prefill budget, as prefill chunks beside decodes).
        self.draft_model = draft_model
        self.draft_catch_up = max(2, max_prefill_tokens // 4)  # (past 1: a lag a step outgrows)
        # The measured cost model that turns speculation off for a step when it would cost more
        # than it saves (None: draft in every step of at most `speculative_max_batch` decodes).
        self.costs = costs
        self.num_refusals = 0  # verifications that refused a draft (all: accepted everything)
        # The positions every layer of the model attends at most (a sliding window on all of
        # them, Mistral's), 0 when some layer attends everything: the pages wholly behind it
        # return to the pool as a sequence passes them (`_drop_out_of_window`).
        self.kv_window = kv_window
        self.num_dropped_pages = 0
        # What scoring a prompt position (prompt logprobs: its logits over the vocabulary) costs
        # beside feeding it, in fed tokens (`LlamaConfig.score_cost`): a scored position takes
        # 1 + score_cost of a step's prefill budget, so a step that scores does about the work
        # of a plain prefill step.
        self.score_cost = min(max(score_cost, 0.0), MAX_SCORE_COST)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0  # decode works that carried drafts
        # The prompt cache's disk tier: full pages are saved when registered (and again when
        # evicted, if their write was dropped); a prefix that continues on disk past
        # `disk_min_tokens` is loaded into fresh pages before it is prefilled.
        self.disk = disk
        self.disk_min_tokens = disk_min_tokens
        self._saves: dict[int, PageSave] = {}  # key -> page, for the next batch
        self._loads: list[PageLoad] = []
        self.num_disk_hit_tokens = 0  # prompt tokens read from disk (also in num_prefix_hit_tokens)
        if disk is not None:
            pool.on_evict = self._on_evict
        # A hybrid model's recurrent state slots (None: attention only). Its prefix cache reuses
        # KV only where a snapshot of the state is held: with no snapshots, nothing is reused.
        self.states = states
        if states is not None:
            if states.max_running != max_running:
                raise ValueError(f"state slots for {states.max_running} running sequences, not {max_running}")
            if disk is not None or speculative_tokens or draft_model:
                raise ValueError(
                    "the prompt cache's disk tier and speculative decoding are not supported for "
                    "models with recurrent layers"
                )
            self.enable_prefix_caching = enable_prefix_caching and states.max_snapshots > 0

    # --- admission ---------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Return the resolved max_tokens, or raise when the request can never be served.

        `max_tokens` is a ceiling: one past what the context (or, per sequence, the KV pool)
        leaves after the prompt is lowered to it, and the output ends there with `length`.
        Agents send their own ceiling (Claude Code 32000, opencode the model's advertised
        output) whatever the prompt's size; vLLM's 400 would fail every such turn. Only a
        prompt that leaves no room at all is refused, with the token counts.
        """
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if params.pooling is not None:
            return self._check_pooling_fits(num_prompt_tokens)
        if params.n > self.max_running:
            raise InvalidRequest(f"n={params.n} exceeds max_running_requests={self.max_running}", param="n")
        # max_tokens 0 (the prompt scored, nothing generated) needs no room past the prompt: one
        # token is sampled to end the prefill, never fed, and the request's stream drops it.
        is_prompt_only = params.max_tokens == 0
        room = self.max_model_len - num_prompt_tokens + is_prompt_only
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens"
            )
        # Never more than the pool holds either: a request alone must always be able to
        # finish (the no-livelock guarantee). A windowed sequence holds its window at most.
        pool_pages = self.pool.num_pages // params.n
        pool_tokens = pool_pages * self.pool.page_size
        if self._is_windowed_admission and self.window_pages <= pool_pages:
            max_tokens = room
        else:
            max_tokens = min(room, pool_tokens - num_prompt_tokens)
        if max_tokens < 1:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt_tokens} tokens; the KV pool holds "
                f"{pool_tokens} tokens per sequence"
                + (f" (n={params.n} sequences share it)" if params.n > 1 else "")
            )
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, max(1, params.max_tokens))
        return max_tokens

    def _check_pooling_fits(self, num_prompt_tokens: int) -> int:
        """A pooling request feeds its prompt and nothing after it: the whole context is its."""
        if num_prompt_tokens > self.max_model_len:
            raise ContextLengthExceeded(
                f"the input has {num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens",
                param="input",
            )
        if pages_for(num_prompt_tokens, self.pool.page_size) > self.pool.num_pages:
            raise ContextLengthExceeded(
                f"the input has {num_prompt_tokens} tokens; the KV pool holds "
                f"{self.pool.num_pages * self.pool.page_size} tokens",
                param="input",
            )
        return 1  # `max_tokens` resolved to one, though nothing is sampled

    def add(
        self,
        uid: int,
        prompt_ids: list[int],
        params: SamplingParams,
        grammar: Grammar | None = None,
        *,
        cache_partition: bytes | None = None,
    ) -> None:
        """Queue request `uid`; each choice follows its own copy of `grammar` when given.

        `cache_partition` names the prefix-cache partition its pages are matched and registered
        in (None: the shared one; `PromptSpec.cache_partition`): a request never reuses a page
        another partition computed.

        Raises `InvalidRequest` when it can never fit.
        """
        max_tokens = self.check_fits(len(prompt_ids), params)
        if max_tokens != params.max_tokens:
            params = replace(params, max_tokens=max_tokens)
        root = partition_root(cache_partition)
        group = []
        for index in range(params.n):
            # Each choice samples its own stream; choice 0 keeps the seed as given, so a seeded
            # n=1 request and choice 0 of the same request with n>1 agree.
            seeded = (
                params
                if params.seed is None or index == 0
                else replace(params, seed=mix_seed(params.seed, index))
            )
            matcher = grammar.matcher() if grammar is not None else None
            group.append(
                Sequence(
                    self._next_seq_id, uid, index, list(prompt_ids), seeded, matcher=matcher, hash_root=root
                )
            )
            self._next_seq_id += 1
        self.waiting.append(group)

    def _try_admit(self, group: list[Sequence]) -> bool:
        """Admit all of a request's sequences, or none: nothing is held unless all fit."""
        if len(self.running) + len(group) > self.max_running:
            return False
        if self.states is not None and not self.states.can_allocate(len(group)):
            return False
        size = self.pool.page_size
        found = [self._match_prefix(seq) for seq in group]
        matched = [m for m, _ in found]
        # Matched pages already behind the window of the first position to compute go back at
        # once (placeholders stand in for them): their KV is never read again.
        behind = [self._num_behind_window(len(m) * size) for m in matched]
        for m, d in zip(matched, behind, strict=True):
            self.pool.release(m[:d])
        fresh = [
            pages_for(self._admission_tokens(seq, (len(m) + len(on_disk)) * size), size) - len(m)
            for seq, (m, on_disk) in zip(group, found, strict=True)
        ]
        reserve = self.watermark_pages if self.running and not self.reserve_full_budget else 0
        if not self.pool.can_allocate(sum(fresh) + reserve):
            for m, d in zip(matched, behind, strict=True):
                self.pool.release(m[d:])
            return False
        if self.states is not None:  # the snapshots to restore are the last a slot evicts
            for seq, m in zip(group, matched, strict=True):
                if m:
                    self.states.touch(seq.page_hashes[len(m) - 1])
        for seq, (m, on_disk), n, d in zip(group, found, fresh, behind, strict=True):
            held = m[d:] + self.pool.allocate(n)
            seq.page_ids = [held[0]] * d + held
            seq.num_dropped = d
            self.num_dropped_pages += d
            if on_disk:  # read into its first fresh pages by the next step, which skips it
                seq.num_loading = len(on_disk)
                targets = tuple(seq.page_ids[len(m) : len(m) + len(on_disk)])
                self._loads.append(PageLoad(seq.seq_id, targets, tuple(on_disk)))
            seq.num_registered = len(m)
            seq.num_computed = len(m) * self.pool.page_size
            if self.draft_model:  # the cached pages computed beside the draft model hold its KV
                seq.num_draft_computed = self.pool.num_drafted(m) * self.pool.page_size
            self.num_prefix_hit_tokens += seq.num_computed
            if self.enable_prefix_caching:
                self.num_prefix_query_tokens += seq.num_tokens
            if not seq.output_ids:  # what usage reports: hits on the prompt, before any output
                seq.num_cached_prompt = min(seq.num_computed, len(seq.prompt_ids))
            if seq.num_lost:
                self.num_recomputed_tokens += max(0, seq.num_lost - seq.num_computed)
                seq.num_lost = 0
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
            if self.states is not None:
                take_slot(self.states, seq, size)
        if self.states is not None and len(group) > 1 and not self.kv_window:
            plan_forks(group, size)
        return True

    def _is_forking(self, seq: Sequence) -> bool:
        """Whether `seq` waits to fork from another choice (which is still running)."""
        if seq.fork_from is not None and seq.fork_from not in self.running:
            seq.fork_from = None  # (defensive: the group is preempted and aborted as one)
        return seq.fork_from is not None

    def _at_state_boundary(self, seq: Sequence) -> None:
        """After a step that ended at `seq`'s state boundary: snapshot its state there (the next
        batch copies it before its works advance it), and fork the choices waiting for it."""
        boundary = state_boundary(seq, self.pool.page_size)
        if not boundary or seq.num_computed != boundary:
            return
        assert self.states is not None
        n = boundary // self.pool.page_size
        if self.enable_prefix_caching:
            self.states.snapshot(seq.state_slot, self._page_hashes(seq, n)[n - 1])
        for child in [s for s in self.running.values() if s.fork_from == seq.seq_id]:
            fork(child, seq, boundary, self.pool, self.states)

    def _state_cut(self, seq: Sequence) -> float:
        """The most tokens `seq`'s next prefill chunk may feed: up to its state boundary when
        the chunk would cross it and a snapshot or a fork is taken there (else no limit)."""
        boundary = state_boundary(seq, self.pool.page_size)
        if self.states is None or seq.num_computed >= boundary:
            return float("inf")
        if self.enable_prefix_caching or any(s.fork_from == seq.seq_id for s in self.running.values()):
            return boundary - seq.num_computed
        return float("inf")

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """The cached pages `seq` can start from, and the keys of the pages after them to read
        from the disk tier (none unless they hold at least `disk_min_tokens`).

        A cached page has no logits: a sequence whose prompt logprobs are still to be scored
        reuses only the pages before the first position it must score, and recomputes the rest
        (at first admission that is position 0: no reuse, so `prompt_logprobs` requests see no
        prefix-cache hits; after a preemption, what it scored already is not scored again).
        """
        if not self.enable_prefix_caching:
            return [], []
        hashes = self._full_page_hashes(seq)
        keep = len(hashes)
        if seq.wants_prompt_scores:
            keep = min(keep, len(seq.prompt_scores) // self.pool.page_size)
        if seq.is_pooling:  # a cached page has no hidden states to pool either
            keep = min(keep, seq.num_reusable_pooled // self.pool.page_size)
        matched = self.pool.match_prefix(hashes[:keep])
        if self.states is not None:
            # The recurrent layers' past is not in the pages: reuse them only up to a snapshot.
            n = self.states.longest_snapshot(hashes[: len(matched)])
            self.pool.release(matched[n:])
            return matched[:n], []
        on_disk: list[int] = []
        if self.disk is not None and len(matched) < keep:
            rest = hashes[len(matched) : keep]
            n = self.disk.count_prefix(rest)
            if self._is_windowed_admission and not seq.is_pooling:
                # NOTE: a load's pages are all held at once (the window drops them after): no
                # more than the window leaves beside the matched pages in it and the first chunk,
                # or a prompt on disk longer than the pool (check_fits admits it) waits forever.
                size = self.pool.page_size
                in_window = len(matched) - self._num_behind_window(len(matched) * size)
                n = min(n, max(0, self.window_pages - in_window - pages_for(self.max_prefill_tokens, size)))
            if n * self.pool.page_size >= self.disk_min_tokens:
                on_disk = rest[:n]
        return matched, on_disk

    def _admission_tokens(self, seq: Sequence, num_ready: int) -> int:
        """Tokens whose pages admission allocates: its whole budget, or what it needs now
        (`num_ready`: the leading tokens the prefix cache and the disk tier supply)."""
        if self.reserve_full_budget and not seq.is_pooling:
            return seq.max_total_tokens
        if seq.is_pooling:
            return seq.num_tokens  # its prompt, no decode token after it
        # Everything to (re)compute plus the first decode token after it; under a window only
        # the first chunk's (the rest are given as it gets there, `_grow`).
        needed = min(seq.num_tokens + 1, seq.max_total_tokens)
        if self._is_windowed_admission:
            needed = min(needed, num_ready + self.max_prefill_tokens)
        return needed

    @property
    def _is_windowed_admission(self) -> bool:
        """Whether sequences hold their window only (pages given a step ahead, not all at once)."""
        return bool(self.kv_window) and not self.reserve_full_budget

    @property
    def window_pages(self) -> int:
        """The most pages a sequence holds under the window: those of the `kv_window - 1`
        positions before the next one to compute and of the longest step after (a prefill
        chunk, or a decode and its drafts), one more where the span straddles a page boundary."""
        longest_step = max(self.max_prefill_tokens, 1 + self.speculative_tokens)
        return pages_for(self.kv_window - 1 + longest_step, self.pool.page_size) + 1

    def _num_behind_window(self, num_computed: int) -> int:
        """Leading pages wholly behind the window of every position from `num_computed` on."""
        if not self.kv_window:
            return 0
        return max(0, num_computed - self.kv_window + 1) // self.pool.page_size

    def _full_page_hashes(self, seq: Sequence) -> list[int]:
        """Content hashes of the sequence's full pages before its last token (kept on `seq`).

        The last token is always recomputed (its logits are needed), so only pages wholly
        before it are reusable. Hashes depend on content and partition only, so they survive a preemption.
        """
        num_pages = (seq.num_tokens - 1) // self.pool.page_size
        return self._page_hashes(seq, num_pages)[:num_pages]

    def _page_hashes(self, seq: Sequence, num_pages: int) -> list[int]:
        """`seq.page_hashes`, extended to its first `num_pages` full pages: each page's chain
        hash, the first's parent its partition's root (the one place page hashes are made)."""
        size = self.pool.page_size
        hashes = seq.page_hashes
        for i in range(len(hashes), num_pages):
            parent = hashes[-1] if hashes else seq.hash_root
            hashes.append(page_hash(parent, seq.tokens(i * size, (i + 1) * size)))
        return hashes

    # --- preemption --------------------------------------------------------------------------

    def _grow(self) -> bool:
        """Give each running sequence the page its next token needs, preempting when short.

        Oldest first; the victim is always the most recently admitted request (possibly the
        sequence's own, which then waits). Returns whether anything was preempted.
        """
        preempted = False
        for seq in list(self.running.values()):
            if seq.seq_id not in self.running:
                continue  # preempted earlier in this loop
            upto = seq.num_tokens
            if self._is_windowed_admission and not seq.is_pooling:
                upto = min(upto, seq.num_computed + self.max_prefill_tokens)  # the next step's
            needed = pages_for(upto, self.pool.page_size) - len(seq.page_ids)
            if needed <= 0:
                continue
            while not self.pool.can_allocate(needed):
                victim = self._pick_victim()
                # NOTE: unreachable by construction: alone, a request's whole budget fits the
                # pool (`check_fits`), so the oldest request always finds its page.
                assert victim != self._oldest_running_uid(), "the oldest request cannot grow"
                self.preempt(victim)
                preempted = True
                if victim == seq.uid:
                    break
            if seq.seq_id in self.running:
                seq.page_ids += self.pool.allocate(needed)
        return preempted

    def _pick_victim(self) -> int:
        """The request to preempt: the most recently admitted one (see the module docstring)."""
        return next(reversed(self.running.values())).uid

    def _oldest_running_uid(self) -> int:
        return next(iter(self.running.values())).uid

    def preempt(self, uid: int) -> None:
        """Free every running sequence of request `uid` and queue it first, to be recomputed."""
        group = [seq for seq in self.running.values() if seq.uid == uid]
        for seq in group:
            del self.running[seq.seq_id]
            self.pool.release(seq.page_ids[seq.num_dropped :])
            seq.page_ids, seq.num_dropped = [], 0
            seq.num_lost = max(seq.num_lost, seq.num_computed)
            seq.num_computed = seq.num_registered = 0
            seq.num_draft_computed, seq.catching_up, seq.num_passed_over = 0, False, 0
            if self.states is not None:
                release_slot(self.states, seq)
            seq.num_preemptions += 1
            seq.status = SeqStatus.PREEMPTED
        if group:
            self.num_preemptions += 1
            self.waiting.appendleft(group)

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
        """End one sequence early (stop string). Returns whether it was running or preempted."""
        seq = self.running.get(seq_id)
        if seq is not None:
            self._release(seq)
            return True
        # A stop string can be found in a token the sequence produced just before it was
        # preempted: drop it from its waiting group (a preempted sequence holds no pages).
        for group in self.waiting:
            for seq in group:
                if seq.seq_id == seq_id:
                    group.remove(seq)
                    seq.status = SeqStatus.FINISHED
                    if not group:
                        self.waiting.remove(group)
                    return True
        return False

    def _release(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        del self.running[seq.seq_id]
        self.pool.release(seq.page_ids[seq.num_dropped :])
        seq.page_ids, seq.num_dropped = [], 0
        if self.states is not None:
            release_slot(self.states, seq)

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
    def num_held_tokens(self) -> int:
        """Tokens whose KV the running sequences hold (a shared prefix counts once per holder)."""
        return sum(seq.num_computed for seq in self.running.values())

    @property
    def num_waiting_requests(self) -> int:
        """Tokenized requests waiting for admission."""
        return len(self.waiting)

    def schedule(self) -> Batch | None:
        """Grow (preempting if short), admit what fits, build the next batch; None when idle."""
        # After a preemption admit nothing this step: the pages just freed go to the running
        # sequences' growth, and the victim (now first in the queue) would only thrash.
        if not self._grow():
            while self.waiting and self._try_admit(self.waiting[0]):
                self.waiting.popleft()
        decoding = [
            seq
            for seq in self.running.values()
            if not seq.is_prefilling and not seq.num_loading and not self._is_forking(seq)
        ]
        works = self._decode_works(decoding)
        # NOTE: a step that also decodes takes a quarter of the prefill budget, so that streams
        # already running pause for at most a short chunk while new prompts arrive (16 clients
        # with 460-token prompts: inter-token p99 was 12x its median with 512-token chunks).
        budget: float = self.max_prefill_tokens // 4 if works else self.max_prefill_tokens
        for seq in self.running.values():
            if budget < 1:
                break
            if seq.is_prefilling and not seq.num_loading and not self._is_forking(seq):
                chunk, cost = self._prefill_chunk(seq, min(budget, self._state_cut(seq)))
                if not chunk:
                    continue
                start = seq.num_computed
                tokens = seq.tokens(start, start + chunk)
                works.append(self._work(seq, tokens, start, sample=start + chunk == seq.num_tokens))
                budget -= cost
        saves, loads = tuple(self._saves.values()), tuple(self._loads)
        self._saves.clear()
        self._loads.clear()
        copies = self.states.take_copies() if self.states is not None else ()
        if not works and not saves and not loads and not copies:
            return None
        self._step += 1
        return Batch(self._step, tuple(works), saves, loads, copies)

    def _prefill_chunk(self, seq: Sequence, budget: float) -> tuple[int, float]:
        """The most of `seq`'s next prefill tokens that `budget` pays for, and their cost: a token
        costs 1, a scored one (prompt logprobs) 1 + `score_cost`."""
        start = seq.num_computed
        chunk = min(seq.num_tokens - start, int(budget))
        offset, scored = self._score_span(seq, start, start + chunk)
        cost = chunk + self.score_cost * len(scored)
        if cost <= budget:
            return chunk, cost
        # The chunk is `offset` plain tokens, the scored ones, then plain ones again (the prompt's
        # last position, a recompute's generated tokens): cut it where the budget runs out.
        scored_cost = len(scored) * (1 + self.score_cost)
        if offset + scored_cost <= budget:
            chunk = offset + len(scored) + int(budget - offset - scored_cost)
        else:
            chunk = offset + int((budget - offset) / (1 + self.score_cost))
        num_scored = min(len(scored), max(0, chunk - offset))
        return chunk, chunk + self.score_cost * num_scored

    def _decode_works(self, decoding: list[Sequence]) -> list[SeqWork]:
        """One work per decoding sequence: its last token, and the drafts to verify after it
        when this step speculates (at most `speculative_max_batch` decodes, and the cost model
        says the drafts' expected gain outweighs their cost); a draft model that lags is fed a
        chunk of what it lacks instead."""
        speculate = 0 < len(decoding) <= self.speculative_max_batch and self.speculative_tokens > 0
        proposals: dict[int, list[int] | int] = {}  # seq id -> n-gram drafts | model drafts
        if speculate:
            for seq in decoding:
                proposal = self._propose(seq)
                if proposal:
                    proposals[seq.seq_id] = proposal
        if proposals and self.costs is not None:
            # A draft model let through while it lags is fed until it drafts once (what the
            # gate let through is a measurement of its drafts, and one chunk would measure none).
            feeding = {seq.seq_id for seq in decoding if seq.catching_up and seq.seq_id in proposals}
            asked = {i: p for i, p in proposals.items() if i not in feeding}
            let = self._worth(decoding, asked) if asked else {}
            proposals = {i: p for i, p in proposals.items() if i in let or i in feeding}
        works = []
        for seq in decoding:
            pos = seq.num_tokens - 1
            proposal = proposals.get(seq.seq_id, [])
            seq.catching_up = False
            if isinstance(proposal, int) and seq.num_tokens - seq.num_draft_computed > self.draft_catch_up:
                seq.catching_up = True
                works.append(self._catch_up(seq))  # its draft model drafts once it has caught up
                continue
            if isinstance(proposal, int):  # the draft model drafts `proposal` tokens
                k = self._take_draft_pages(seq, proposal)
                feed = tuple(seq.tokens(seq.num_draft_computed, pos + 1)) if k else ()
                work = self._work(seq, [seq.token_at(pos)], pos, sample=True)
                works.append(
                    replace(work, draft_feed=feed, draft_pos=seq.num_draft_computed, num_model_draft=k)
                )
                continue
            drafts = proposal[: self._take_draft_pages(seq, len(proposal))]
            work = self._work(seq, [seq.token_at(pos), *drafts], pos, sample=True, num_draft=len(drafts))
            works.append(work)
        return works

    def _catch_up(self, seq: Sequence) -> SeqWork:
        """`seq`'s decode, feeding its draft model the next `draft_catch_up` tokens its KV lacks
        (it lags by more: it drafts nothing until it is within that of the sequence's end)."""
        pos = seq.num_tokens - 1
        start = seq.num_draft_computed
        feed = tuple(seq.tokens(start, start + self.draft_catch_up))
        work = self._work(seq, [seq.token_at(pos)], pos, sample=True)
        return replace(work, draft_feed=feed, draft_pos=start)

    def _worth(
        self, decoding: list[Sequence], proposals: dict[int, list[int] | int]
    ) -> dict[int, list[int] | int]:
        """The proposals worth drafting (`StepCosts`): those of the sequences whose own expected
        gain beats the verify rows they add, if the step's drafts together pay (with, now and
        then, those passed over); when no sequence's does on its own, the step's gate decides
        for all of them."""
        assert self.costs is not None
        # Each draft is accepted (given the ones before it were) at the sequence's own rate,
        # shrunk toward the engine's: (accepted + 2 * engine rate) / (accepted + refusals + 2).
        overall = (self.num_accepted_tokens + 1) / (self.num_accepted_tokens + self.num_refusals + 2)
        by_id = {seq.seq_id: seq for seq in decoding}
        expected: dict[int, float] = {}
        for seq_id, proposal in proposals.items():
            seq = by_id[seq_id]
            rate = (seq.num_accepted + 2 * overall) / (seq.num_accepted + seq.num_refusals + 2)
            expected[seq_id] = expected_accepted(_num_drafts(proposal), rate)
        kept, passed = self._kept(decoding, proposals, expected)
        candidates = {seq_id: proposals[seq_id] for seq_id in kept}

        def lag(seq_id: int) -> int:
            """What its draft model lags by beyond the token or two a drafting step feeds."""
            if not isinstance(proposals[seq_id], int):
                return 0
            return max(0, by_id[seq_id].num_tokens - by_id[seq_id].num_draft_computed - 2)

        if not self._step_pays(len(decoding), candidates, expected, sum(map(lag, candidates))):
            return {}
        # One passed over is let through once, beside drafts that pay, after `RETRY_EVERY` such
        # steps, then twice as many (up to `MAX_RETRY_EVERY`) while it stays passed over, so its
        # acceptance is measured again; a draft model's catch-up within `CATCH_UP_BUDGET`.
        plain = self.costs.estimate(len(decoding)) or 0.0
        for seq in passed:
            if seq.num_passed_over <= seq.retry_passed_over:
                continue
            if self.costs.catch_up_waits(seq.num_passed_over * plain, lag(seq.seq_id)):
                continue
            seq.num_passed_over = 0
            seq.retry_passed_over = min(MAX_RETRY_EVERY, 2 * seq.retry_passed_over)
            candidates[seq.seq_id] = proposals[seq.seq_id]
        return candidates

    def _kept(
        self, decoding: list[Sequence], proposals: dict[int, list[int] | int], expected: dict[int, float]
    ) -> tuple[set[int], list[Sequence]]:
        """The sequences whose own expected gain beats their share of the verify rows' cost
        (all of them while that cost is unmeasured, or when none's does: the step's gate then
        decides for all, its retries included), and those passed over beside them (counted in
        `Sequence.num_passed_over`). A draft model's forwards are shared by every drafting
        sequence, so only the target's rows are counted here."""
        assert self.costs is not None
        num_drafted = sum(_num_drafts(p) for p in proposals.values())
        plain = self.costs.estimate(len(decoding))
        verify = self.costs.estimate(len(decoding) + num_drafted)
        if plain is None or verify is None:
            return set(proposals), []
        per_row = (verify - plain) / num_drafted
        per_token = plain / len(decoding)
        proposing = [seq for seq in decoding if seq.seq_id in proposals]
        kept = {
            seq.seq_id
            for seq in proposing
            if expected[seq.seq_id] * per_token > _num_drafts(proposals[seq.seq_id]) * per_row
        }
        if not kept:
            return set(proposals), []
        passed = [seq for seq in proposing if seq.seq_id not in kept]
        for seq in proposing:
            if seq.seq_id in kept:
                seq.num_passed_over, seq.retry_passed_over = 0, RETRY_EVERY
            else:
                seq.num_passed_over += 1
        return kept, passed

    def _step_pays(
        self, num_decodes: int, proposals: dict[int, list[int] | int], expected: dict[int, float], lag: int
    ) -> bool:
        """Whether the step's drafts, all together, pay (`StepCosts.pays`, retries included);
        `lag`: the tokens their draft models must be fed before they draft."""
        assert self.costs is not None
        num_drafted = sum(_num_drafts(p) for p in proposals.values())
        gain = sum(expected[seq_id] for seq_id in proposals)
        forwards = max((p for p in proposals.values() if isinstance(p, int)), default=0)
        return self.costs.pays(num_decodes, num_drafted, gain, forwards, len(proposals), lag)

    def _propose(self, seq: Sequence) -> list[int] | int:
        """What `seq` would draft this step: n-gram drafts, or how many tokens the draft model
        should draft (0 or empty: none). Nothing is allocated yet.

        A draft never runs past `max_tokens` or the context: the step then gives at most the
        tokens the sequence may still produce. A draft model whose KV lags by more than
        `draft_catch_up` tokens proposes all the same, but a step that takes the proposal feeds
        it the lag first (`_catch_up`), drafting nothing, until it drafts: so the draft model is
        fed only while drafting pays or the cost model retries it (`CATCH_UP_BUDGET`).
        """
        if not seq.params.can_speculate or seq.is_pooling:
            return []
        if seq.draft_length is None:
            seq.draft_length = DraftLength(self.speculative_tokens)
        if self.draft_model:
            # Pages behind a sliding window were given back (placeholders stand in their
            # place): the draft model is never fed there, it starts after them.
            seq.num_draft_computed = max(seq.num_draft_computed, seq.num_dropped * self.pool.page_size)
        else:
            if seq.drafter is None:
                seq.drafter = NgramIndex()
            seq.drafter.extend(seq.tokens(len(seq.drafter.tokens), seq.num_tokens))
        assert seq.params.max_tokens is not None
        room = min(
            seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens
        )  # tokens it may still produce; the step gives one more than it drafts
        limit = min(seq.draft_length.current, room - 1)
        if self.draft_model:
            return max(0, limit)
        assert seq.drafter is not None
        return seq.drafter.propose(limit)

    def _take_draft_pages(self, seq: Sequence, num_drafts: int) -> int:
        """Allocate the pages `num_drafts` drafts after `seq`'s tokens need; returns how many
        drafts fit (those that find no free page are dropped, never preempting)."""
        size = self.pool.page_size
        needed = pages_for(seq.num_tokens + num_drafts, size) - len(seq.page_ids)
        if needed > 0:
            if self.pool.can_allocate(needed + self.watermark_pages):
                seq.page_ids += self.pool.allocate(needed)
            else:
                num_drafts = min(num_drafts, len(seq.page_ids) * size - seq.num_tokens)
        return max(0, num_drafts)

    def _work(
        self, seq: Sequence, tokens: list[int], start: int, *, sample: bool, num_draft: int = 0
    ) -> SeqWork:
        score_offset, score_ids = self._score_span(seq, start, start + len(tokens))
        pool_offset, num_pool_rows = self._pool_span(seq, start, start + len(tokens))
        sample = sample and not seq.is_pooling
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
            matcher=seq.matcher if sample else None,
            score_offset=score_offset,
            score_ids=score_ids,
            num_draft=num_draft,
            pool_offset=pool_offset,
            num_pool_rows=num_pool_rows,
            state_slot=seq.state_slot,
        )

    @staticmethod
    def _score_span(seq: Sequence, start: int, stop: int) -> tuple[int, tuple[int, ...]]:
        """(`score_offset`, `score_ids`) of a work feeding positions [start, stop) of `seq`.

        The logits at position p score prompt token p + 1: positions from the first unscored
        one to the prompt's last but one are scored (a recompute skips what is scored).
        """
        if not seq.wants_prompt_scores:
            return 0, ()
        first = max(start, len(seq.prompt_scores))
        last = min(stop, len(seq.prompt_ids) - 1)
        if first >= last:
            return 0, ()
        return first - start, tuple(seq.prompt_ids[first + 1 : last + 1])

    @staticmethod
    def _pool_span(seq: Sequence, start: int, stop: int) -> tuple[int, int]:
        """(`pool_offset`, `num_pool_rows`) of a work feeding positions [start, stop) of `seq`.

        Mean pools every prompt position not summed yet (a recompute after a preemption skips
        what is summed), cls position 0, last and rank the prompt's last position (rank: the
        runner applies the classification head to it).
        """
        match seq.params.pooling:
            case "mean":
                first = max(start, seq.num_pooled)
                return (first - start, stop - first) if first < stop else (0, 0)
            case "cls":
                return (0, 1) if start == 0 and seq.num_pooled == 0 else (0, 0)
            case "last" | "rank":
                return (stop - 1 - start, 1) if stop == len(seq.prompt_ids) else (0, 0)
            case _:
                return 0, 0

    def _fold_pooled(self, seq: Sequence, work: SeqWork, pooled: PoolSum | None) -> EmbeddingOut | None:
        """Add a pooling work's sum to its sequence; once its prompt is computed, release it
        and return its pooled vector (mean: the sum over the prompt's length)."""
        if work.num_pool_rows:
            assert pooled is not None, "the runner returns a PoolSum for each pooling work"
            if seq.pool_sum:
                seq.pool_sum = [a + b for a, b in zip(seq.pool_sum, pooled.values, strict=True)]
            else:
                seq.pool_sum = list(pooled.values)
            seq.num_pooled = work.start_pos + work.pool_offset + work.num_pool_rows
        if seq.num_computed < seq.num_tokens:
            return None
        count = len(seq.prompt_ids) if seq.params.pooling == "mean" else 1
        self._release(seq)
        return EmbeddingOut(
            seq.uid, seq.seq_id, tuple(v / count for v in seq.pool_sum), seq.num_cached_prompt
        )

    def on_step_done(self, batch: Batch, done: StepDone) -> list[TokenOut | EmbeddingOut | SeqFailed]:
        """Fold a finished step back in; return the tokens, embeddings and failures to route out."""
        outs: list[TokenOut | EmbeddingOut | SeqFailed] = []
        failed = dict(done.failed)
        num_sampled: dict[int, int] = {}
        for sampled in done.sampled:
            num_sampled[sampled.seq_id] = num_sampled.get(sampled.seq_id, 0) + 1
        pooled = {p.seq_id: p for p in done.pooled}
        self._fold_loads(batch.loads, dict(done.loaded))
        for work in batch.works:
            seq = self.running.get(work.seq_id)
            if seq is None or work.seq_id in failed:
                continue
            # A verified draft's KV stays; a rejected one's slots are past `num_computed` (to be
            # overwritten) and never registered in the prefix cache.
            num_drafts = work.num_draft + work.num_model_draft
            num_accepted = max(0, min(num_drafts, num_sampled.get(work.seq_id, 1) - 1))
            seq.num_computed = work.start_pos + len(work.token_ids) - work.num_draft + num_accepted
            if work.draft_feed:
                # The draft model fed its feed, then each draft but the last: what it holds of
                # the accepted ones stays valid, the rest is overwritten when fed again.
                fed = (
                    work.draft_pos
                    + len(work.draft_feed)
                    + min(num_accepted, max(0, work.num_model_draft - 1))
                )
                held = max(seq.num_draft_computed // self.pool.page_size, seq.num_dropped)
                seq.num_draft_computed = min(fed, seq.num_computed)
                # Its full pages now hold the draft's KV too: a prefix-cache hit keeps it.
                self.pool.mark_drafted(seq.page_ids[held : seq.num_draft_computed // self.pool.page_size])
            if num_drafts:
                self.num_verifications += 1
                self.num_draft_tokens += num_drafts
                self.num_accepted_tokens += num_accepted
                seq.num_drafted += num_drafts
                seq.num_accepted += num_accepted
                if num_accepted < num_drafts:
                    self.num_refusals += 1
                    seq.num_refusals += 1
                assert seq.draft_length is not None
                seq.draft_length.update(num_drafts, num_accepted)
            self._register_full_pages(seq)
            self._drop_out_of_window(seq)
            if self.states is not None:
                self._at_state_boundary(seq)
            if seq.is_pooling:
                embedded = self._fold_pooled(seq, work, pooled.get(work.seq_id))
                if embedded is not None:
                    outs.append(embedded)
        for seq_id, error in failed.items():
            seq = self.running.get(seq_id)
            if seq is not None:
                self.abort(seq.uid)
                outs.append(SeqFailed(seq.uid, error))
        for scored in done.scored:
            seq = self.running.get(scored.seq_id)
            if seq is not None:
                seq.prompt_scores.extend(scored.scores)
        for sampled in done.sampled:
            seq = self.running.get(sampled.seq_id)
            if seq is None:
                continue
            seq.output_ids.append(sampled.token_id)
            finish = self._finish_check(seq, sampled.token_id)
            is_first_with_scores = len(seq.output_ids) == 1 and seq.params.prompt_logprobs is not None
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
                    prompt_logprobs=tuple(seq.prompt_scores) if is_first_with_scores else (),
                )
            )
            if finish.reason is not None:
                self._release(seq)
        for work in batch.works:
            seq = self.running.get(work.seq_id)
            if (work.num_draft or work.num_model_draft) and seq is not None:
                self._trim_pages(seq)
        self._observe_costs(batch, done)
        return outs

    def _fold_loads(self, loads: Iterable[PageLoad], loaded: dict[int, int]) -> None:
        """Count the pages each load read from disk as computed (and cached prompt tokens);
        the rest of its prompt, from the first page that did not load, is prefilled."""
        size = self.pool.page_size
        for load in loads:
            seq = self.running.get(load.seq_id)
            if seq is None:  # aborted while its pages were read: they were freed with it
                continue
            seq.num_loading = 0
            n = loaded.get(load.seq_id, 0)
            first = seq.num_computed // size  # the loads' pages follow the pages it matched
            for i in range(n):
                self.pool.register(seq.page_ids[first + i], load.keys[i])
            seq.num_registered = first + n
            seq.num_computed += n * size
            self.num_prefix_hit_tokens += n * size
            self.num_disk_hit_tokens += n * size
            if not seq.output_ids:
                seq.num_cached_prompt = min(seq.num_computed, len(seq.prompt_ids))
            self._drop_out_of_window(seq)

    def _on_evict(self, page: int, key: int) -> None:
        """A cached page is evicted from RAM: save it to disk unless it is there already (its
        write at registration was dropped, or the disk tier evicted it since)."""
        assert self.disk is not None
        if key not in self._saves and not self.disk.contains(key):
            self._saves[key] = PageSave(page, key)

    def _observe_costs(self, batch: Batch, done: StepDone) -> None:
        """Fold a step that only decoded (no prefill chunk, nothing failed) into the cost model."""
        if self.costs is None or done.failed or done.duration_s <= 0.0:
            return
        if any(len(w.token_ids) - w.num_draft != 1 or w.start_pos < w.num_prompt_tokens for w in batch.works):
            return
        rows = sum(len(w.token_ids) + w.num_model_draft for w in batch.works)
        forwards = max((w.num_model_draft for w in batch.works), default=0)
        drafting = sum(1 for w in batch.works if w.num_model_draft)
        # A drafting work feeds its draft model one or two tokens (two after a draft accepted
        # whole); more, or a feed without drafts, is a catch-up.
        catching_up = [
            w for w in batch.works if len(w.draft_feed) > 2 or (w.draft_feed and not w.num_model_draft)
        ]
        if catching_up:
            # A catch-up is not what drafting costs, but the target's time is its time (each
            # request's first drafts come with a catch-up: were that step not measured, the
            # verify rows would stay unmeasured, and measured first every time).
            self.costs.observe(rows, done.duration_s, done.draft_s)
            fed = sum(len(w.draft_feed) for w in catching_up)
            self.costs.observe_catch_up(fed, done.draft_s, forwards, drafting)
            return
        self.costs.observe(rows, done.duration_s, done.draft_s, forwards, drafting)

    def _trim_pages(self, seq: Sequence) -> None:
        """Free the pages past what `seq`'s tokens need (taken for drafts it did not keep)."""
        keep = max(pages_for(seq.num_tokens, self.pool.page_size), seq.num_registered)
        if len(seq.page_ids) > keep:
            self.pool.release(seq.page_ids[keep:])
            del seq.page_ids[keep:]

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
        full = min(seq.num_computed // size, len(seq.page_ids))
        if seq.num_registered >= full:
            return
        hashes = self._page_hashes(seq, full)
        for i in range(max(seq.num_registered, seq.num_dropped), full):  # a placeholder is no content
            if self.pool.register(seq.page_ids[i], hashes[i]) and self.disk is not None:
                if not self.disk.contains(hashes[i]):
                    self._saves[hashes[i]] = PageSave(seq.page_ids[i], hashes[i])
        seq.num_registered = full

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Give back the pages wholly behind the window of every position `seq` will still
        compute (from `num_computed` on: position q attends q - kv_window + 1 .. q).

        A dropped page keeps its place in `page_ids` as a placeholder (a valid page id, so the
        block table keeps its layout; attention masks it out). A registered page goes back as a
        cached prefix page like any other: its KV is a function of the tokens before it, right
        for any sequence that shares them; the sequence's own later pages stay registered and a
        new match stops at the first page evicted.
        """
        if not self.kv_window:
            return
        dead = min(self._num_behind_window(seq.num_computed), len(seq.page_ids))
        if dead <= seq.num_dropped:
            return
        self.pool.release(seq.page_ids[seq.num_dropped : dead])
        placeholder = seq.page_ids[dead] if dead < len(seq.page_ids) else seq.page_ids[0]
        for i in range(seq.num_dropped, dead):
            seq.page_ids[i] = placeholder
        self.num_dropped_pages += dead - seq.num_dropped
        seq.num_dropped = dead
