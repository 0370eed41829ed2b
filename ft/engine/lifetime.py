"""The engine's boot and lifetime: its states, loading the model and starting the actors, and
the tokenizer worker processes' jobs (none outlives the engine)."""

from __future__ import annotations

import enum
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING

import cbor2
import trio
import trio_parallel
from tokenizers import Tokenizer

from ft.actors.detokenizer import DetokenizerActor
from ft.actors.fair_limiter import FairLimiter
from ft.actors.runner import RunnerActor
from ft.actors.scheduler import SchedulerActor
from ft.actors.tokenizer import TokenizerActor
from ft.config import RECURRENT_REFUSAL, EngineConfig, resolve_pooling
from ft.core.batch import Runner
from ft.core.kv import PagePool
from ft.core.prompt_cache import PageIO, PromptCache, cache_identity, lock_directory
from ft.core.scheduler import Scheduler
from ft.core.state import StatePool
from ft.core.toolcalls import template_tool_call_parser
from ft.engine.grammars import Grammars
from ft.engine.loading import ModelParts, load_torch_model
from ft.engine.observe import log_summaries, stamp_tokens
from ft.engine.watchdog import Watchdog
from ft.errors import EngineStopping, RequestAborted
from ft.grammar.spec import marker_tokens
from ft.messages import Batch, DetokenizerIn, SchedulerIn, Tokenize
from ft.tokenizer.job import (
    WORKER_MEMORY_BYTES,
    Executor,
    check_grammar_job,
    check_template_job,
    init_worker,
    retire_worker,
    tokenize_job,
)

if TYPE_CHECKING:
    from ft.engine.engine import Engine

log = logging.getLogger("ft.engine")

# Seconds idle tokenizer workers get to exit once the engine stops, before they are killed
# (busy ones are killed at once).
WORKER_GRACE_S = 5.0
# Seconds a tokenizer job may run past its render deadline (`template_timeout_s`) before its
# worker is killed: encoding the longest prompt a template may render takes ~25 s on a busy
# laptop core. The worker's own deadline stops a looping template; this stops anything else.
TOKENIZE_GRACE_S = 30.0


class EngineState(enum.StrEnum):
    """Where an engine is in its life (a `str`, so it reads and serializes as its value)."""

    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    ERROR = "error"


def refusal(state: EngineState, error: str | None) -> EngineStopping:
    """The 503 for a request an engine in `state` cannot serve (any state but READY)."""
    if state == EngineState.LOADING:
        return EngineStopping("the model is still loading; retry shortly", code="model_loading")
    if state == EngineState.ERROR:
        return EngineStopping(f"the engine failed: {error}", code="engine_error")
    return EngineStopping("the server is stopping and admits no new requests")


@dataclass(frozen=True, slots=True)
class Running:
    """What a started engine holds: the core, the tokenizer and the actors' inboxes."""

    core: Scheduler
    tokenizer: Tokenizer
    tokenizer_actor: TokenizerActor
    scheduler_inbox: trio.MemorySendChannel[SchedulerIn]
    tokenizer_inbox: trio.MemorySendChannel[Tokenize]
    grammars: Grammars


