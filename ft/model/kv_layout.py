"""How a model's layers lie in the paged KV cache: one shape for all, or each layer its own.

A model whose layers all store keys and values of one shape (every family but Gemma 4) keeps
today's cache: two tensors `[layers, num_slots, kv_heads, last]`, layer `i` at index `i`.

A model whose layers differ (Gemma 4: heads of 256 on the sliding layers and of 512 with their
own kv head count on the global ones; its last layers attend an earlier layer's KV and store
none) lays the layers that store KV side by side in each slot: `[1, num_slots, 1, width]`, the
width the sum of their `kv_heads * last`. A layer's cache is a view of its columns,
`[num_slots, kv_heads, last]`, so attention reads it as any layer's; a slot's (a page's) bytes
are contiguous, so the prompt cache's disk tier copies a page as it does for the other layout.
A layer that stores nothing costs no byte of any page.
"""

from __future__ import annotations

import torch

from ft.model import kernels

KVShape = tuple[int, int]  # (kv_heads, head_dim) of one layer that stores KV


def is_uniform(shapes: tuple[KVShape, ...]) -> bool:
    """Whether the layers that store KV all store one shape (the `[layers, ...]` layout)."""
    return len(set(shapes)) <= 1


def cache_shape(shapes: tuple[KVShape, ...], num_slots: int, kv_dtype: kernels.KVDtype) -> tuple[int, ...]:
    """The shape of the K (and of the V) cache tensor over `num_slots` slots.

    Raises:
        ValueError: q8_0 with heads whose size is not a multiple of 32.
    """
    if is_uniform(shapes):
        kv_heads, head_dim = shapes[0]
        return (len(shapes), num_slots, kv_heads, kernels.kv_cache_layout(kv_dtype, head_dim)[0])
    width = sum(kv_heads * kernels.kv_cache_layout(kv_dtype, head_dim)[0] for kv_heads, head_dim in shapes)
    return (1, num_slots, 1, width)


def layer_caches(cache: torch.Tensor, shapes: tuple[KVShape, ...]) -> list[torch.Tensor]:
    """Each storing layer's `[num_slots, kv_heads, last]` view of a cache `cache_shape` made."""
    if is_uniform(shapes):
        return list(cache.unbind(0))
    flat = cache[0, :, 0]  # [num_slots, width]
    views: list[torch.Tensor] = []
    start = 0
    for kv_heads, head_dim in shapes:  # (float caches: last is head_dim)
        width = kv_heads * head_dim
        views.append(flat[:, start : start + width].view(flat.shape[0], kv_heads, head_dim))
        start += width
    return views


def bytes_per_slot(shapes: tuple[KVShape, ...], kv_dtype: kernels.KVDtype, world: int = 1) -> int:
    """K and V bytes of one slot over every storing layer, on the busiest of `world` ranks."""
    return 2 * sum(-(-kv_heads // world) * kernels.kv_head_bytes(kv_dtype, hd) for kv_heads, hd in shapes)
