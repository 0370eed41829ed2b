"""What the engine needs from a model, how the real one is loaded, and the test hooks."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ft.config import Q8_0_KV_PATH, EngineConfig
from ft.core.batch import Runner, SeqWork
from ft.model.rerank import RankFormat
from ft.tokenizer.job import Executor
from ft.tokenizer.spec import TokenizerSpec

if TYPE_CHECKING:
    from ft.model.parallel import RankGroup

log = logging.getLogger("ft.engine")

# Seconds spawned ranks get to exit after "stop" before they are killed.
RANK_STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class ModelParts:
    """What the engine needs from a model: its tokenizer and a way to build its runner."""

    tokenizer: TokenizerSpec
    make_runner: Callable[[int, int], Runner]  # (num_pages, page_size) -> Runner
    bytes_per_page: Callable[[int], int]  # page_size -> bytes
    vocab_size: int
    generation_defaults: dict[str, float | int]
    hidden_size: int = 0  # the width of a pooled embedding
    pooling: str | None = None  # how the model's file says to pool embeddings (None: unsaid)
    rank_format: RankFormat | None = None  # a reranker's (the model has a classification head)
    # Releases what the model holds outside this process (the other ranks); synchronous,
    # called once when the engine stops. `failed`: the ranks are broken, do not talk to them.
    close: Callable[[bool], None] | None = None
    # Why the model can run no more steps (a spawned rank process exited), None while it can;
    # non-blocking, polled by the engine's watchdog from the event loop.
    failure: Callable[[], str | None] | None = None
    # The reasoning format the model's family writes (`architectures`; Qwen3: "think"), which the
    # server parses when it was configured with none.
    reasoning_parser: str | None = None
    # The positions every layer attends at most (a sliding window on all of them), 0 when some
    # layer attends everything: the scheduler gives back the pages a sequence has passed.
    kv_window: int = 0


@dataclass(frozen=True)
class EngineHooks:
    """Test hooks: a fake model, in-process tokenization, and test doubles of the worker jobs.

    A job double (`tokenize_job`, `grammar_job`) is a module-level function of CBOR bytes, run
    where the real job would run (a worker process), so a test can make a worker crash, raise
    or hang; nothing of it travels in the jobs themselves.
    """

    load_model: Callable[[EngineConfig], ModelParts] | None = None
    tokenize_executor: Executor | None = None  # replaces the worker processes (tests)
    before_step: Callable[[list[SeqWork]], None] | None = None
    tokenize_job: Callable[[bytes], bytes] | None = None  # replaces `ft.tokenizer.job.tokenize_job`
    grammar_job: Callable[[bytes], bytes] | None = None  # replaces `check_grammar_job`


def load_torch_model(
    config: EngineConfig,
    progress: Callable[[float], None] | None = None,
    ranks: RankGroup | None = None,
) -> ModelParts:
    """Load weights and tokenizer for `config.model` (blocking; run it in a thread).

    With `tensor_parallel_size > 1` rank 0 (`ranks` None) first starts the other ranks
    (`ft.engine.ranks`); a rank other than 0 passes its `ranks`.
    """
    import torch

    from ft.engine import ranks as rank_launch
    from ft.model import kernels
    from ft.model.architectures import by_name
    from ft.model.dtypes import resolve_dtype
    from ft.model.loader import is_quantized_gguf, load_model
    from ft.model.torch_runner import TorchRunner

    world = config.tensor_parallel_size
    procs: rank_launch.RankProcesses | None = None
    if world > 1 and ranks is None:
        ranks, procs = rank_launch.start_leader(config)
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if ranks is None else 0
    device = ranks.device if ranks is not None else rank_launch.resolve_device(config.device, local_rank)
    try:
        # A quantized GGUF runs as stored unless a float dtype or --quantize was asked for.
        packed = config.dtype == "auto" and config.quantize is None and is_quantized_gguf(config.model)
        if packed and (world > 1 or device.type != "cpu"):
            # NOTE: the packed kernels are single-process CPU code; ranks and GPUs run floats.
            log.warning(
                "dequantizing the GGUF's weights for %s", "tensor parallelism" if world > 1 else device
            )
            packed = False
        if packed and not kernels.available():
            log.warning("running the GGUF's weights dequantized to floats: %s", kernels.build_error())
            packed = False
        if config.kv_cache_dtype == kernels.Q8_0_KV:
            _check_q8_0_kv(config, packed)  # before loading a weight
        loaded = load_model(config.model, torch.float32, progress, quantized=packed)  # the runner casts
        if world > 1:
            from ft.model.parallel import check_shardable

            check_shardable(loaded.config, world)
        if config.quantize or packed:
            dtype = torch.float32
        elif config.dtype == "auto" and device.type == "cuda":
            dtype = torch.bfloat16
        elif config.dtype == "auto" and world > 1:
            # NOTE: "auto" is measured in each process: ranks that measured differently would
            # all-reduce tensors of different dtypes (gloo aborts the process). One choice for all.
            dtype = torch.float32
        else:
            dtype = resolve_dtype(config.dtype, loaded.config)
    except BaseException:
        if procs is not None:
            procs.stop()
            torch.distributed.destroy_process_group()
        raise
    # NOTE: packed weights keep float16 KV by default: half the memory and half the bytes that
    # decode attention reads, for 0.014 of max logit change against transformers (float32 5e-5).
    auto_kv = torch.float16 if packed else dtype
    kv_dtype: kernels.KVDtype = auto_kv
    if config.kv_cache_dtype == kernels.Q8_0_KV:
        kv_dtype = kernels.Q8_0_KV
    elif config.kv_cache_dtype != "auto":
        kv_dtype = getattr(torch, config.kv_cache_dtype)
    threads = config.compute_threads
    if threads is None and world > 1 and device.type == "cpu":
        # Ranks on one machine share its cores (torchrun says how many ranks run on this node).
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        threads = max(1, (os.cpu_count() or 1) // local_ranks)
    built: list[TorchRunner] = []

    def make_runner(num_pages: int, page_size: int) -> Runner:
        if ranks is not None and ranks.is_leader:
            rank_launch.send_runner(ranks, num_pages, page_size)
        runner = TorchRunner(
            loaded,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            threads=threads,
            quantize=config.quantize,
            kv_dtype=kv_dtype,
            device=device,
            ranks=ranks,
            cuda_graphs=config.cuda_graphs,
        )
        built.append(runner)
        return runner

    def close(failed: bool) -> None:
        if ranks is None or not ranks.is_leader:
            return
        if not failed:
            try:
                if built:
                    built[0].close()
                else:
                    ranks.send_stop()
            except Exception as e:  # the ranks are gone already: nothing left to tell them
                log.warning("stopping the ranks: %s", e)
                failed = True
        if procs is not None:
            # Told "stop", they exit by themselves; after a failure they are killed at once (a
            # collective blocked on a spawned rank then fails and returns).
            procs.stop(0.0 if failed else RANK_STOP_GRACE_S)
        if not failed or procs is not None:
            # NOTE: not after a failure under torchrun: a thread may still be blocked in a
            # collective with a hung rank we cannot stop; the process is about to exit anyway.
            torch.distributed.destroy_process_group()

    return ModelParts(
        tokenizer=loaded.tokenizer,
        make_runner=make_runner,
        bytes_per_page=lambda ps: TorchRunner.bytes_per_page(loaded.config, ps, kv_dtype, world),
        vocab_size=loaded.config.vocab_size,
        generation_defaults=loaded.generation_defaults,
        hidden_size=loaded.config.hidden_size,
        pooling=loaded.config.pooling,
        rank_format=loaded.rank_format,
        close=close,
        failure=procs.failure if procs is not None else None,
        reasoning_parser=by_name(loaded.config.architecture).reasoning_parser,
        kv_window=loaded.config.sliding_window if loaded.config.is_all_windowed else 0,
    )


def _check_q8_0_kv(config: EngineConfig, packed: bool) -> None:
    """Refuse `--kv-cache-dtype q8_0` where it cannot run: off the packed path, or on heads that
    are not whole blocks of 32 (read from the GGUF's header).

    Raises:
        ValueError: the message names the packed path, or the model's head size.
    """
    from ft.model import kernels
    from ft.model.loader import gguf_head_dim, is_quantized_gguf

    if not packed:
        if not is_quantized_gguf(config.model):
            why = "the model is not a quantized GGUF"
        elif not kernels.available():
            why = f"the packed kernels cannot be built here ({kernels.build_error()})"
        else:
            why = "this run is not on the CPU in one process"
        raise ValueError(f"{Q8_0_KV_PATH} ({why})")
    kernels.kv_head_bytes(kernels.Q8_0_KV, gguf_head_dim(config.model))
