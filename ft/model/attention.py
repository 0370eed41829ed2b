"""Paged attention over a flat slot cache: where each new token's k/v goes and what each query sees.

The KV cache of one layer is `[num_slots, kv_heads, head_dim]` with `num_slots = num_pages *
page_size`; position p of a sequence lives at slot `page_ids[p // page_size] * page_size +
p % page_size`. Decode rows (one new token) are attended together in one batched call over a
padded gather of their slots; each prefill chunk is attended on its own with a causal mask that
is offset by the chunk's `start_pos`, so chunks may sit on top of earlier chunks or shared pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """One sequence's new tokens: positions `[start_pos, start_pos + num_tokens)` in `page_ids`."""

    start_pos: int
    num_tokens: int
    page_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A multi-token span: rows `[row_start, row_end)` of the flat batch and the slots they see."""

    row_start: int
    row_end: int
    slots: torch.Tensor  # [kv_len] long
    mask: torch.Tensor  # [q_len, kv_len] bool, True = attend
    # the windowed layers': the slots of the positions the chunk's window reaches, [window_len],
    # and their mask [q_len, window_len]
    window_slots: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step indices shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: where each new token's k/v is written
    decode_rows: torch.Tensor  # [B] long: rows of the flat batch that are single-token spans
    decode_slots: torch.Tensor  # [B, max_kv_len] long (padded with slot 0)
    decode_mask: torch.Tensor  # [B, 1, 1, max_kv_len] bool, True = attend
    decode_is_all: bool  # every row is a decode row, in order
    prefills: tuple[PrefillChunk, ...]
    num_tokens: int
    # the windowed layers' decode slots [B, window_len] (each row's last positions) and mask
    # [B, 1, 1, window_len]; without the slots (the decode graphs), a mask over `decode_slots`
    decode_window_slots: torch.Tensor | None = None
    decode_window_mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same indices on `device` (built on the CPU, copied once per step)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return move(t) if t is not None else None

        return AttentionMetadata(
            slot_mapping=move(self.slot_mapping),
            decode_rows=move(self.decode_rows),
            decode_slots=move(self.decode_slots),
            decode_mask=move(self.decode_mask),
            decode_is_all=self.decode_is_all,
            prefills=tuple(
                PrefillChunk(
                    c.row_start,
                    c.row_end,
                    move(c.slots),
                    move(c.mask),
                    maybe(c.window_slots),
                    maybe(c.window_mask),
                )  # fmt: skip
                for c in self.prefills
            ),
            num_tokens=self.num_tokens,
            decode_window_slots=maybe(self.decode_window_slots),
            decode_window_mask=maybe(self.decode_window_mask),
        )


def _slots(page_ids: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of each position: `page_ids[..., p // page_size] * page_size + p % page_size`."""
    return page_ids[..., positions // page_size] * page_size + positions % page_size


def build_metadata(spans: list[SeqSpan], page_size: int, window: int = 0) -> AttentionMetadata:
    """Index tensors for one step over `spans` (in flat-batch order); with `window`, the masks
    of the windowed layers too (position q attends p when q - window < p <= q)."""
    slot_chunks: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_spans: list[SeqSpan] = []
    prefills: list[PrefillChunk] = []
    row = 0
    for span in spans:
        end = span.start_pos + span.num_tokens
        needed = (end + page_size - 1) // page_size
        if len(span.page_ids) < needed:
            raise ValueError(f"{len(span.page_ids)} pages cannot hold {end} positions")
        pages = torch.tensor(span.page_ids[:needed], dtype=torch.long)
        new_pos = torch.arange(span.start_pos, end)
        slot_chunks.append(_slots(pages, new_pos, page_size))
        if span.num_tokens == 1:
            decode_rows.append(row)
            decode_spans.append(span)
        else:
            kv_pos = torch.arange(end)
            slots = _slots(pages, kv_pos, page_size)  # [kv_len]
            mask = kv_pos[None, :] <= new_pos[:, None]  # [q_len, kv_len]
            local_slots = local = None
            if window:  # only the positions the chunk's first row's window reaches on
                lo = max(0, span.start_pos - window + 1)
                local_slots = slots[lo:]  # [window_len]
                local = mask[:, lo:] & (kv_pos[None, lo:] > new_pos[:, None] - window)  # [q_len, window_len]
            prefills.append(PrefillChunk(row, row + span.num_tokens, slots, mask, local_slots, local))
        row += span.num_tokens
    if decode_spans:
        lens = torch.tensor([s.start_pos + 1 for s in decode_spans])  # [B]
        max_len = int(lens.max())
        max_pages = (max_len + page_size - 1) // page_size
        pages = torch.zeros(len(decode_spans), max_pages, dtype=torch.long)
        for i, s in enumerate(decode_spans):
            n = min(len(s.page_ids), max_pages)
            pages[i, :n] = torch.tensor(s.page_ids[:n], dtype=torch.long)
        kv_pos = torch.arange(max_len)
        decode_slots = _slots(pages, kv_pos, page_size)  # [B, max_len]
        decode_mask = (kv_pos[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, max_len]
        window_slots = window_mask = None
        if window:  # each row's last min(window, max_len) positions; before position 0 masked
            width = min(window, max_len)
            local_pos = lens[:, None] - width + torch.arange(width)[None, :]  # [B, width]
            window_slots = decode_slots.gather(1, local_pos.clamp(min=0))  # [B, width]
            window_mask = (local_pos >= 0)[:, None, None, :]  # [B, 1, 1, width]
    else:
        decode_slots = torch.zeros(0, 1, dtype=torch.long)
        decode_mask = torch.zeros(0, 1, 1, 1, dtype=torch.bool)
        window_slots = decode_slots if window else None
        window_mask = decode_mask if window else None
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_chunks) if slot_chunks else torch.zeros(0, dtype=torch.long),
        decode_rows=torch.tensor(decode_rows, dtype=torch.long),
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        decode_is_all=len(decode_rows) == row,
        prefills=tuple(prefills),
        num_tokens=row,
        decode_window_slots=window_slots,
        decode_window_mask=window_mask,
    )


