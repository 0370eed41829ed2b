"""What the engine needs from a model, how the real one is loaded, and the test hooks."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ft.config import EngineConfig
from ft.core.batch import Runner, SeqWork
from ft.core.spec_cost import StepCosts
from ft.model.rerank import RankFormat
from ft.tokenizer.job import Executor
from ft.tokenizer.spec import TokenizerSpec

if TYPE_CHECKING:
    import torch

    from ft.model.kernels import KVDtype
    from ft.model.loader import LoadedModel
    from ft.model.parallel.group import RankGroup
    from ft.model.plan import DraftPlan, ExecutionPlan
    from ft.model.runners import RunnerKind
    from ft.model.torch_runner import TorchRunner

log = logging.getLogger("ft.engine")


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
    # The tool-call format the model family writes (Phi-4-mini: phi4_mini_json, Granite: granite),
    # which the server parses when it was configured with none (else hermes).
    tool_call_parser: str | None = None
    # What scoring a prompt position costs beside feeding it, in fed tokens
    # (`LlamaConfig.score_cost`): the scheduler shortens a scored prefill chunk by it.
    score_cost: float = 0.0
    # What a KV page's bytes depend on besides its tokens and the page size (the model file,
    # dtypes, shapes, the kernels' build): the prompt cache's disk tier keys its files by it.
    # None: this model's pages cannot go to disk.
    kv_identity: str | None = None
    # How the model runs (`ft.model.plan`), shown in `/v1/stats`; None: a test's fake model.
    plan: ExecutionPlan | None = None
    # A model with recurrent layers (DeltaNet, short convolutions, Mamba): how many per-sequence
    # state slots its runner holds (`ft.core.batch.StateRunner`: every running sequence's, then
    # the snapshots the prefix cache keeps) and the bytes of one. 0: attention only.
    num_state_slots: int = 0
    state_slot_bytes: int = 0


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
    # The speculation cost model the scheduler measures steps into; a test returns None
    # (draft in every small enough step) or one with injected costs, so decisions are fixed.
    step_costs: Callable[[], StepCosts | None] = StepCosts


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
    from ft.model.hybrid import state_slot_bytes
    from ft.model.loader import load_model
    from ft.model.plan import plan as make_plan
    from ft.model.plan import read_header
    from ft.model.runners import build_runner
    from ft.model.torch_runner import TorchRunner

    # Every choice is made and checked here, from the file's header, before a rank starts or
    # a weight is read: a bad combination fails now, not after a load.
    header = read_header(config.model)
    run = make_plan(config, header)
    if ranks is None:
        log.info("plan: %s", run.summary())
        for reason in run.reasons:
            # A quantized file dequantized though no option asked for floats costs memory and speed.
            unasked = reason.startswith("float:") and header.is_quantized and config.dtype == "auto"
            log.log(logging.WARNING if unasked and not config.quantize else logging.DEBUG, "plan: %s", reason)
        if run.draft is not None:
            for reason in run.draft.reasons:
                log.debug("plan: %s", reason)
    if run.draft is not None:
        from ft.model.draft import check_tokenizer_files

        check_tokenizer_files(config.model, run.draft.path)  # before a weight of either is read
    world = run.tensor_parallel_size
    procs: rank_launch.RankProcesses | None = None
    if world > 1 and ranks is None:
        ranks, procs = rank_launch.start_leader(config)
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if ranks is None else 0
    device = ranks.device if ranks is not None else rank_launch.resolve_device(run.device, local_rank)
    packed = run.packed
    try:
        loaded = load_model(config.model, torch.float32, progress, quantized=packed)  # the runner casts
        if config.max_model_len is not None:
            # NOTE: the context served picks longrope's factors (Phi-3), as llama.cpp's n_ctx does.
            served = dataclasses.replace(loaded.config, rope_context=config.max_model_len)
            loaded = dataclasses.replace(loaded, config=served)
        dtype = resolve_dtype(run.dtype, loaded.config)  # "auto": measured here
        # NOTE: with tensor parallelism the draft model runs whole in rank 0 only (it is small):
        # its drafts reach the other ranks as the verify step's rows, like n-gram drafts.
        is_leader = ranks is None or ranks.is_leader
        drafter = _load_draft_model(run.draft, device) if run.draft is not None and is_leader else None
    except BaseException:
        if procs is not None:
            rank_launch.abandon(procs)
        raise
    # A hybrid's state slots: one per running sequence, then the snapshots (`ft.core.state`).
    num_state_slots = config.max_running_requests + config.state_snapshots if loaded.config.is_hybrid else 0
    kv_dtype: kernels.KVDtype = dtype
    if run.kv_dtype == kernels.Q8_0_KV:
        kv_dtype = kernels.Q8_0_KV
    elif run.kv_dtype != "auto":
        kv_dtype = getattr(torch, run.kv_dtype)
    threads = run.threads
    built: list[TorchRunner] = []

    def make_runner(num_pages: int, page_size: int) -> Runner:
        if ranks is not None and ranks.is_leader:
            rank_launch.send_runner(ranks, num_pages, page_size)
        if drafter is not None:
            return _speculative_runner(drafter, target=make_target(num_pages, page_size), threads=threads)
        return make_target(num_pages, page_size)

    def make_target(num_pages: int, page_size: int) -> TorchRunner:
        runner = build_runner(
            loaded,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            threads=threads,
            quantize=config.quantize,
            kv_dtype=kv_dtype,
            device=device,
            ranks=ranks,
            kind=run.runner,  # the plan's: packed, float or graphed
            num_state_slots=num_state_slots,
        )
        built.append(runner)
        return runner

    def kv_identity() -> str | None:
        if world > 1:
            return None  # each rank holds a shard of the heads: no disk tier
        from ft.core.prompt_cache import model_file_identity
        from ft.model.pull import cached_model_path

        path = config.model or cached_model_path()
        any_packed = packed or (run.draft is not None and run.draft.packed)
        build = pathlib.Path(kernels.library()._name).name if any_packed else "torch"
        identity = (
            f"model={model_file_identity(path)};config={loaded.config!r};dtype={dtype};"
            f"kv={kv_dtype};packed={packed};device={device.type};kernels={build};torch={torch.__version__}"
        )
        if drafter is not None and run.draft is not None:  # its KV lives in the same pages
            identity += (
                f";draft={model_file_identity(run.draft.path)};draft_config={drafter.loaded.config!r};"
                f"draft_dtype={drafter.dtype};draft_kv={drafter.kv_dtype};draft_packed={run.draft.packed}"
            )
        return identity

    def close(failed: bool) -> None:
        if ranks is not None and ranks.is_leader:
            rank_launch.stop_ranks(ranks, procs, built[0] if built else None, failed)

    return ModelParts(
        tokenizer=loaded.tokenizer,
        make_runner=make_runner,
        bytes_per_page=lambda ps: (
            TorchRunner.bytes_per_page(loaded.config, ps, kv_dtype, world)
            + (drafter.bytes_per_page(ps) if drafter is not None else 0)
        ),
        vocab_size=loaded.config.vocab_size,
        generation_defaults=loaded.generation_defaults,
        hidden_size=loaded.config.hidden_size,
        pooling=loaded.config.pooling,
        rank_format=loaded.rank_format,
        close=close,
        failure=procs.failure if procs is not None else None,
        reasoning_parser=by_name(loaded.config.architecture).reasoning_parser,
        kv_window=loaded.config.sliding_window if loaded.config.is_all_windowed else 0,
        tool_call_parser=by_name(loaded.config.architecture).tool_call_parser,
        score_cost=loaded.config.score_cost,
        kv_identity=kv_identity(),
        plan=run,
        num_state_slots=num_state_slots,
        state_slot_bytes=state_slot_bytes(loaded.config) if num_state_slots else 0,
    )


@dataclass(frozen=True)
class _Drafter:
    """The draft model of `--speculative-method draft`, loaded, and how it runs."""

    loaded: LoadedModel
    dtype: torch.dtype
    kv_dtype: KVDtype
    device: torch.device
    kind: RunnerKind

    def bytes_per_page(self, page_size: int) -> int:
        from ft.model.torch_runner import TorchRunner

        return TorchRunner.bytes_per_page(self.loaded.config, page_size, self.kv_dtype)


def _load_draft_model(draft: DraftPlan, device: torch.device) -> _Drafter:
    """Load the draft model as `draft` (the plan's) says, on the target's device.

    Raises:
        ValueError: it cannot load.
    """
    import torch

    from ft.model.loader import load_model

    loaded = load_model(draft.path, torch.float32, quantized=draft.packed)
    log.info(
        "draft model %s: %d layers, hidden %d (%s)",
        draft.path,
        loaded.config.num_layers,
        loaded.config.hidden_size,
        "as stored" if draft.packed else draft.dtype,
    )
    # NOTE: its decode steps stay eager: a draft step is one forward per drafted position.
    kind: RunnerKind = "packed" if draft.packed else "float"
    return _Drafter(loaded, getattr(torch, draft.dtype), getattr(torch, draft.kv_dtype), device, kind)


def _speculative_runner(drafter: _Drafter, *, target: TorchRunner, threads: int | None) -> Runner:
    """The target's runner with the draft model in front, its KV cache on the target's pages."""
    from ft.model.draft import SpeculativeRunner
    from ft.model.runners import build_runner

    draft = build_runner(
        drafter.loaded,
        num_pages=target.num_pages,
        page_size=target.page_size,
        dtype=drafter.dtype,
        threads=threads,
        kv_dtype=drafter.kv_dtype,
        device=drafter.device,
        kind=drafter.kind,  # the plan's
    )
    return SpeculativeRunner(target, draft)