class WorkerJobs:
    """Jobs run in the engine's tokenizer worker processes; `kill_all` ends them when it stops."""

    def __init__(self) -> None:
        self.context: trio_parallel.WorkerContext | None = None  # set by `run`
        self._jobs: set[trio.CancelScope] = set()  # jobs in workers, cancelled when the engine stops
        self.is_killing = False  # the engine has stopped: no new job starts

    def executor(
        self, *, workers: int | None = None, kill_on_cancel: bool = False, timeout_s: float | None = None
    ) -> Executor:
        """Jobs in the engine's worker processes, at most `workers` at once (one a CPU when None).

        `kill_on_cancel`: a cancelled caller kills the job's worker at once (a grammar compile
        past its deadline); else a caller that leaves lets the job run on, so a client hanging up
        costs no worker. Either way the worker is killed past `timeout_s` (the executor raises
        `trio.TooSlowError`) and when the engine stops (`RequestAborted`): no job outlives the
        engine, and none holds its stop.
        """
        limiter = trio.CapacityLimiter(workers or os.cpu_count() or 1)
        unlimited = trio.CapacityLimiter(math.inf)  # `limiter` is taken before the deadline starts
        context = self.context
        assert context is not None, "the engine is not running (use open_engine)"

        async def executor(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
            async with limiter:
                if self.is_killing:
                    raise RequestAborted("the server is stopping; request aborted")
                with trio.CancelScope(shield=not kill_on_cancel) as scope:
                    if timeout_s is not None:
                        scope.deadline = trio.current_time() + timeout_s
                    self._jobs.add(scope)
                    try:
                        result: bytes = await context.run_sync(
                            job, payload, limiter=unlimited, kill_on_cancel=True
                        )
                        return result
                    finally:
                        self._jobs.discard(scope)
            if self.is_killing:
                raise RequestAborted("the server is stopping; request aborted")
            raise trio.TooSlowError(f"it ran longer than {timeout_s:g} s in its worker, which was replaced")

        return executor

    def kill_all(self) -> None:
        """Kill the worker of every job running, and refuse new ones: the engine has stopped.

        Synchronous, so it is safe to call from a cancelled task.
        """
        self.is_killing = True
        for scope in self._jobs:
            scope.cancel()


@asynccontextmanager
async def run(engine: Engine, *, wait_ready: bool) -> AsyncIterator[None]:
    """Run `engine` for the block: its worker processes, its nursery, its boot; stop them all
    when the block exits (see `open_engine`)."""
    try:
        # Workers ignore SIGINT/SIGTERM (a terminal's Ctrl-C and a process-group signal reach
        # them too): stopping is this process's decision. Busy ones are killed when the engine
        # stops, idle ones exit when their context closes, and all exit if this process dies.
        async with trio_parallel.open_worker_context(
            init=partial(init_worker, engine.config.template_timeout_s, WORKER_MEMORY_BYTES),
            retire=retire_worker,
            grace_period=WORKER_GRACE_S,
        ) as workers:
            engine.jobs.context = workers
            async with trio.open_nursery() as nursery:
                engine._nursery = nursery
                nursery.start_soon(boot, engine, nursery)
                if wait_ready:
                    await engine.wait_ready()
                try:
                    yield
                finally:
                    if not engine.has_failed:
                        engine.state = EngineState.STOPPED
                    engine.jobs.kill_all()
                    nursery.cancel_scope.cancel()
    finally:
        if engine.prompt_cache is not None:
            engine.prompt_cache.close()  # lets its writer finish what is queued, briefly
        if engine._close_model is not None:
            engine._close_model(engine.has_failed)
        engine._tmpdir.cleanup()


async def boot(engine: Engine, nursery: trio.Nursery) -> None:
    """Load the model and start the actors in `nursery`; a failure leaves the engine in ERROR."""
    try:
        await _start(engine, nursery)
    except Exception as e:
        engine.state, engine.error = EngineState.ERROR, f"{type(e).__name__}: {e}"
        engine._failed.set()  # for good: `ft serve` exits so a supervisor can restart it
    finally:
        engine._ready.set()


async def _start(engine: Engine, nursery: trio.Nursery) -> None:
    cfg = engine.config
    hooks = engine.hooks
    load = hooks.load_model or partial(load_torch_model, progress=engine._on_progress)
    # A directory another server owns fails the start before the model loads.
    lock_fd = None
    if cfg.prompt_cache_dir is not None:
        lock_fd = await trio.to_thread.run_sync(lock_directory, cfg.prompt_cache_dir)
    try:
        await _load_and_start(engine, nursery, load, lock_fd)
    except BaseException:
        if lock_fd is not None and engine.prompt_cache is None:
            os.close(lock_fd)
        raise


async def _load_and_start(
    engine: Engine, nursery: trio.Nursery, load: Callable[[EngineConfig], ModelParts], lock_fd: int | None
) -> None:
    cfg = engine.config
    hooks = engine.hooks
    parts = await trio.to_thread.run_sync(load, cfg)
    engine._close_model = parts.close
    if parts.num_state_slots:
        check_recurrent(cfg)
    engine.load_progress = 0.9
    spec = parts.tokenizer
    engine.max_model_len = min(cfg.max_model_len or spec.context_length, spec.context_length)
    if cfg.max_model_len is not None and cfg.max_model_len > spec.context_length:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's context {spec.context_length}"
        )
    engine.kv_page_bytes = parts.bytes_per_page(cfg.page_size)
    engine.state_slot_bytes = parts.state_slot_bytes
    engine.model_plan = parts.plan
    num_pages = cfg.num_pages or kv_budget_pages(cfg, parts, engine.kv_page_bytes)
    runner = await trio.to_thread.run_sync(parts.make_runner, num_pages, cfg.page_size)
    engine.kv_cache_bytes = num_pages * parts.bytes_per_page(cfg.page_size)
    kv_dtype = getattr(runner, "kv_dtype", None)
    if kv_dtype is not None:
        engine.kv_cache_dtype = str(kv_dtype).removeprefix("torch.")
    engine.vocab_size = parts.vocab_size
    engine.generation_defaults = parts.generation_defaults
    engine.reasoning_parser = parts.reasoning_parser
    engine.tool_call_parser = parts.tool_call_parser or template_tool_call_parser(spec.chat_template)
    engine.marker_tokens = marker_tokens(spec.tokenizer_json)
    engine.hidden_size = parts.hidden_size
    engine.pooling = resolve_pooling(cfg.pooling, parts.pooling, can_rank=parts.rank_format is not None)
    engine.rank_format = parts.rank_format
    spec_path = os.path.join(engine._tmpdir.name, "tokenizer.cbor")
    with open(spec_path, "wb") as f:
        cbor2.dump(asdict(spec), f)

    if cfg.prompt_cache_dir is not None:
        assert lock_fd is not None
        engine.prompt_cache = await trio.to_thread.run_sync(open_prompt_cache, cfg, parts, runner, lock_fd)
    pool = PagePool(num_pages, cfg.page_size)
    core = Scheduler(
        pool,
        max_running=cfg.max_running_requests,
        max_model_len=engine.max_model_len,
        max_prefill_tokens=cfg.max_prefill_tokens,
        eos_token_ids=spec.eos_token_ids,
        enable_prefix_caching=cfg.enable_prefix_caching,
        reserve_full_budget=cfg.admission == "reserve",
        speculative_tokens=cfg.speculative_tokens if cfg.speculative_method is not None else 0,
        speculative_max_batch=cfg.speculative_max_batch,
        draft_model=cfg.speculative_method == "draft",
        costs=hooks.step_costs(),
        kv_window=parts.kv_window,
        score_cost=parts.score_cost,
        disk=engine.prompt_cache,
        disk_min_tokens=cfg.prompt_cache_min_tokens,
        states=StatePool(parts.num_state_slots, cfg.max_running_requests) if parts.num_state_slots else None,
    )
    # Unbounded inboxes, each bounded by what feeds it: every live request posts one
    # Tokenize and O(1) scheduler commands; one StepDone and one detokenizer tuple per step.
    sched_send, sched_recv = trio.open_memory_channel[SchedulerIn](math.inf)
    tok_send, tok_recv = trio.open_memory_channel[Tokenize](math.inf)
    detok_send, detok_recv = trio.open_memory_channel[DetokenizerIn](math.inf)
    run_send, run_recv = trio.open_memory_channel[Batch](1)  # one batch in flight

    executor = hooks.tokenize_executor or engine.jobs.executor(
        workers=cfg.tokenizer_workers, timeout_s=cfg.template_timeout_s + TOKENIZE_GRACE_S
    )
    # A template that cannot render is a load error rather than every chat request's. In a
    # worker, which this spawns now rather than on first use; in this process when a test's
    # executor stands in for the workers (so its calls are the requests' alone).
    engine.template_renders_mid_system = await _check_template(
        executor if hooks.tokenize_executor is None else _run_here, spec_path
    )

    tokenizer_actor = TokenizerActor(
        tok_recv,
        sched_send.clone(),
        engine.registry,
        spec_path=spec_path,
        vocab_size=parts.vocab_size,
        executor=executor,
        job=hooks.tokenize_job or tokenize_job,
        limiter=FairLimiter(cfg.tokenizer_workers),
        max_prompt_tokens=engine.max_model_len,
    )
    await nursery.start(tokenizer_actor.run)
    await nursery.start(
        SchedulerActor(
            sched_recv,
            run_send,
            detok_send,
            core,
            engine.registry,
            engine._on_step,
            max_queue_wait_s=cfg.max_queue_wait_s,
        ).run
    )
    runner_actor = RunnerActor(
        run_recv,
        sched_send.clone(),
        runner,
        before_step=hooks.before_step,
        on_fatal=engine._on_runner_failed,
        prompt_cache=engine.prompt_cache,
    )
    await nursery.start(runner_actor.run)

    def on_stall(reason: str) -> None:
        runner_actor.halt(reason)  # give up the step that never returns
        engine._on_runner_failed(reason)

    # Every configuration: a step that never returns, a scheduler that stops while work
    # waits, a rank process that died (noticed when it dies, not at the next request).
    watchdog = Watchdog(
        runner_actor,
        core,
        step_timeout_s=cfg.step_timeout_s,
        on_stall=on_stall,
        model_failure=parts.failure,
    )
    await nursery.start(watchdog.run)
    await nursery.start(
        DetokenizerActor(
            detok_recv,
            sched_send.clone(),
            engine.registry,
            engine._decode,
            on_tokens=stamp_tokens,
        ).run
    )
    grammars = Grammars(
        spec_path=spec_path,
        tokenizer_json=spec.tokenizer_json,
        eos_token_ids=spec.eos_token_ids,
        vocab_size=parts.vocab_size,
        executor=hooks.tokenize_executor,  # None: the grammars' own workers (`run`)
        check_job=hooks.grammar_job or check_grammar_job,
    )
    if hooks.tokenize_executor is None:
        await nursery.start(grammars.run)
    engine._running = Running(core, spec.build(), tokenizer_actor, sched_send, tok_send, grammars)
    if log.isEnabledFor(logging.DEBUG):
        nursery.start_soon(log_summaries, engine)
    engine.stats.started()
    engine.load_progress = 1.0
    if engine.state == EngineState.LOADING:  # a drain that began while loading stands
        engine.state = EngineState.READY


