"""`TorchRunner`: what every runner behind the `Runner` protocol shares (the paged KV cache,
sampling, prompt scoring, pooling, the tensor-parallel step protocol); its subclasses compute the
hidden states (`ft.model.runners`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ft.core.batch import Heartbeat, PoolSum, RowsFailed, Scored, SeqWork, StateCopy, StepOutput
from ft.model import kernels, kv_layout
from ft.model.llama import LlamaConfig
from ft.model.loader import LoadedModel
from ft.model.masks import StepMasks
from ft.model.parallel import steps
from ft.model.parallel.group import RankGroup
from ft.model.parallel.shard import local_config
from ft.model.sampler import sample, score_tokens
from ft.model.speculative import sample_with_drafts
from ft.model.threads import ThreadChooser, thread_choices
from ft.params import first_outside_vocab

if TYPE_CHECKING:
    from ft.model.recurrent import StateSpan, StateTensors


def softcapped(
    head: Callable[[torch.Tensor], torch.Tensor], cap: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`head`'s logits as tanh(logits / cap) * cap (Gemma 2's final soft-capping)."""

    def run(rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(head(rows) / cap) * cap

    return run


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose memory is only made resident when written.

    NOTE: `torch.zeros` writes every byte, so a 1 GiB KV budget was 1 GiB resident from the
    start; numpy's calloc-backed zeros map zero pages lazily, so resident memory follows the
    pages in use.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    if not count:  # (an empty buffer cannot be viewed as another dtype; nothing to map)
        return torch.zeros(shape, dtype=dtype)
    raw = torch.from_numpy(np.zeros(count * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


SCORE_ROWS = 256  # prompt positions scored per vocabulary projection (prompt logprobs)


class TorchRunner:
    """What every runner shares: batched steps of a Llama-family model over `num_pages` KV pages
    of `page_size` slots, sampling, prompt scoring, pooling, and the pages in and out.

    The KV cache is two tensors `[num_layers, num_pages * page_size, kv_heads, head_dim]` (a
    model whose layers store KV of different shapes: `[1, slots, 1, width]`, `kv_layout`; a
    hybrid model's attention layers only); the scheduler owns which pages a sequence uses and
    passes them in each `SeqWork`. A hybrid model's recurrent layers keep their states in
    `num_state_slots` slots (`states`, a `StateTensors` the subclass makes with its model; it is
    a `ft.core.batch.StateRunner` then): the subclass's forward leaves the new states in
    `_new_states`, written only once the step has succeeded, so a failed step leaves every slot
    as it was and the runner actor's per-sequence rerun is exact. How the
    hidden states of a step are computed is the subclass's (`_hidden`): `PackedRunner` (the
    GGUF's blocks through the native kernels), `FloatRunner` (a torch model) and
    `GraphedRunner` (a float model whose decode steps replay CUDA graphs); `build_runner`
    (`ft.model.runners`) chooses one.

    Weights, KV cache and sampling live on `device`. With `ranks` (tensor parallelism) this is
    one rank's runner: it holds that rank's heads, MLP columns, kv heads and vocabulary slice.
    Rank 0's `forward` broadcasts each step's description first; the other ranks run `follow`,
    which runs the same forwards until rank 0 sends "stop" (`close`).

    `heartbeat` beats once a layer and once a block of scored rows, however the hidden states
    are computed: the engine's watchdog reads it to tell a long step from a hung one.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        threads: int | None = None,
        kv_dtype: kernels.KVDtype | None = None,
        device: torch.device | None = None,
        ranks: RankGroup | None = None,
        num_state_slots: int = 0,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        if threads is not None:
            torch.set_num_threads(threads)
        # A fixed thread count is the caller's; otherwise measure which count is faster here.
        self._threads = ThreadChooser((threads,) if threads else thread_choices(torch.get_num_threads()))
        self.config = loaded.config
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.ranks = ranks
        self._lock = threading.Lock()  # one forward (one sequence of collectives) at a time
        self.heartbeat = Heartbeat()
        self._page_size = page_size
        self._num_pages = num_pages
        if loaded.config.is_hybrid and num_state_slots < 1:
            raise ValueError("a model with recurrent layers needs recurrent state slots (num_state_slots)")
        self._num_state_slots = num_state_slots if loaded.config.is_hybrid else 0
        self.states: StateTensors | None = None  # the subclass's, when the model is a hybrid
        self._new_states: tuple[list[StateSpan], list[list[tuple[torch.Tensor, ...]]]] | None = None
        # A reranker's head, applied to rank-pooled rows (`_pool`); None: the model has none.
        self.classifier = loaded.classifier.to(self.device) if loaded.classifier is not None else None
        c = loaded.config
        self.kv_dtype: kernels.KVDtype = kv_dtype or dtype
        shapes = c.kv_shapes  # the layers that store KV (`ft.model.kv_layout`)
        if ranks is not None:
            if not kv_layout.is_uniform(shapes):
                raise ValueError(f"{c.architecture}'s layers of different KV shapes run in one process")
            shapes = ((local_config(c, ranks.shard).num_kv_heads, c.head_dim),) * c.num_kv_layers
        _, storage = kernels.kv_cache_layout(self.kv_dtype, c.head_dim)  # raises for q8_0 on odd heads
        shape = kv_layout.cache_shape(shapes, num_pages * page_size, self.kv_dtype)
        if self.device.type == "cpu":
            self.k_cache = lazy_zeros(shape, storage)
            self.v_cache = lazy_zeros(shape, storage)
        else:
            # One more page than the scheduler hands out: the decode graphs' padding rows use it.
            shape = (shape[0], (num_pages + 1) * page_size, *shape[2:])
            self.k_cache = torch.zeros(shape, dtype=storage, device=self.device)
            self.v_cache = torch.zeros(shape, dtype=storage, device=self.device)
        self._lm_head: Callable[[torch.Tensor], torch.Tensor] = _no_head

    def _set_lm_head(self, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The subclass's vocabulary projection; Gemma 2's logits soft-capped once, after it."""
        cap = self.config.final_softcap
        self._lm_head = softcapped(head, cap) if cap else head

    def _hidden(self, works: list[SeqWork], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Feed the step's tokens (writing their KV); the hidden states `[T, hidden]` after the
        final norm. The subclass's: this is where the runners differ."""
        raise NotImplementedError

    @staticmethod
    def bytes_per_page(config: LlamaConfig, page_size: int, dtype: kernels.KVDtype, world: int = 1) -> int:
        """KV bytes one page takes across the layers that store KV (keys and values; Gemma 4's
        KV-sharing layers and a hybrid's recurrent layers store none) on the busiest of `world`
        ranks (the first ranks take one more kv head when the heads do not divide evenly); a
        q8_0 head takes 34 bytes per 32 elements (float16: 64)."""
        return page_size * kv_layout.bytes_per_slot(config.kv_shapes, dtype, world)

    @property
    def num_state_slots(self) -> int:
        """Recurrent state slots held (0: the model has no recurrent layers)."""
        return self._num_state_slots

    def copy_states(self, copies: Sequence[StateCopy]) -> None:
        """Run a batch's recurrent state copies, in order (`ft.core.batch.StateRunner`).

        Raises:
            ValueError: the model has no recurrent layers, or a slot is out of range.
        """
        if self.states is None:
            raise ValueError("the model has no recurrent layers: no states to copy")
        self.states.copy(copies)

    def _commit_states(self) -> None:
        """Write the states the last forward returned into their slots (the step succeeded)."""
        if self._new_states is not None and self.states is not None:
            self.states.write(*self._new_states)
        self._new_states = None

    @property
    def page_payload_bytes(self) -> int:
        """Bytes of one page's K and V over every layer (the disk tier's payload)."""
        k = self.k_cache
        return 2 * k.shape[0] * self._page_size * k.shape[2] * k.shape[3] * k.element_size()

    def page_payload(self, page: int) -> list[np.ndarray]:
        """A copy of page `page`'s K and V `[layers, page_size, kv_heads, last]` as bytes, in
        host memory (safe to keep once the page is reused)."""
        slots = slice(page * self._page_size, (page + 1) * self._page_size)
        return [
            cache[:, slots].to("cpu", copy=True).contiguous().view(torch.uint8).numpy()
            for cache in (self.k_cache, self.v_cache)
        ]

    def load_page(self, page: int, payload: memoryview) -> None:
        """Write `payload` (a `page_payload`'s bytes) into page `page`'s K and V."""
        if payload.nbytes != self.page_payload_bytes:
            raise ValueError(f"a page's payload is {self.page_payload_bytes} bytes, got {payload.nbytes}")
        slots = slice(page * self._page_size, (page + 1) * self._page_size)
        half = payload.nbytes // 2
        for cache, part in ((self.k_cache, payload[:half]), (self.v_cache, payload[half:])):
            shape = (cache.shape[0], self._page_size, *cache.shape[2:])
            values = torch.frombuffer(part, dtype=torch.uint8).view(cache.dtype).view(shape)
            cache[:, slots].copy_(values)

    @property
    def page_size(self) -> int:
        """Slots per KV page."""
        return self._page_size

    @property
    def num_pages(self) -> int:
        """KV pages allocated."""
        return self._num_pages

    @property
    def vocab_size(self) -> int:
        """Rows of the lm_head."""
        return self.config.vocab_size

    def _check(self, work: SeqWork) -> None:
        if not work.token_ids:
            raise ValueError(f"seq {work.seq_id}: a step must feed at least one token")
        end = work.start_pos + len(work.token_ids)
        if work.start_pos < 0 or end > self.config.max_position_embeddings * 4:
            raise ValueError(f"seq {work.seq_id}: positions up to {end} are out of range")
        needed = (end + self._page_size - 1) // self._page_size
        pages = work.page_ids[:needed]
        if len(pages) < needed or (pages and (min(pages) < 0 or max(pages) >= self._num_pages)):
            raise ValueError(f"seq {work.seq_id}: page_ids {work.page_ids} cannot hold {end} positions")
        # NOTE: a request's ids are checked before they get here (the tokenizer actor checks a
        # prompt's ids; the load refuses a tokenizer with more tokens than embedding rows); this
        # stays as the native embedding lookup's own guard, so an id that slipped through (a
        # sampled one, a bug) fails one row as a model error instead of reading past the table.
        bad = first_outside_vocab(work.token_ids, self.config.vocab_size)
        if bad is not None:
            raise ValueError(f"seq {work.seq_id}: token id {bad} outside the vocabulary")
        if self.states is not None and not 0 <= work.state_slot < self._num_state_slots:
            raise ValueError(f"seq {work.seq_id}: state slot {work.state_slot} of {self._num_state_slots}")

    def step(
        self, works: list[SeqWork], draft_probs: dict[int, torch.Tensor] | None = None
    ) -> list[StepOutput]:
        """Run one forward pass; return one `Sampled` per work with `sample=True`, in order,
        then one `Scored` per work with `score_ids` and one `PoolSum` per pooling work.

        `draft_probs` (a draft model's sampled drafts): seq id -> the `[num_draft, vocab]`
        distributions its drafts were drawn from (absent: one-hot drafts).
        """
        with self._threads.timed(sum(len(w.token_ids) for w in works)) as threads:
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            try:
                out = self._step(works, draft_probs)
            except RowsFailed:
                self._commit_states()  # the step ran: its other rows go on from it
                raise
            except BaseException:
                self._new_states = None  # a failed step leaves every state slot as it was
                raise
            self._commit_states()
            return out

    def _step(
        self, works: list[SeqWork], draft_probs: dict[int, torch.Tensor] | None = None
    ) -> list[StepOutput]:
        rows = [w for w in works if w.sample]
        masks = StepMasks.start(rows, self.vocab_size)  # computed while the model runs
        try:
            logits, scored = self._forward_locked(works)
            if logits is None:
                return list(scored)
            with torch.inference_mode():
                if any(w.num_draft for w in rows):
                    groups = sample_with_drafts(logits, rows, masks, draft_probs)
                else:
                    if masks is not None:
                        masks.apply(logits)
                    groups = [[s] for s in sample(logits, rows)]
        finally:
            if masks is not None:
                masks.wait()  # a failed step leaves no mask computation behind (but late ones)
        sampled = [s for group in groups for s in group]
        if masks is None:
            return [*sampled, *scored]
        try:  # raises `RowsFailed` when a row's grammar failed or ran over its budget
            masks.accept(groups)
        except RowsFailed as e:
            dropped = {seq_id for seq_id, _ in e.failed}
            e.sampled = [*(s for s in sampled if s.seq_id not in dropped), *scored]
            raise
        return [*sampled, *scored]

    def forward(self, works: list[SeqWork]) -> torch.Tensor | None:
        """Feed every work's tokens (writing their KV and recurrent states); logits `[R, vocab]`
        of the sampling rows (a work with drafts has one per draft and one for the token before
        them)."""
        try:
            logits = self._forward_locked(works)[0]
        except BaseException:
            self._new_states = None
            raise
        self._commit_states()
        return logits

    def _forward_locked(self, works: list[SeqWork]) -> tuple[torch.Tensor | None, list[Scored | PoolSum]]:
        """`forward`, and the `Scored` of the works with `score_ids`, the `PoolSum` of the
        pooling works."""
        if not works:
            return None, []
        for work in works:
            self._check(work)
        if self.states is not None and len({w.state_slot for w in works}) < len(works):
            raise ValueError("two works of one step share a recurrent state slot")
        with self._lock:
            if self.ranks is None:
                return self._forward(works)
            return steps.lead(self.ranks, works, self._forward)

    def follow(self) -> None:
        """Ranks other than 0: run the steps rank 0 broadcasts until it sends "stop".

        Raises:
            RankFailure: rank 0 died or the group broke.
        """
        assert self.ranks is not None
        steps.follow(self.ranks, self._forward)

    def close(self, timeout_s: float = 10.0) -> None:
        """Rank 0: end the other ranks' step loops (they then leave the group).

        Raises:
            RankFailure: a step is still running after `timeout_s` (it hangs), or the ranks are gone.
        """
        if self.ranks is not None:
            steps.stop_followers(self.ranks, self._lock, timeout_s)

    def _forward(self, works: list[SeqWork]) -> tuple[torch.Tensor | None, list[Scored | PoolSum]]:
        if self.device.type != "cuda":
            return self._forward_on_device(works)
        # NOTE: steps run in whichever thread trio lends; streams, events and graphs follow the
        # thread's current device, which must be ours (rank r of a node runs on its own GPU).
        with torch.cuda.device(self.device):
            return self._forward_on_device(works)

    def _forward_on_device(self, works: list[SeqWork]) -> tuple[torch.Tensor | None, list[Scored | PoolSum]]:
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for work in works:
            token_ids.extend(work.token_ids)
            positions.extend(range(work.start_pos, work.start_pos + len(work.token_ids)))
            if work.sample:  # the last fed token's row, and each draft's before it
                sample_rows.extend(range(len(token_ids) - 1 - work.num_draft, len(token_ids)))
        with torch.inference_mode():
            hidden = self._hidden(works, token_ids, positions)
            logits = None
            if sample_rows:
                rows = hidden if len(sample_rows) == len(token_ids) else hidden[sample_rows]  # [R, hidden]
                logits = self._lm_head(rows)  # [R, vocab]
            return logits, [*self._score(works, hidden), *self._pool(works, hidden)]

    def _pool(self, works: list[SeqWork], hidden: torch.Tensor) -> list[PoolSum]:
        """The pooling works' rows of `hidden` `[T, hidden]` (after the final norm), summed.

        In float64, so a prompt's mean does not depend on how it was chunked beyond the last
        bits; the scheduler adds a sequence's chunks and divides. A rank work's one row (its
        prompt's last) goes through the classification head: its "sum" is the head's outputs.
        """
        out: list[PoolSum] = []
        base = 0
        for work in works:
            if work.num_pool_rows:
                first = base + work.pool_offset
                rows = hidden[first : first + work.num_pool_rows]  # [P, hidden]
                total = rows.double().sum(dim=0)  # [hidden]
                if work.params.pooling == "rank":
                    if self.classifier is None:
                        raise ValueError("rank pooling needs a classification head; this model has none")
                    total = self.classifier(total[None])[0]  # [num_labels]
                out.append(PoolSum(work.seq_id, tuple(total.cpu().tolist())))
            base += len(work.token_ids)
        return out

    def _score(self, works: list[SeqWork], hidden: torch.Tensor) -> list[Scored]:
        """Prompt logprobs of the works with `score_ids`, from their rows of `hidden` `[T, hidden]`.

        The vocabulary projection runs `SCORE_ROWS` rows at a time: a whole 8k-token prompt's
        logits would be 1.6 GB at the default model's 49k vocabulary. (Every rank runs this
        too, with the same slices: the gathered lm_head is a collective.)
        """
        out: list[Scored] = []
        base = 0
        for work in works:
            if work.score_ids:
                first = base + work.score_offset
                top = work.params.prompt_logprobs or 0
                scores = []
                for lo in range(0, len(work.score_ids), SCORE_ROWS):
                    targets = list(work.score_ids[lo : lo + SCORE_ROWS])
                    logits = self._lm_head(hidden[first + lo : first + lo + len(targets)])  # [S, vocab]
                    scores += score_tokens(logits, targets, top)
                    self.heartbeat.beat()
                out.append(Scored(work.seq_id, tuple(scores)))
            base += len(work.token_ids)
        return out


def _no_head(rows: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("the runner's subclass sets its lm_head")
