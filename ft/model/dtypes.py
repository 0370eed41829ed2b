"""Choosing the compute dtype: measured, not assumed."""

from __future__ import annotations

import time
from functools import lru_cache

import torch

from ft.model.llama import LlamaConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _matmul_seconds(
    hidden: int, intermediate: int, dtype: torch.dtype, rows: int = 16, repeats: int = 6
) -> float:
    """Best time of one MLP-shaped matmul (`[rows, hidden] @ [hidden, 2 * intermediate]`)."""
    x = torch.randn(rows, hidden).to(dtype)
    w = torch.randn(2 * intermediate, hidden).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(4):
                torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return best


@lru_cache(maxsize=8)
def _pick(hidden: int, intermediate: int) -> torch.dtype:
    f32 = _matmul_seconds(hidden, intermediate, torch.float32)
    bf16 = _matmul_seconds(hidden, intermediate, torch.bfloat16)
    return torch.bfloat16 if bf16 < 0.8 * f32 else torch.float32


def pick_dtype(config: LlamaConfig) -> torch.dtype:
    """float32 or bfloat16, whichever runs the model's matmul shapes faster here (cached per process).

    bfloat16 must win by 20% to be chosen: it costs accuracy, so a tie goes to float32.
    Measured 2026-11-30 on the 2-core AMD EPYC dev box (AVX2, no avx512_bf16/AMX), one thread,
    `[rows, 576] @ [576, 3072]`: rows=1 f32 0.25 ms vs bf16 0.46 ms; rows=16 f32 1.8 ms vs bf16
    10.3 ms, so "auto" picks float32 there; CPUs with AMX/avx512_bf16 will pick bfloat16.
    """
    return _pick(config.hidden_size, config.intermediate_size or config.moe_intermediate_size)


def resolve_dtype(name: str, config: LlamaConfig) -> torch.dtype:
    """`"auto"` → `pick_dtype(config)`; otherwise the named dtype."""
    if name == "auto":
        return pick_dtype(config)
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {name!r}")
    return DTYPES[name]
