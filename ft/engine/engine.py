"""open_engine(): the actors' nursery, and Engine, whose `open_request` is the only way in."""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import cbor2
import trio
import trio_parallel
from tokenizers import Tokenizer

from ft.actors.detokenizer import DetokenizerActor
from ft.actors.registry import Registry, RequestEntry
from ft.actors.runner import RunnerActor
from ft.actors.scheduler import SchedulerActor
from ft.actors.tokenizer import TokenizerActor
from ft.config import EngineConfig
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.engine.grammars import Grammars
from ft.engine.loading import EngineHooks, load_torch_model
from ft.engine.stats import Stats
from ft.engine.stream import RequestStream
from ft.engine.watchdog import Watchdog
from ft.errors import EngineStopping, FtError, InvalidRequest, Overloaded, RequestAborted, RequestFailed
from ft.grammar.compiled import Grammar
from ft.grammar.spec import GrammarSpec
from ft.ids import random_id
from ft.messages import Abort, Batch, DetokenizerIn, SchedulerIn, StepDone, Tokenize
from ft.params import SamplingParams
from ft.tokenizer.job import (
    WORKER_MEMORY_BYTES,
    Executor,
    check_template_job,
    init_worker,
    retire_worker,
    tokenize_job,
)

log = logging.getLogger("ft.engine")

# Seconds between the engine's DEBUG summaries (only while the log level shows them).
SUMMARY_PERIOD_S = 10.0
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


@dataclass(frozen=True, slots=True)
class Running:
    """What a started engine holds: the core, the tokenizer and the actors' inboxes."""

    core: Scheduler
    tokenizer: Tokenizer
    tokenizer_actor: TokenizerActor
    scheduler_inbox: trio.MemorySendChannel[SchedulerIn]
    tokenizer_inbox: trio.MemorySendChannel[Tokenize]
    grammars: Grammars


class Admission:
    """A request admitted by `Engine.admit`; it holds a drain open until released.

    Until its scopes open (`opened`, once each) its `num_preparing` prompts count against the
    engine's capacity as queued work: tokenizing them and compiling a grammar wait for workers
    as queued requests do.
    """

    def __init__(self, engine: Engine, num_prompts: int) -> None:
        self._engine: Engine | None = engine
        self.num_preparing = num_prompts

    @property
    def is_preparing(self) -> bool:
        """Whether a scope of it has yet to open."""
        return self.num_preparing > 0

    def opened(self) -> None:
        """One of its request scopes is open: the registry counts that one from now on."""
        if self.is_preparing and self._engine is not None:
            self._engine._num_preparing -= 1
            self.num_preparing -= 1

    def release(self) -> None:
        """Let a drain stop waiting for this request. Idempotent and synchronous."""
        if self._engine is not None:
            self._engine._num_preparing -= self.num_preparing
            self.num_preparing = 0
            self._engine._num_admissions -= 1
            self._engine = None


