"""open_engine(): the actors' nursery, and Engine, whose `open_request` is the only way in.

`Engine` is the facade; its rooms are `lifetime` (boot, states, worker jobs), `admission`,
`drain` and `observe` (the snapshot). The request scope itself is here, in `open_request`.
"""

from __future__ import annotations

import itertools
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ft.actors.registry import Registry, RequestEntry
from ft.actors.tokenizer import TokenizerStatistics
from ft.config import DEFAULT_ABORT_TIMEOUT_S, DEFAULT_DRAIN_TIMEOUT_S, EngineConfig
from ft.core.prompt_cache import PromptCache
from ft.core.scheduler import Scheduler
from ft.engine.admission import Admission, Admissions
from ft.engine.drain import Drain
from ft.engine.grammars import GrammarStatistics
from ft.engine.lifetime import EngineState, Running, WorkerJobs, refusal, run
from ft.engine.loading import EngineHooks
from ft.engine.observe import EngineSnapshot, snapshot
from ft.engine.stats import Stats
from ft.engine.stream import RequestStream
from ft.errors import EngineStopping, FtError, InvalidRequest, Overloaded, RequestAborted, RequestFailed

if TYPE_CHECKING:
    from ft.model.plan import ExecutionPlan
from ft.grammar.compiled import Grammar
from ft.grammar.spec import GrammarSpec
from ft.ids import random_id
from ft.messages import Abort, StepDone, Tokenize
from ft.model.rerank import RankFormat
from ft.model_names import model_names
from ft.params import SamplingParams, check_token_ids
from ft.prompt import PromptSpec

__all__ = ["Admission", "Engine", "EngineState", "open_engine"]