def write_kv(
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the new tokens' keys and values at their slots (cast to the cache's dtype)."""
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))


def decode_attention(
    q: torch.Tensor,  # [B, kv_heads, group, head_dim]: one query row per sequence, grouped
    k: torch.Tensor,  # [B, kv_heads, L, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor,  # [B, 1, 1, L] bool, True = attend
    *,
    fused: bool,
    scale: float | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Decode attention `[B, kv_heads, group, head_dim]`: torch's fused SDPA kernels (CUDA:
    memory-efficient attention takes the mask), or explicit matmuls (CPU, and soft-capped
    scores, which SDPA has no option for)."""
    if fused and not softcap:
        out: torch.Tensor = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out
    # NOTE: explicit matmuls: for one query row per sequence they beat the SDPA kernels on CPU.
    return explicit_attention(q, k, v, mask, scale=scale, softcap=softcap)


def explicit_attention(
    q: torch.Tensor,  # [..., Q, head_dim]
    k: torch.Tensor,  # [..., L, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor,  # broadcast to [..., Q, L] bool, True = attend
    *,
    scale: float | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T * scale, soft-capped as tanh(s / cap) * cap, masked) v, as transformers'
    eager attention computes it → `[..., Q, head_dim]`."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(scores, v)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim], rotary applied
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    windowed: bool = False,
    scale: float | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached positions → `[T, heads * head_dim]`.

    `windowed`: through the window masks (`build_metadata`'s `window`) instead of the causal
    ones; `scale`: of the scores (default head_dim ** -0.5); `softcap`: tanh(s / cap) * cap on
    the scores before the mask (Gemma 2), 0 for none.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    # NOTE: head h reads kv head h // group (transformers' repeat_kv order), so folding the group
    # into the query-length axis lets one kv head serve its query heads without repeating k/v.
    decode_out: torch.Tensor | None = None
    if meta.decode_rows.numel():
        qd = q if meta.decode_is_all else q[meta.decode_rows]  # [B, heads, hd]
        batch = qd.shape[0]
        qd = qd.view(batch, kv_heads, group, head_dim)  # [B, kvh, group, hd]
        decode_slots, decode_mask = meta.decode_slots, meta.decode_mask
        if windowed:  # only the window's positions when the step gathered them apart
            assert meta.decode_window_mask is not None, "a windowed layer needs the step's window masks"
            decode_slots = meta.decode_window_slots if meta.decode_window_slots is not None else decode_slots
            decode_mask = meta.decode_window_mask
        kv_len = decode_slots.shape[1]
        flat = decode_slots.reshape(-1)  # [B * L]
        # NOTE: `.to(q.dtype)` is a no-op unless --kv-cache-dtype stores k/v narrower than q.
        kd = k_cache.index_select(0, flat).to(q.dtype).view(batch, kv_len, kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, flat).to(q.dtype).view(batch, kv_len, kv_heads, head_dim).transpose(1, 2)
        od = decode_attention(
            qd, kd, vd, decode_mask, fused=q.is_cuda, scale=scale, softcap=softcap
        )  # [B, kvh, group, hd]
        decode_out = od.reshape(batch, num_heads * head_dim)  # [B, heads * hd]
        if meta.decode_is_all:
            return decode_out
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if decode_out is not None:
        out[meta.decode_rows] = decode_out
    for chunk in meta.prefills:
        q_len = chunk.row_end - chunk.row_start
        qc = q[chunk.row_start : chunk.row_end].view(q_len, kv_heads, group, head_dim)
        qc = qc.permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, head_dim)  # [kvh, group*q, hd]
        chunk_slots, chunk_mask = chunk.slots, chunk.mask
        if windowed:
            assert chunk.window_slots is not None and chunk.window_mask is not None, (
                "a windowed layer needs the step's window masks"
            )
            chunk_slots, chunk_mask = chunk.window_slots, chunk.window_mask
        kc = k_cache.index_select(0, chunk_slots).to(q.dtype).transpose(0, 1)  # [kvh, L, hd]
        vc = v_cache.index_select(0, chunk_slots).to(q.dtype).transpose(0, 1)  # [kvh, L, hd]
        mask = chunk_mask.repeat(group, 1)  # [group*q, L]
        if softcap:
            oc = explicit_attention(qc, kc, vc, mask, scale=scale, softcap=softcap)  # [kvh, group*q, hd]
        elif q.is_cuda:
            # NOTE: torch's fused kernels take 4-D inputs only; 3-D ones fall back to the math
            # path, which holds [kvh, group*q, L] float32 scores (17 GB for a 1024-token chunk
            # at 128k context with 32 heads). The CPU keeps the 3-D call it was measured with.
            oc = F.scaled_dot_product_attention(
                qc[None], kc[None], vc[None], attn_mask=mask[None, None], scale=scale
            )[0]
        else:
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)  # [kvh, group*q, hd]
        oc = oc.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)  # [q, kvh, group, hd]
        out[chunk.row_start : chunk.row_end] = oc.reshape(q_len, num_heads * head_dim)
    return out