class Engine:
    """A running engine. Create it with `open_engine`; enter requests with `open_request`."""

    def __init__(self, config: EngineConfig, hooks: EngineHooks) -> None:
        self.config = config
        self.hooks = hooks
        self.instance_id = uuid.uuid4().hex[:12]
        self.registry = Registry()
        self.stats = Stats()
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.load_progress = 0.0  # fraction of the start-up done, for /health
        # Whether the chat template renders a system message mid-conversation in place (known
        # once the template check ran at load; until then False: such turns are folded).
        self.template_renders_mid_system = False
        self.model_id = config.served_model_name or (config.model or "SmolLM2-135M-Instruct")
        self.max_model_len = 0
        self.vocab_size = 0
        self.kv_cache_dtype = config.kv_cache_dtype  # resolved to a real dtype once loaded
        self.generation_defaults: dict[str, float | int] = {}
        self._uids = itertools.count(1)
        self._ready = trio.Event()
        self._stopped = trio.Event()
        self._stop_snapshot: dict[str, Any] | None = None
        self._nursery: trio.Nursery | None = None
        self._drain_scope: trio.CancelScope | None = None
        self._abort_timeout_s = 0.0
        self._num_admissions = 0  # `Admission`s not yet released: a drain waits for them
        self._num_preparing = 0  # `Admission`s whose scopes are not open yet: they count as queued
        self._tokenize_slots = trio.CapacityLimiter(config.tokenizer_workers)
        self._running: Running | None = None  # set once the actors have started
        self._workers: trio_parallel.WorkerContext | None = None  # tokenizer worker processes
        self._jobs: set[trio.CancelScope] = set()  # jobs in workers, cancelled when the engine stops
        self._is_killing_jobs = False  # the engine has stopped: no new job starts
        self._failed = trio.Event()  # set when the model failed to load or its runner failed
        self._close_model: Callable[[bool], None] | None = None
        self._tmpdir = tempfile.TemporaryDirectory(prefix="ft-")

    # --- lifetime ----------------------------------------------------------------------------

    async def _boot(self, nursery: trio.Nursery) -> None:
        try:
            await self._start(nursery)
        except Exception as e:
            self.state, self.error = EngineState.ERROR, f"{type(e).__name__}: {e}"
            self._failed.set()  # for good: `ft serve` exits so a supervisor can restart it
        finally:
            self._ready.set()

    async def _start(self, nursery: trio.Nursery) -> None:
        cfg = self.config
        load = self.hooks.load_model or partial(load_torch_model, progress=self._on_progress)
        parts = await trio.to_thread.run_sync(load, cfg)
        self._close_model = parts.close
        self.load_progress = 0.9
        spec = parts.tokenizer
        self.max_model_len = min(cfg.max_model_len or spec.context_length, spec.context_length)
        if cfg.max_model_len is not None and cfg.max_model_len > spec.context_length:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's context {spec.context_length}"
            )
        num_pages = cfg.num_pages or max(2, cfg.kv_cache_memory // parts.bytes_per_page(cfg.page_size))
        runner = await trio.to_thread.run_sync(parts.make_runner, num_pages, cfg.page_size)
        kv_dtype = getattr(runner, "kv_dtype", None)
        if kv_dtype is not None:
            self.kv_cache_dtype = str(kv_dtype).removeprefix("torch.")
        if not cfg.served_model_name:
            self.model_id = parts.model_id
        self.vocab_size = parts.vocab_size
        self.generation_defaults = parts.generation_defaults
        spec_path = os.path.join(self._tmpdir.name, "tokenizer.cbor")
        with open(spec_path, "wb") as f:
            cbor2.dump(asdict(spec), f)

        pool = PagePool(num_pages, cfg.page_size)
        core = Scheduler(
            pool,
            max_running=cfg.max_running_requests,
            max_model_len=self.max_model_len,
            max_prefill_tokens=cfg.max_prefill_tokens,
            eos_token_ids=spec.eos_token_ids,
            enable_prefix_caching=cfg.enable_prefix_caching,
            reserve_full_budget=cfg.admission == "reserve",
        )
        # Unbounded inboxes, each bounded by what feeds it: every live request posts one
        # Tokenize and O(1) scheduler commands; one StepDone and one detokenizer tuple per step.
        sched_send, sched_recv = trio.open_memory_channel[SchedulerIn](math.inf)
        tok_send, tok_recv = trio.open_memory_channel[Tokenize](math.inf)
        detok_send, detok_recv = trio.open_memory_channel[DetokenizerIn](math.inf)
        run_send, run_recv = trio.open_memory_channel[Batch](1)  # one batch in flight

        executor = self.hooks.tokenize_executor or self._worker_executor(
            workers=cfg.tokenizer_workers, timeout_s=cfg.template_timeout_s + TOKENIZE_GRACE_S
        )
        # A template that cannot render is a load error rather than every chat request's. In a
        # worker, which this spawns now rather than on first use; in this process when a test's
        # executor stands in for the workers (so its calls are the requests' alone).
        await self._check_template(executor if self.hooks.tokenize_executor is None else _run_here, spec_path)

        tokenizer_actor = TokenizerActor(
            tok_recv,
            sched_send.clone(),
            self.registry,
            spec_path=spec_path,
            vocab_size=parts.vocab_size,
            executor=executor,
            job=tokenize_job,
            fault=self.hooks.tokenizer_fault,
        )
        await nursery.start(tokenizer_actor.run)
        await nursery.start(
            SchedulerActor(
                sched_recv,
                run_send,
                detok_send,
                core,
                self.registry,
                self._on_step,
                max_queue_wait_s=cfg.max_queue_wait_s,
            ).run
        )
        runner_actor = RunnerActor(
            run_recv,
            sched_send.clone(),
            runner,
            before_step=self.hooks.before_step,
            on_fatal=self._on_runner_failed,
        )
        await nursery.start(runner_actor.run)

        def on_stall(reason: str) -> None:
            runner_actor.halt(reason)  # give up the step that never returns
            self._on_runner_failed(reason)

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
                self.registry,
                self._decode,
                on_tokens=self._on_tokens,
            ).run
        )
        grammars = Grammars(
            spec_path=spec_path,
            tokenizer_json=spec.tokenizer_json,
            eos_token_ids=spec.eos_token_ids,
            vocab_size=parts.vocab_size,
            executor=self.hooks.tokenize_executor,  # None: the grammars' own workers (`run`)
            fault=self.hooks.grammar_fault,
        )
        if self.hooks.tokenize_executor is None:
            await nursery.start(grammars.run)
        self._running = Running(core, spec.build(), tokenizer_actor, sched_send, tok_send, grammars)
        if log.isEnabledFor(logging.DEBUG):
            nursery.start_soon(self._log_summaries)
        self.stats.started()
        self.load_progress = 1.0
        if self.state == EngineState.LOADING:  # a drain that began while loading stands
            self.state = EngineState.READY

    async def _log_summaries(self) -> None:
        """Every `SUMMARY_PERIOD_S`, while anything is live, one DEBUG line on the engine's state."""
        while True:
            await trio.sleep(SUMMARY_PERIOD_S)
            if not len(self.registry):
                continue
            snap = self.snapshot()
            req, kv, tps = snap["requests"], snap["kv"], snap["throughput"]
            log.debug(
                "summary: %d running, %d waiting; KV %d/%d pages (%d cached); "
                "decode %.1f tok/s, prefill %.1f tok/s",
                req["running"],
                req["waiting"],
                kv["used_pages"],
                kv["total_pages"],
                kv["cached_pages"],
                tps["decode_tps"],
                tps["prefill_tps"],
            )

    def _on_progress(self, fraction: float) -> None:
        # Called from the loading thread: a float assignment, nothing else.
        self.load_progress = round(0.9 * fraction, 3)

    async def _check_template(self, executor: Executor, spec_path: str) -> None:
        """Render the chat template on sample conversations in a worker; raise `ValueError`
        (the engine fails to start) naming the template when it cannot serve a chat."""
        try:
            answer = cbor2.loads(await executor(check_template_job, cbor2.dumps({"spec_path": spec_path})))
        except trio.TooSlowError as e:
            raise ValueError(f"the model's chat template cannot be used: {e}") from e
        except trio_parallel.BrokenWorkerError as e:
            raise ValueError("the model's chat template cannot be used: it crashed its worker") from e
        if "error" in answer:
            raise ValueError(f"the model's chat template cannot be used: {answer['error']}")
        self.template_renders_mid_system = bool(answer.get("mid_system"))

    def _worker_executor(
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
        context = self._workers
        assert context is not None, "the engine is not running (use open_engine)"

        async def executor(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
            async with limiter:
                if self._is_killing_jobs:
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
            if self._is_killing_jobs:
                raise RequestAborted("the server is stopping; request aborted")
            raise trio.TooSlowError(f"it ran longer than {timeout_s:g} s in its worker, which was replaced")

        return executor

    def _kill_jobs(self) -> None:
        """Kill the worker of every job running, and refuse new ones: the engine has stopped.

        Synchronous, so it is safe to call from a cancelled task.
        """
        self._is_killing_jobs = True
        for scope in self._jobs:
            scope.cancel()

    def _on_runner_failed(self, reason: str) -> None:
        """The runner can run no more steps: fail every live request and report the error.

        Synchronous and once: a later failure (the watchdog after a runner failure) keeps the
        first reason. Each failed request's scope exits as usual and frees its pages.
        """
        if self._failed.is_set():
            return
        self.state, self.error = EngineState.ERROR, reason
        for uid in self.registry.uids():
            self.registry.fail(uid, RequestFailed(reason))
        self._failed.set()

    async def wait_failed(self) -> str:
        """Wait until the engine fails for good (its model did not load, or its runner failed:
        a tensor-parallel rank died or hangs); return why."""
        await self._failed.wait()
        assert self.error is not None
        return self.error

    @property
    def has_failed(self) -> bool:
        """Whether the engine failed for good (the model did not load, or the runner failed)."""
        return self._failed.is_set()

    async def wait_ready(self) -> None:
        """Wait until weights are loaded; raise `RuntimeError` if loading failed."""
        await self._ready.wait()
        if self.state == EngineState.ERROR:
            raise RuntimeError(f"the engine failed to start: {self.error}")

    @property
    def core(self) -> Scheduler | None:
        """The scheduler core (None until the engine has started)."""
        return self._running.core if self._running is not None else None

    def _started(self) -> Running:
        """What the started engine holds. Raises `EngineStopping` (503) while it loads."""
        if self._running is None:
            raise EngineStopping("the model is still loading", code="model_loading")
        return self._running

    # --- requests ----------------------------------------------------------------------------

    def check_admission(self, admission: Admission | None = None) -> None:
        """Raise what `open_request` would raise now for engine state or capacity.

        A streaming route calls it first so it can answer 503 before committing to a 200.
        `admission`: the request was admitted (`admit`) before a drain began, so a drain lets
        it in (it is in flight, not new), and its own place in the queue is not counted twice.
        """
        admitted = admission is not None
        if self.state == EngineState.LOADING:
            raise EngineStopping("the model is still loading", code="model_loading")
        if self.state == EngineState.ERROR:
            raise EngineStopping(f"the engine failed: {self.error}", code="engine_error")
        if self.state != EngineState.READY and not (admitted and self.state == EngineState.STOPPING):
            raise EngineStopping("the server is stopping and admits no new requests")
        # Capacity is the running slots plus the queue. A request being tokenized or having its
        # grammar compiled counts as queued, so a burst cannot slip past the limit; one the
        # engine is done with (its client still reading its output) holds nothing and does
        # not count, so clients that stop reading cannot lock everyone out.
        in_use = self.registry.num_in_engine + self._num_preparing
        if admission is not None and admission.is_preparing:
            in_use -= 1
        if in_use >= self.config.max_running_requests + self.config.max_queued_requests:
            self.stats.rejected += 1
            raise Overloaded(
                f"the queue is full ({self.config.max_queued_requests} waiting requests); retry later"
            )

    def admit(self, num_prompts: int = 1) -> Admission:
        """Admit a request of `num_prompts` prompts (one scope each) now, before the work that
        precedes its scopes (tokenizing, compiling its grammar, sending a stream's headers): a
        drain that begins meanwhile waits for the admission's `release` and lets its
        `open_request(admission=...)` in. Each prompt counts against the capacity.

        Raises:
            EngineStopping, Overloaded: what `check_admission` raises (room for one prompt is
                enough: the later ones are checked as their scopes open).
        """
        self.check_admission()
        self._num_admissions += 1
        self._num_preparing += num_prompts
        return Admission(self, num_prompts)

    @asynccontextmanager
    async def open_request(
        self,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        request_id: str | None = None,
        admission: Admission | None = None,
    ) -> AsyncIterator[RequestStream]:
        """Register a request for the block's duration; yield its stream of deltas.

        `request_id` names the request in the engine's logs and in its `RequestReport` (the
        server passes the HTTP `X-Request-Id`); one is made when it is None. `admission`: it
        was admitted (`admit`) before a drain began, so the drain lets it in.

        The exit (success, exception or cancellation) unregisters the uid and posts `Abort`,
        which frees its KV pages and running slot; it is synchronous, so it is safe to leave
        the block from a cancelled task.

        Raises:
            InvalidRequest: no prompt, or more than one kind of prompt.
            Overloaded: the waiting queue is full.
            EngineStopping: loading, stopping, or failed.
        """
        params = params or SamplingParams()
        if sum(x is not None for x in (messages, prompt, prompt_token_ids)) != 1:
            raise InvalidRequest("give exactly one of messages, prompt or prompt_token_ids")
        self.check_admission(admission)
        grammar: Grammar | None = None
        if params.grammar is not None:
            grammar = await self.compile_grammar(params.grammar)
            # NOTE: a new grammar compiles for up to seconds: admission is checked again, so a
            # request is never registered with an engine that began to stop meanwhile (one
            # admitted before the drain stays admitted).
            self.check_admission(admission)
        running = self._started()
        uid = next(self._uids)
        # Bounded by the most events a request can receive: PromptReady, a Delta per token
        # for each choice, and one Failed.
        bound = params.n * ((params.max_tokens or self.max_model_len) + 1) + 2
        send, recv = trio.open_memory_channel[Any](bound)
        entry = RequestEntry(
            uid, params, send, trio.current_time(), request_id=request_id or random_id("req-")
        )
        stream = RequestStream(uid, params, recv)
        self.registry.add(entry)
        if admission is not None:
            admission.opened()
        log.debug(
            "uid %d: opened (n=%d, max_tokens=%s)", uid, params.n, params.max_tokens, extra=entry.log_extra
        )
        outcome = "aborted"
        try:
            running.tokenizer_inbox.send_nowait(
                Tokenize(
                    uid=uid,
                    params=params,
                    prompt=prompt,
                    prompt_token_ids=tuple(prompt_token_ids) if prompt_token_ids else None,
                    messages=tuple(messages) if messages is not None else None,
                    tools=tuple(tools) if tools is not None else None,
                    chat_template_kwargs=chat_template_kwargs or {},
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    grammar=grammar,
                )
            )
            yield stream
            if stream.is_finished:
                outcome = "completed"
        except RequestAborted:
            raise  # a drain's abort is counted as aborted, not as the engine failing
        except FtError as e:
            # A queue wait past `max_queue_wait_s` (Overloaded) is refused like a full queue.
            outcome = "rejected" if e.status < 500 or isinstance(e, Overloaded) else "failed"
            raise
        finally:
            self.registry.remove(uid)
            recv.close()
            try:
                running.scheduler_inbox.send_nowait(Abort(uid))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the engine has stopped; its scheduler holds nothing any more
            report = self.stats.record(outcome, entry, stream, trio.current_time())
            log.debug(
                "uid %d: closed %s after %.3f s (%d prompt + %d output tokens)",
                entry.uid,
                outcome,
                report.e2e_s,
                report.num_prompt_tokens,
                report.num_output_tokens,
                extra=entry.log_extra,
            )

    async def generate(self, prompt: str, params: SamplingParams | None = None) -> str:
        """Complete `prompt` (no chat template); return the first choice's text."""
        async with self.open_request(prompt=prompt, params=params) as stream:
            return (await stream.collect())[0].text

    async def tokenize(
        self,
        *,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a prompt or of rendered chat messages (no request is registered).

        These share the tokenizer workers with generation, so they are admitted like requests
        (503 while loading, stopping or with a full queue) and at most `tokenizer_workers` run
        at once; one more is refused with `Overloaded` rather than queued behind them.
        `continue_final_message` renders the last message open, so generation continues it.
        """
        self.check_admission()
        if self._tokenize_slots.borrowed_tokens >= self._tokenize_slots.total_tokens:
            self.stats.rejected += 1
            raise Overloaded(
                f"{self._tokenize_slots.total_tokens} tokenize requests are running; retry later"
            )
        async with self._tokenize_slots:
            return await self.tokenize_for_request(
                prompt=prompt,
                messages=messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )

    async def tokenize_for_request(
        self,
        *,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a generation request's prompt, before its scope opens.

        Not limited like `tokenize`: a route calls it after `check_admission`, and the tokenizer
        workers bound how many run at once (the rest wait for one, as `Tokenize` jobs do).

        Raises:
            InvalidRequest: the prompt cannot be rendered or encoded.
            EngineStopping: the engine has not started.
        """
        tokenizer_actor = self._started().tokenizer_actor
        msg = Tokenize(
            uid=0,
            params=SamplingParams(),
            prompt=prompt,
            messages=tuple(messages) if messages is not None else None,
            tools=tuple(tools) if tools is not None else None,
            chat_template_kwargs=chat_template_kwargs or {},
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return await tokenizer_actor.tokenize(msg)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise what admission would refuse a prompt of this size for, whatever the load.

        A static check (context length, `n` against the running slots, the KV pool's size):
        a route runs it before committing to a 200, so a request that can never run is a 400.

        Raises:
            InvalidRequest: an empty prompt, or `n` above `max_running_requests`.
            ContextLengthExceeded: the prompt and `max_tokens` do not fit.
        """
        try:
            self._started().core.check_fits(num_prompt_tokens, params)
        except FtError:
            self.stats.rejected += 1
            raise

    async def check_grammar(self, spec: GrammarSpec, *, client: str | None = None) -> None:
        """Check that `spec` compiles (in a worker, once per distinct spec: cached).

        A route awaits it with the static checks, so a bad grammar is a 400 before any stream;
        `client` names who asks (a peer address), so one client cannot fill the compile queue.
        The request's own grammar is built when its scope opens (`compile_grammar`).

        Raises:
            InvalidRequest: the grammar is invalid, too large or too slow to compile.
            Overloaded: the compile queue (or the client's share of it) is full.
            EngineStopping: the engine has not started.
        """
        try:
            await self._started().grammars.check(spec, client=client)
        except FtError:
            self.stats.rejected += 1
            raise

    async def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """A grammar of `spec` for one request: checked once per distinct spec (cached), its
        template built anew, so what one request's matchers explore dies with it.

        Raises:
            InvalidRequest, Overloaded, EngineStopping: as `check_grammar`.
        """
        try:
            return await self._started().grammars.get(spec)
        except FtError:
            self.stats.rejected += 1
            raise

    def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`. Raises `InvalidRequest` for ids outside the vocabulary."""
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(
                    f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})",
                    param="tokens",
                )
        return self._decode(token_ids, skip_special_tokens)

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        decoded = self._started().tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return str(decoded)

    def _on_tokens(self, entry: RequestEntry) -> None:
        now = trio.current_time()
        if entry.first_token_at is None:
            entry.first_token_at = now
        elif entry.last_token_at is not None:
            entry.token_gaps.append(now - entry.last_token_at)
        entry.last_token_at = now

    def _on_step(self, done: StepDone) -> None:
        self.stats.step(done, trio.current_time())

    # --- draining ----------------------------------------------------------------------------

    async def _wait_idle(self) -> None:
        while len(self.registry) or self._num_admissions:
            await trio.sleep(0.01)

    def begin_stop(self, drain_timeout_s: float = 5.0, abort_timeout_s: float = 3.0) -> None:
        """Stop admitting now and start the drain in the engine's nursery; return at once.

        The drain waits up to `drain_timeout_s` for active requests, aborts the rest, waits
        up to `abort_timeout_s` for their scopes to close, then sets the state to "stopped".
        It belongs to the engine, so it completes whoever asked for it and whether they wait.
        A later call can only shorten the drain (its deadline is the earliest asked for).
        Synchronous, so it is safe to call from a cancelled task.
        """
        now = trio.current_time()
        if self._drain_scope is not None:
            self._drain_scope.deadline = min(self._drain_scope.deadline, now + drain_timeout_s)
            self._abort_timeout_s = min(self._abort_timeout_s, abort_timeout_s)
            return
        if self._stop_snapshot is not None:
            return
        assert self._nursery is not None, "the engine is not running (use open_engine)"
        if not self.has_failed:  # a failed engine stays in ERROR: /health keeps saying why
            self.state = EngineState.STOPPING
        self._drain_scope = trio.CancelScope(deadline=now + drain_timeout_s)
        self._abort_timeout_s = abort_timeout_s
        self._nursery.start_soon(self._drain, self._drain_scope)

    async def _drain(self, drain_scope: trio.CancelScope) -> None:
        with drain_scope:
            await self._wait_idle()
        self.abort_all()
        with trio.move_on_after(self._abort_timeout_s):
            await self._wait_idle()
        self._kill_jobs()  # a request still in a worker holds nothing up any longer
        self._stop_snapshot = self.snapshot() | {"drain_complete": True}
        if not self.has_failed:
            self.state = EngineState.STOPPED
        self._stopped.set()

    def abort_all(self) -> None:
        """Fail every live request with `RequestAborted` and free what it holds (synchronous)."""
        for uid in self.registry.uids():
            self.registry.fail(uid, RequestAborted("the server is stopping; request aborted"))
            if self._running is not None:
                self._running.scheduler_inbox.send_nowait(Abort(uid))

    async def wait_stopped(self) -> dict[str, Any]:
        """Wait for the drain `begin_stop` started; return its final snapshot."""
        await self._stopped.wait()
        assert self._stop_snapshot is not None
        return self._stop_snapshot

    async def prepare_stop(
        self, drain_timeout_s: float = 5.0, abort_timeout_s: float = 3.0
    ) -> dict[str, Any]:
        """Stop admitting; drain, then abort what is left; return the final snapshot.

        `begin_stop` then `wait_stopped`: cancelling the caller leaves the drain running.
        Idempotent: later calls wait for the same drain (a shorter timeout shortens it).
        """
        self.begin_stop(drain_timeout_s, abort_timeout_s)
        return await self.wait_stopped()

    # --- observability -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The `/v1/stats` record, derived from the registry, the core and the page pool."""
        core = self.core
        # NOTE: the core lags the registry (an `Abort` or `FinishSeq` not yet taken): only
        # requests the engine still works for count as running, so the counts add up.
        running_uids = {seq.uid for seq in core.running.values()} if core else set()
        running = sum(self.registry.is_in_engine(uid) for uid in running_uids)
        pool = core.pool if core else None
        return {
            "instance_id": self.instance_id,
            "state": self.state,
            "model": {"id": self.model_id, "ctx": self.max_model_len},
            "uptime_s": round(self.stats.uptime(), 3),
            "kv": {
                "used_pages": pool.num_used if pool else 0,
                "total_pages": pool.num_pages if pool else 0,
                "page_size": self.config.page_size,
                "cached_pages": pool.num_cached if pool else 0,
                "free_pages": pool.num_allocatable - pool.num_cached if pool else 0,
                "used_tokens": core.num_held_tokens if core else 0,
                "usage": round(pool.num_used / pool.num_pages, 4) if pool else 0.0,
                "dtype": self.kv_cache_dtype,
            },
            "scheduler": {
                "admission": self.config.admission,
                "preemptions": core.num_preemptions if core else 0,
                "recomputed_tokens": core.num_recomputed_tokens if core else 0,
                "prefix_hit_tokens": core.num_prefix_hit_tokens if core else 0,
                "prefix_query_tokens": core.num_prefix_query_tokens if core else 0,
            },
            "throughput": self.stats.throughput(trio.current_time()),
            "requests": {
                "active": len(self.registry),
                "waiting": self.registry.num_in_engine - running,
                "running": running,
                "sending": self.registry.num_sending,
                "preparing": self._num_preparing,
            }
            | self.stats.request_totals(),
            "process": {"rss_bytes": _rss_bytes()},
        }


async def _run_here(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
    await trio.lowlevel.checkpoint()
    return job(payload)


def _rss_bytes() -> int:
    """This process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None,
    *,
    hooks: EngineHooks | None = None,
    wait_ready: bool = True,
) -> AsyncIterator[Engine]:
    """Start the engine's actors in a nursery; stop them all when the block exits.

    With `wait_ready=False` the engine is yielded while weights load (`engine.state` says
    "loading"; requests get `EngineStopping` until it is "ready"), so a server can answer
    `/health` during the load.
    """
    engine = Engine(config or EngineConfig(), hooks or EngineHooks())
    try:
        # Workers ignore SIGINT/SIGTERM (a terminal's Ctrl-C and a process-group signal reach
        # them too): stopping is this process's decision. Busy ones are killed when the engine
        # stops, idle ones exit when their context closes, and all exit if this process dies.
        async with trio_parallel.open_worker_context(
            init=partial(init_worker, engine.config.template_timeout_s, WORKER_MEMORY_BYTES),
            retire=retire_worker,
            grace_period=WORKER_GRACE_S,
        ) as workers:
            engine._workers = workers
            async with trio.open_nursery() as nursery:
                engine._nursery = nursery
                nursery.start_soon(engine._boot, nursery)
                if wait_ready:
                    await engine.wait_ready()
                try:
                    yield engine
                finally:
                    if not engine.has_failed:
                        engine.state = EngineState.STOPPED
                    engine._kill_jobs()
                    nursery.cancel_scope.cancel()
    finally:
        if engine._close_model is not None:
            engine._close_model(engine.has_failed)
        engine._tmpdir.cleanup()