log = logging.getLogger("ft.engine")


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
        # Decided before any work, so every surface shows one id from the first second on.
        self.names = model_names(config.model, config.served_names)
        self.model_id = self.names.id
        # Whether the chat template renders a system message mid-conversation in place (known
        # once the template check ran at load; until then False: such turns are folded).
        self.template_renders_mid_system = False
        self.max_model_len = 0
        self.vocab_size = 0
        self.kv_cache_dtype = config.kv_cache_dtype  # resolved to a real dtype once loaded
        self.model_plan: ExecutionPlan | None = None  # how the model runs, once loaded
        self.generation_defaults: dict[str, float | int] = {}
        self.reasoning_parser: str | None = None  # the model family's `<think>` format, once loaded
        # the model family's tool-call format (else the one its chat template spells), once loaded
        self.tool_call_parser: str | None = None
        # the tool-call markers its vocabulary holds as tokens (forced calls write them so), once loaded
        self.marker_tokens: frozenset[str] = frozenset()
        self.hidden_size = 0  # the width of a pooled embedding, once loaded
        self.kv_cache_bytes = 0  # the KV pool's size (pages x bytes per page), once loaded
        self.pooling = "last"  # how embedding requests pool (`config.pooling` resolved at load)
        self.rank_format: RankFormat | None = None  # a reranker's pair format and labels, once loaded
        self.admissions = Admissions(config, self.registry)
        self._drain = Drain(self)
        self.jobs = WorkerJobs()  # jobs in the tokenizer worker processes (`lifetime.run` opens them)
        self._uids = itertools.count(1)
        self._ready = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._tokenize_slots = trio.CapacityLimiter(config.tokenizer_workers)
        self._running: Running | None = None  # set once the actors have started
        self._failed = trio.Event()  # set when the model failed to load or its runner failed
        self._close_model: Callable[[bool], None] | None = None
        self.kv_page_bytes = 0  # bytes of one KV page, once loaded
        self.state_slot_bytes = 0  # a hybrid model's bytes of one recurrent state slot, once loaded
        self.prompt_cache: PromptCache | None = None  # the disk tier, once started (closed with it)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="ft-")

    # --- lifetime (the boot is `lifetime.boot`) -----------------------------------------------

    def _on_progress(self, fraction: float) -> None:
        # Called from the loading thread: a float assignment, nothing else.
        self.load_progress = round(0.9 * fraction, 3)

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

    def refusal(self) -> EngineStopping:
        """The 503 for a request the engine cannot serve in its state (loading, failed, stopping);
        the one place these refusals are worded."""
        return refusal(self.state, self.error)

    def _started(self) -> Running:
        """What the started engine holds. Raises `EngineStopping` (503) while it loads."""
        if self._running is None:
            raise self.refusal()
        return self._running

    @contextmanager
    def counting_rejections(self, *kinds: type[FtError]) -> Iterator[None]:
        """Count a refusal of `kinds` (any `FtError` when none given) raised in the block as a
        rejected request (`stats.rejected`), and let it propagate: the checks themselves only raise.
        """
        caught = kinds or (FtError,)
        try:
            yield
        except caught:
            self.stats.rejected += 1
            raise

    # --- requests ----------------------------------------------------------------------------

    def check_admission(self, admission: Admission | None = None) -> None:
        """Raise what `open_request` would raise now for engine state or capacity.

        A streaming route calls it first so it can answer 503 before committing to a 200.
        `admission`: the request was admitted (`admit`) before a drain began, so a drain lets
        it in (it is in flight, not new) until the drain aborts the rest (then `RequestAborted`),
        and its own place in the queue is not counted twice.
        A pure check: `admit`, `open_request` and `tokenize` count what they refuse.
        """
        is_admitted_in_drain = admission is not None and self.state == EngineState.STOPPING
        if is_admitted_in_drain and self._drain.has_aborted:
            # The drain's deadline passed and it aborted the rest: one still being prepared then
            # is aborted too, rather than served after the drain reported itself complete.
            raise RequestAborted("the server is stopping; request aborted")
        if self.state != EngineState.READY and not is_admitted_in_drain:
            raise self.refusal()
        self.admissions.check_capacity(admission)

    def admit(self, num_prompts: int = 1) -> Admission:
        """Admit a request of `num_prompts` prompts (one scope each) now, before the work that
        precedes its scopes (tokenizing, compiling its grammar, sending a stream's headers): a
        drain that begins meanwhile waits for the admission's `release` and lets its
        `open_request(admission=...)` in. Each prompt counts against the capacity.

        Raises:
            EngineStopping, Overloaded: what `check_admission` raises (room for one prompt is
                enough: the later ones are checked as their scopes open). A full queue is
                counted as a rejected request.
        """
        with self.counting_rejections(Overloaded):
            self.check_admission()
        return self.admissions.admit(num_prompts)

    @asynccontextmanager
    async def open_request(
        self,
        prompt: PromptSpec,
        *,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        admission: Admission | None = None,
    ) -> AsyncIterator[RequestStream]:
        """Register a request for `prompt` for the block's duration; yield its stream of deltas.

        `request_id` names the request in the engine's logs and in its `RequestReport` (the
        server passes the HTTP `X-Request-Id`); one is made when it is None. `admission`: it
        was admitted (`admit`) before a drain began, so the drain lets it in.

        The exit (success, exception or cancellation) unregisters the uid and posts `Abort`,
        which frees its KV pages and running slot; it is synchronous, so it is safe to leave
        the block from a cancelled task.

        Raises:
            Overloaded: the waiting queue is full.
            EngineStopping: loading, stopping, or failed.
        """
        params = params or SamplingParams()
        with self.counting_rejections(Overloaded):
            self.check_admission(admission)
        grammar: Grammar | None = None
        if params.grammar is not None:
            with self.counting_rejections():
                grammar = await self.compile_grammar(params.grammar)
            # NOTE: a new grammar compiles for up to seconds: admission is checked again, so a
            # request is never registered with an engine that began to stop meanwhile (one
            # admitted before the drain stays admitted).
            with self.counting_rejections(Overloaded):
                self.check_admission(admission)
        running = self._started()
        uid = next(self._uids)
        # Bounded by the most events a request can receive: PromptReady, a Delta per token
        # for each choice, and one Failed.
        tokens = self.max_model_len if params.max_tokens is None else max(1, params.max_tokens)
        bound = params.n * (tokens + 1) + 2
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
            running.tokenizer_inbox.send_nowait(Tokenize(uid, params, prompt, grammar))
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
        async with self.open_request(PromptSpec(text=prompt), params=params) as stream:
            return (await stream.collect())[0].text

    async def embed(self, prompt: str, pooling: str | None = None) -> tuple[float, ...]:
        """Pool `prompt`'s hidden states (`pooling`, else the engine's); return the vector, not
        normalized (rank pooling: the classification head's outputs). A pooling request: batched
        and scheduled like any, nothing sampled.

        Raises:
            InvalidRequest: rank pooling on a model without a classification head.
        """
        params = SamplingParams(pooling=pooling or self.pooling)
        if params.pooling == "rank" and self.rank_format is None:
            raise InvalidRequest("rank pooling needs a reranker (a classification head)", param="pooling")
        async with self.open_request(PromptSpec(text=prompt), params=params) as stream:
            return await stream.wait_embedding()

    async def tokenize(
        self,
        prompt: PromptSpec,
        *,
        admission: Admission | None = None,
        client: str | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        """Token ids of `prompt`, its messages rendered (no request is registered).

        `admission`: the prompt is a generation request's, admitted (`admit`) before its scope
        opens; the tokenizer workers bound how many run at once (the rest wait for one, as
        `Tokenize` jobs do). Without one (`/v1/tokenize`), the call shares the workers with
        generation, so it is admitted like a request (503 while loading, stopping or with a full
        queue) and at most `tokenizer_workers` run at once; one more is refused with
        `Overloaded` rather than queued behind them. `client` names who asks (a peer address):
        waiting jobs get the workers by how little their clients used them recently.
        `max_tokens`: a prompt known to have more tokens than this (by its bytes, or by the
        slices of a long text tokenized so far) is refused before the rest is tokenized; a
        generation route passes the context length.

        Raises:
            InvalidRequest: the prompt cannot be rendered or encoded.
            ContextLengthExceeded: the prompt has more than `max_tokens` tokens.
            EngineStopping: loading, stopping (without an admission), or failed.
            Overloaded: without an admission, the queue or the tokenize slots are full.
        """
        tokenize = partial(
            self._started().tokenizer_actor.tokenize, prompt, client=client, max_tokens=max_tokens
        )
        if admission is not None:
            return await tokenize()
        slots = self._tokenize_slots
        with self.counting_rejections(Overloaded):
            self.check_admission()
            if slots.borrowed_tokens >= slots.total_tokens:
                raise Overloaded(f"{slots.total_tokens} tokenize requests are running; retry later")
        async with slots:
            return await tokenize()

    def tokenizer_statistics(self) -> TokenizerStatistics:
        """What the tokenizer workers did (jobs, characters tokenized, restarts) and their slots.

        Raises:
            EngineStopping: the engine has not started.
        """
        return self._started().tokenizer_actor.statistics()

    def grammar_statistics(self) -> GrammarStatistics:
        """What the grammar compiles did (compiles, compiling now, restarts) and their slots.

        Raises:
            EngineStopping: the engine has not started.
        """
        return self._started().grammars.statistics()

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise what admission would refuse a prompt of this size for, whatever the load.

        A static check (context length, `n` against the running slots, the KV pool's size):
        a route runs it before committing to a 200, so a request that can never run is a 400.

        Raises:
            InvalidRequest: an empty prompt, or `n` above `max_running_requests`.
            ContextLengthExceeded: the prompt and `max_tokens` do not fit.
        """
        self._started().core.check_fits(num_prompt_tokens, params)

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
        await self._started().grammars.check(spec, client=client)

    async def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """A grammar of `spec` for one request: checked once per distinct spec (cached), its
        template built anew, so what one request's matchers explore dies with it.

        Raises:
            InvalidRequest, Overloaded, EngineStopping: as `check_grammar`.
        """
        return await self._started().grammars.get(spec)

    def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`. Raises `InvalidRequest` for ids outside the vocabulary."""
        # The only check on this path (`/v1/detokenize` passes the body's ids straight here).
        check_token_ids(token_ids, self.vocab_size, param="tokens")
        return self._decode(token_ids, skip_special_tokens)

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        decoded = self._started().tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return str(decoded)

    def _on_step(self, done: StepDone) -> None:
        self.stats.step(done, trio.current_time())

    # --- draining (the drain is `drain.Drain`) ------------------------------------------------

    def begin_stop(
        self,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S,
        *,
        why: str | None = None,
    ) -> None:
        """Stop admitting now and start the drain in the engine's nursery; return at once.

        The drain waits up to `drain_timeout_s` for active requests, aborts the rest, waits
        up to `abort_timeout_s` for their scopes to close, then sets the state to "stopped".
        It belongs to the engine, so it completes whoever asked for it and whether they wait.
        A later call can only shorten the drain (its deadline is the earliest asked for).
        `why` is what the aborted requests are told (default: the server is stopping; the first
        call's stands). Synchronous, so it is safe to call from a cancelled task.
        """
        self._drain.begin(drain_timeout_s, abort_timeout_s, why)

    async def wait_stopped(self) -> EngineSnapshot:
        """Wait for the drain `begin_stop` started; return its final snapshot."""
        return await self._drain.wait()

    async def prepare_stop(
        self,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S,
    ) -> EngineSnapshot:
        """Stop admitting; drain, then abort what is left; return the final snapshot.

        `begin_stop` then `wait_stopped`: cancelling the caller leaves the drain running.
        Idempotent: later calls wait for the same drain (a shorter timeout shortens it).
        """
        self.begin_stop(drain_timeout_s, abort_timeout_s)
        return await self.wait_stopped()

    # --- observability (the records are `observe`'s) ------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """The engine now (a frozen record; `/v1/stats` is its `as_json()`)."""
        return snapshot(self)


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
    async with run(engine, wait_ready=wait_ready):
        yield engine