def kv_budget_pages(cfg: EngineConfig, parts: ModelParts, page_bytes: int) -> int:
    """The KV pages `--kv-cache-memory` holds once a hybrid model's recurrent state slots (one
    per running sequence and the snapshots', `ModelParts.num_state_slots`) are taken out of it.

    Raises:
        ValueError: the budget cannot hold the slots and two pages.
    """
    state_bytes = parts.num_state_slots * parts.state_slot_bytes
    if not state_bytes:
        return max(2, cfg.kv_cache_memory // page_bytes)
    if cfg.kv_cache_memory - state_bytes < 2 * page_bytes:
        raise ValueError(
            f"--kv-cache-memory {cfg.kv_cache_memory} bytes cannot hold the recurrent state: "
            f"{parts.num_state_slots} slots (--max-running-requests {cfg.max_running_requests} + "
            f"--state-snapshots {cfg.state_snapshots}) of {parts.state_slot_bytes} bytes take "
            f"{state_bytes} bytes, and two KV pages {2 * page_bytes} more"
        )
    pages = (cfg.kv_cache_memory - state_bytes) // page_bytes
    log.info(
        "recurrent state: %d slots of %d bytes (%d MiB) out of the KV budget; %d KV pages",
        parts.num_state_slots,
        parts.state_slot_bytes,
        state_bytes >> 20,
        pages,
    )
    return pages


def check_recurrent(cfg: EngineConfig) -> None:
    """Refuse what a model with recurrent layers cannot run with (`ft.model.plan` refuses the
    same for a model file before its weights load; this holds for any model).

    Raises:
        ValueError: speculative decoding or the prompt cache's disk tier was asked for.
    """
    if cfg.speculative_method is not None:
        raise ValueError(f"speculative decoding (--speculative-method) is {RECURRENT_REFUSAL}")
    if cfg.prompt_cache_dir is not None:
        raise ValueError(f"the prompt cache's disk tier (--prompt-cache-dir) is {RECURRENT_REFUSAL}")


def open_prompt_cache(cfg: EngineConfig, parts: ModelParts, runner: Runner, lock_fd: int) -> PromptCache:
    """The disk tier for `cfg.prompt_cache_dir` (whose lock `lock_fd` holds), keyed by the
    model's KV identity and the page size (blocking: it lists the directory's files).

    Raises:
        ValueError: the model's pages cannot go to disk (tensor parallelism, a test model).
        PromptCacheBusy: another server owns the directory.
    """
    assert cfg.prompt_cache_dir is not None
    if parts.kv_identity is None or not isinstance(runner, PageIO):
        raise ValueError("--prompt-cache-dir: this model's KV pages cannot be saved to disk")
    identity = cache_identity(f"{parts.kv_identity};page_size={cfg.page_size}")
    cache = PromptCache(cfg.prompt_cache_dir, cfg.prompt_cache_size, identity, lock_fd=lock_fd)
    stats = cache.statistics()
    log.info(
        "prompt cache: %s, %d files (%d bytes) of at most %d bytes; ours in %s",
        cache.directory,
        stats.files,
        stats.bytes,
        cache.max_bytes,
        os.path.basename(cache.own_dir),
    )
    return cache


async def _check_template(executor: Executor, spec_path: str) -> bool:
    """Render the chat template on sample conversations in a worker; raise `ValueError`
    (the engine fails to start) naming the template when it cannot serve a chat. Return
    whether it renders a system message mid-conversation in place."""
    try:
        answer = cbor2.loads(await executor(check_template_job, cbor2.dumps({"spec_path": spec_path})))
    except trio.TooSlowError as e:
        raise ValueError(f"the model's chat template cannot be used: {e}") from e
    except trio_parallel.BrokenWorkerError as e:
        raise ValueError("the model's chat template cannot be used: it crashed its worker") from e
    if "error" in answer:
        raise ValueError(f"the model's chat template cannot be used: {answer['error']}")
    return bool(answer.get("mid_system"))


async def _run_here(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
    await trio.lowlevel.checkpoint()
    return job(payload)
