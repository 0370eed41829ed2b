"""Decode steps replayed as CUDA graphs, one per (batch, context) bucket, captured on first use.

A decode-only step of `n` rows whose longest sequence reaches `L` positions runs as the bucket
`(B, Lb)`: `B` the first of `BATCH_BUCKETS` >= n, `Lb` the first power of two >= L (at least
`MIN_CONTEXT`). The step's only host-to-device copy is one `[B, 2 + Lb / page_size]` int64
tensor: each row's token id, position and page table. Everything else (slots, the attention
mask, the KV writes) is computed inside the graph from it. Padding rows feed token 0 at
position 0 on a scratch page the scheduler never hands out, so they write and read nothing real.
Steps with prompt chunks, or beyond the largest bucket, run eagerly.

Graphs share one memory pool. That is safe because a graph's output is read (the lm_head and
sampling) before any other graph is replayed.

`GraphedRunner` is the float runner whose decode steps replay them: one rank, no fbgemm int8
linears, no expert layers (their work is sized from the routing, a host sync).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.architectures import by_name
from ft.model.attention import AttentionMetadata
from ft.model.float_runner import FloatRunner
from ft.model.llama import LlamaForCausalLM
from ft.model.loader import LoadedModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT = 256

log = logging.getLogger("ft.model")


def context_bucket(length: int, page_size: int) -> int:
    """The first power of two >= `length` (at least `MIN_CONTEXT`), in whole pages."""
    bucket = MIN_CONTEXT
    while bucket < length:
        bucket *= 2
    return -(-bucket // page_size) * page_size


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [B, 2 + pages] int64 on the device: token id, position, page table
    staging: torch.Tensor  # the same, pinned on the host
    hidden: torch.Tensor  # [B, hidden]: the graph's output
    copied: torch.cuda.Event  # recorded once `staging` has been copied to `inputs`


class DecodeGraphs:
    """Captured decode forwards of `model` over its KV cache (`k_cache`/`v_cache` with
    `scratch_page` reserved for padding rows)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        page_size: int,
        scratch_page: int,
        max_context: int,
    ) -> None:
        self.model = model
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.max_context = context_bucket(max_context, page_size)
        self.device = k_cache.device
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._uncapturable: set[tuple[int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    @property
    def num_captured(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def bucket(self, num_rows: int, max_len: int) -> tuple[int, int] | None:
        """The `(batch, context)` bucket of a decode step, or None when it runs eagerly."""
        batch = next((b for b in BATCH_BUCKETS if b >= num_rows), None)
        context = context_bucket(max_len, self.page_size)
        if batch is None or context > self.max_context:
            return None
        return batch, context

    def run(
        self, token_ids: list[int], positions: list[int], page_ids: list[tuple[int, ...]]
    ) -> torch.Tensor | None:
        """Hidden states `[n, hidden]` of a decode step (one token per row), or None when the
        step has no bucket (run it eagerly)."""
        bucket = self.bucket(len(token_ids), max(positions) + 1)
        if bucket is None:
            return None
        graph = self._graphs.get(bucket)
        if graph is None:
            if bucket in self._uncapturable:
                return None
            try:
                graph = self._capture(*bucket)
            except Exception:
                # NOTE: out of memory for a large bucket, or an op that cannot be captured: that
                # bucket runs eagerly from now on rather than failing (and recapturing) every
                # step. (Unverified on a GPU: the capture's stream state after a failure.)
                log.warning("decode graph %s could not be captured; it runs eagerly", bucket, exc_info=True)
                self._uncapturable.add(bucket)
                return None
        packed = self._inputs(token_ids, positions, page_ids, *bucket)
        graph.copied.synchronize()  # the last copy out of `staging` is done (it almost always is)
        graph.staging.copy_(packed)
        graph.inputs.copy_(graph.staging, non_blocking=True)  # the step's one host-to-device copy
        graph.copied.record()
        graph.graph.replay()
        return graph.hidden[: len(token_ids)]

    def run_eagerly(
        self, token_ids: list[int], positions: list[int], page_ids: list[tuple[int, ...]]
    ) -> torch.Tensor:
        """What `run` computes, without a graph (on any device: the tests run it on the CPU)."""
        bucket = self.bucket(len(token_ids), max(positions) + 1)
        assert bucket is not None
        inputs = self._inputs(token_ids, positions, page_ids, *bucket).to(self.device)
        return self._forward(inputs, bucket[1])[: len(token_ids)]

    def _inputs(
        self,
        token_ids: list[int],
        positions: list[int],
        page_ids: list[tuple[int, ...]],
        batch: int,
        context: int,
    ) -> torch.Tensor:
        """The packed host tensor `[batch, 2 + pages]`, padding rows included."""
        pages = context // self.page_size
        rows = []
        for token, pos, own in zip(token_ids, positions, page_ids, strict=True):
            table = list(own[:pages])
            rows.append([token, pos, *table, *[self.scratch_page] * (pages - len(table))])
        rows += [[0, 0, *[self.scratch_page] * pages]] * (batch - len(rows))
        return torch.tensor(rows, dtype=torch.long)

    def _forward(self, inputs: torch.Tensor, context: int) -> torch.Tensor:
        """The decode forward from the packed inputs (captured; also run eagerly to warm up)."""
        page = self.page_size
        ids, pos, table = inputs[:, 0], inputs[:, 1], inputs[:, 2:]  # [B], [B], [B, pages]
        kv_pos = torch.arange(context, device=inputs.device)  # [Lb]
        slots = table[:, kv_pos // page] * page + kv_pos % page  # [B, Lb]
        write = table.gather(1, (pos // page)[:, None]).squeeze(1) * page + pos % page  # [B]
        causal = kv_pos[None, :] <= pos[:, None]  # [B, Lb]
        window = self.model.config.sliding_window
        meta = AttentionMetadata(
            slot_mapping=write,
            decode_rows=torch.arange(inputs.shape[0], device=inputs.device),
            decode_slots=slots,
            decode_mask=causal[:, None, None, :],  # [B, 1, 1, Lb]
            decode_is_all=True,
            prefills=(),
            num_tokens=inputs.shape[0],
            decode_window_mask=(causal & (kv_pos[None, :] > pos[:, None] - window))[:, None, None, :]
            if window
            else None,
        )
        hidden: torch.Tensor = self.model(ids, pos, self.k_cache, self.v_cache, meta)  # [B, hidden]
        return hidden

    def _capture(self, batch: int, context: int) -> _Graph:
        pages = context // self.page_size
        padding = torch.tensor([[0, 0, *[self.scratch_page] * pages]] * batch, dtype=torch.long)
        inputs = padding.to(self.device)
        staging = padding.pin_memory()
        # Warm up on a side stream (allocator and kernel selection), as torch.cuda.graph asks.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(inputs, context)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(inputs, context)
        copied = torch.cuda.Event()
        copied.record()
        captured = _Graph(graph, inputs, staging, hidden, copied)
        self._graphs[batch, context] = captured
        return captured


class GraphedRunner(FloatRunner):
    """A `FloatRunner` on a CUDA device whose decode steps (one token per row, within a bucket)
    replay `DecodeGraphs`; prompt chunks and larger steps run eagerly."""

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
    ) -> None:
        # NOTE: tensor-parallel steps stay eager (their all_reduce calls are not captured), and
        # so do expert layers (they size their work from the routing: a host sync).
        if device is None or device.type == "cpu":
            raise ValueError("CUDA graphs need a CUDA device")
        if loaded.config.num_experts:
            raise ValueError("expert layers cannot be captured in CUDA graphs")
        if by_name(loaded.config.architecture).decoder != "llama":
            raise ValueError(f"{loaded.config.architecture}'s decode steps are not captured in CUDA graphs")
        super().__init__(
            loaded,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            threads=threads,
            kv_dtype=kv_dtype,
            device=device,
        )
        assert isinstance(self.model, LlamaForCausalLM)  # (Gemma 4's was refused above)
        self.graphs = DecodeGraphs(
            self.model,
            self.k_cache,
            self.v_cache,
            page_size=page_size,
            scratch_page=num_pages,  # the cache's one page more than the scheduler hands out
            max_context=self.config.max_position_embeddings,
        )

    def _hidden(self, works: list[SeqWork], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        if len(token_ids) == len(works):  # a decode step
            graphed = self.graphs.run(token_ids, positions, [w.page_ids for w in works])
            if graphed is not None:
                self.heartbeat.beat()  # the captured layers cannot beat: once a replay
                return graphed
        return super()._hidden(works, token_ids, positions)
