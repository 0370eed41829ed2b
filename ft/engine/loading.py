"""What the engine needs from a model, how the real one is loaded, and the test hooks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ft.config import EngineConfig
from ft.core.batch import Runner, SeqWork
from ft.messages import Tokenize
from ft.tokenizer.job import Executor
from ft.tokenizer.spec import TokenizerSpec

log = logging.getLogger("ft.engine")


@dataclass(frozen=True)
class ModelParts:
    """What the engine needs from a model: its tokenizer and a way to build its runner."""

    model_id: str
    tokenizer: TokenizerSpec
    make_runner: Callable[[int, int], Runner]  # (num_pages, page_size) -> Runner
    bytes_per_page: Callable[[int], int]  # page_size -> bytes
    vocab_size: int
    generation_defaults: dict[str, float | int]


@dataclass(frozen=True)
class EngineHooks:
    """Test hooks: a fake model, in-process tokenization, and fault injection."""

    load_model: Callable[[EngineConfig], ModelParts] | None = None
    tokenize_executor: Executor | None = None  # replaces the worker processes (tests)
    before_step: Callable[[list[SeqWork]], None] | None = None
    tokenizer_fault: Callable[[Tokenize], str | None] | None = None
    grammar_fault: str | None = None  # "exit": the grammar compiler's process dies


def load_torch_model(config: EngineConfig, progress: Callable[[float], None] | None = None) -> ModelParts:
    """Load weights and tokenizer for `config.model` (blocking; run it in a thread)."""
    import torch

    from ft.model import kernels
    from ft.model.dtypes import resolve_dtype
    from ft.model.loader import is_quantized_gguf, load_model
    from ft.model.torch_runner import TorchRunner

    # A quantized GGUF runs as stored unless a float dtype or --quantize was asked for.
    packed = config.dtype == "auto" and config.quantize is None and is_quantized_gguf(config.model)
    if packed and not kernels.available():
        log.warning("running the GGUF's weights dequantized to floats: %s", kernels.build_error())
        packed = False
    loaded = load_model(config.model, torch.float32, progress, quantized=packed)  # the runner casts
    dtype = torch.float32 if config.quantize or packed else resolve_dtype(config.dtype, loaded.config)
    # NOTE: packed weights keep float16 KV by default: half the memory and half the bytes that
    # decode attention reads, for 0.014 of max logit change against transformers (float32 5e-5).
    auto_kv = torch.float16 if packed else dtype
    kv_dtype = auto_kv if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)

    def make_runner(num_pages: int, page_size: int) -> Runner:
        return TorchRunner(
            loaded,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            threads=config.compute_threads,
            quantize=config.quantize,
            kv_dtype=kv_dtype,
        )

    return ModelParts(
        model_id=loaded.model_id,
        tokenizer=loaded.tokenizer,
        make_runner=make_runner,
        bytes_per_page=lambda ps: TorchRunner.bytes_per_page(loaded.config, ps, kv_dtype),
        vocab_size=loaded.config.vocab_size,
        generation_defaults=loaded.generation_defaults,
    )
