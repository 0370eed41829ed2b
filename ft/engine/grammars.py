"""The engine's grammars: each distinct spec checked once in a worker, then built per request.

A spec new to the engine is compiled first by `check_grammar_job` in a worker process of the
grammars' own (`run`), so a compiler that crashes costs a grammar worker, never a tokenizer
one; under a deadline (`timeout_s`, counted from when one of the `workers` is free; the worker
is killed past it). What passed is kept as llguidance's grammar text, refusals as their
reason (least recently used first out, bounded by the bytes they hold), so a client resending
a schema, valid or hostile, costs a dictionary lookup. Concurrent requests for the same new
spec wait for one compilation.

Each request then builds its own template from the text in a thread (`build_grammar`), so
what one request's output explores is freed with it (see `ft.grammar.compiled`).

New specs compiling or waiting for a worker are bounded (`max_compiles`, and a share of them
for each named client): past it a new spec is refused with `Overloaded` (503, Retry-After),
but for a named client's first one.
The workers go to the waiting compile of the client that used them least recently
(`FairLimiter`, a refusal weighing four times its time), and a compile that crashes or
outlives its deadline starts its worker's replacement in its own slot: so another client's
new spec waits for the compiles running, not for a flood of crashing ones and their restarts.
"""

from __future__ import annotations

import os
import sys
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import cbor2
import trio
import trio_parallel

from ft.actors.fair_limiter import FairLimiter
from ft.core.fair_share import FairShareStatistics
from ft.errors import InvalidRequest, Overloaded
from ft.grammar.compiled import Grammar, build_grammar, grammar_tokenizer
from ft.grammar.spec import GrammarSpec
from ft.tokenizer.job import (
    WORKER_MEMORY_BYTES,
    check_grammar_job,
    grammar_payload,
    init_worker,
    retire_worker,
    warm_grammar_job,
)

# Runs `check_grammar_job` somewhere and returns its CBOR answer; cancelling it must stop the job.
CheckExecutor = Callable[[Callable[[bytes], bytes], bytes], Awaitable[bytes]]

CACHE_SIZE = 256
# What the cache holds is its keys' sources and the texts (or refusals) they compiled to,
# measured with `sys.getsizeof`: 256 sources of up to 1 MiB would be far more.
CACHE_BYTES = 32 << 20
COMPILE_TIMEOUT_S = 5.0
MIN_COMPILES = 16  # new specs compiling or waiting, at least (8 a worker)
WARM_TIMEOUT_S = 30.0  # a new compile worker's start and tokenizer load
WORKER_GRACE_S = 5.0
CRASHED = "the grammar crashed its compiler (it is too large or too deeply nested)"


async def run_in_killable_worker(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
    """Run `job` in a trio-parallel worker that is killed if the caller is cancelled."""
    result: bytes = await trio_parallel.run_sync(job, payload, kill_on_cancel=True)
    return result


@dataclass(frozen=True, slots=True)
class Checked:
    """What the worker's check of one spec said: llguidance's text of it, or why not."""

    text: str | None
    refusal: str | None = None

    @property
    def num_bytes(self) -> int:
        """Memory it holds (its string's)."""
        return sys.getsizeof(self.text if self.text is not None else self.refusal)


@dataclass(frozen=True, slots=True)
class GrammarStatistics:
    """What the grammars did: compiles run (cache misses), new specs compiling or waiting now,
    compile workers started again after a compile crashed or was killed, the slots now."""

    num_compiled: int
    num_compiling: int
    num_worker_restarts: int
    slots: FairShareStatistics


class Grammars:
    """Grammars by spec, for one model's tokenizer.

    `executor` None compiles in this object's own worker processes while `run` runs (in
    trio-parallel's default ones otherwise).
    """

    def __init__(
        self,
        *,
        spec_path: str,
        tokenizer_json: str,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        executor: CheckExecutor | None = None,
        timeout_s: float = COMPILE_TIMEOUT_S,
        workers: int = os.cpu_count() or 1,
        max_compiles: int | None = None,
        check_job: Callable[[bytes], bytes] = check_grammar_job,
    ) -> None:
        self._spec_path = spec_path
        self._tokenizer_args = (tokenizer_json, vocab_size, eos_token_ids)
        self._vocab_size = vocab_size
        self._executor = executor or self._run_in_own_worker
        self._context: trio_parallel.WorkerContext | None = None
        self._timeout_s = timeout_s
        # NOTE: at most as many compilations as the executor has workers, so that a burst of
        # new specs waits here, before its deadline starts, and is not refused for queueing;
        # the next one to compile is the one of the client that used the workers least.
        self._workers = FairLimiter(workers)
        # NOTE: a client may send several new schemas at once (an evaluation's seven, all in
        # parallel): with 4 on 2 workers, one client's seventh got 503. 16 compiles of at most
        # `timeout_s` each keep a new spec's wait bounded (behind a flood of crashing ones too).
        self.max_compiles = max_compiles or max(MIN_COMPILES, 8 * workers)
        self.max_compiles_per_client = max(1, self.max_compiles // 2)
        self._check_job = check_job  # `check_grammar_job`, or a test double of it
        self._cache: OrderedDict[tuple[str, str], Checked] = OrderedDict()
        self._pending: dict[tuple[str, str], trio.Event] = {}
        self._pending_by_client: Counter[str] = Counter()
        self.num_retained_bytes = 0  # what the cache holds: sources and texts, measured
        self.num_compiled = 0  # compilations run (cache misses), for tests and stats
        self.num_worker_restarts = 0  # workers started again after a compile crashed or was killed

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def num_compiling(self) -> int:
        """New specs compiling or waiting for a worker (what admission may count)."""
        return len(self._pending)

    def statistics(self) -> GrammarStatistics:
        """Compiles so far, compiling now, restarts, and the compile slots."""
        return GrammarStatistics(
            self.num_compiled, self.num_compiling, self.num_worker_restarts, self._workers.statistics()
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep this object's own compile workers until cancelled (then they are closed).

        They start like the tokenizer workers (SIGINT and SIGTERM ignored, a memory bound, an
        exit of their own once this process is gone) and are apart from them: a compiler that
        crashes kills a grammar worker, and no tokenize job respawns one.
        """
        init = partial(init_worker, COMPILE_TIMEOUT_S, WORKER_MEMORY_BYTES)
        async with trio_parallel.open_worker_context(
            init=init, retire=retire_worker, grace_period=WORKER_GRACE_S
        ) as context:
            self._context = context
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._context = None

    async def _run_in_own_worker(self, job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        if self._context is None:
            return await run_in_killable_worker(job, payload)
        result: bytes = await self._context.run_sync(job, payload, kill_on_cancel=True)
        return result

    async def get(self, spec: GrammarSpec, *, client: str | None = None) -> Grammar:
        """A new grammar of `spec` for one request (its template built in a thread).

        `client` names who asks (an API key, a peer address), so one client cannot hold
        more than `max_compiles_per_client` of the compile queue, and its first new spec is
        let in past a full queue; None is unnamed.

        Raises:
            InvalidRequest: the grammar is invalid, exceeds the limits, takes longer than the
                deadline or crashes its compiler (naming `spec.param`).
            Overloaded: the spec is new and `max_compiles` new specs (and one of the client's)
                or the client's share are compiling already, or no compile worker could start.
        """
        text = await self.check(spec, client=client)
        built = await trio.to_thread.run_sync(self._build, spec, text)
        if isinstance(built, str):
            raise InvalidRequest(f"{spec.param} cannot be used: {built}", param=spec.param)
        return built

    async def check(self, spec: GrammarSpec, *, client: str | None = None) -> str:
        """llguidance's text of `spec`, once a worker has checked it (cached).

        Raises:
            InvalidRequest, Overloaded: as `get`.
        """
        while (hit := self._cache.get(spec.key)) is None and spec.key in self._pending:
            await self._pending[spec.key].wait()
        if hit is None:
            self._admit(client)
            done = self._pending[spec.key] = trio.Event()
            if client is not None:
                self._pending_by_client[client] += 1
            try:
                hit = await self._compile(spec, client)
                self._remember(spec.key, hit)
            finally:
                del self._pending[spec.key]
                if client is not None:
                    self._pending_by_client -= Counter({client: 1})
                done.set()
        else:
            self._cache.move_to_end(spec.key)
        if hit.text is None:
            raise InvalidRequest(f"{spec.param} cannot be used: {hit.refusal}", param=spec.param)
        return hit.text

    def _admit(self, client: str | None) -> None:
        # A named client with nothing compiling gets in past the bound: the fair queue puts it
        # next, so a queue that other clients filled costs it no wait (one spec per client:
        # the engine's admission bounds how many requests, and so clients, are in flight).
        is_first = client is not None and self._pending_by_client[client] == 0
        if len(self._pending) >= self.max_compiles and not is_first:
            raise Overloaded(f"{len(self._pending)} new grammars are compiling; retry later")
        if client is not None and self._pending_by_client[client] >= self.max_compiles_per_client:
            raise Overloaded("this client's new grammars are compiling; retry later")

    def _remember(self, key: tuple[str, str], value: Checked) -> None:
        self._cache[key] = value
        self.num_retained_bytes += sys.getsizeof(key[1]) + value.num_bytes
        while len(self._cache) > 1 and self._is_over_budget:
            (_, source), old = self._cache.popitem(last=False)
            self.num_retained_bytes -= sys.getsizeof(source) + old.num_bytes

    @property
    def _is_over_budget(self) -> bool:
        return len(self._cache) > CACHE_SIZE or self.num_retained_bytes > CACHE_BYTES

    async def _compile(self, spec: GrammarSpec, client: str | None) -> Checked:
        self.num_compiled += 1
        payload = grammar_payload(spec, self._spec_path, self._vocab_size)
        async with self._workers.slot(client) as slot:
            # NOTE: a worker that is new (the first, or one a crash or a deadline killed)
            # spawns and loads the tokenizer first: 1-5 s on a loaded machine, which is not
            # the grammar's to pay. The check then runs in the warm worker (trio-parallel
            # reuses the last one freed).
            if not await self._warm():  # not the grammar's fault: nothing is remembered
                raise Overloaded("the grammar compilers cannot start; retry later")
            checked, killed = await self._check(payload)
            if checked.text is None:
                slot.failed = True
            if killed:
                # The replacement starts in this compile's slot: its client pays for it, and
                # the next client's compile finds a warm worker.
                self.num_worker_restarts += 1
                await self._warm()
            return checked

    async def _warm(self) -> bool:
        """Start a worker and load the tokenizer in it if none is warm; False if it failed."""
        warm = cbor2.dumps({"spec_path": self._spec_path, "vocab_size": self._vocab_size})
        with trio.move_on_after(WARM_TIMEOUT_S) as warming:
            try:
                await self._executor(warm_grammar_job, warm)
            except trio_parallel.BrokenWorkerError:
                warming.cancel()
        return not warming.cancelled_caught

    async def _check(self, payload: bytes) -> tuple[Checked, bool]:
        """The check's answer, and whether its worker died or was killed at the deadline."""
        with trio.move_on_after(self._timeout_s):
            try:
                answer = cbor2.loads(await self._executor(self._check_job, payload))
            except trio_parallel.BrokenWorkerError:
                return Checked(None, CRASHED), True
            if "error" in answer:
                return Checked(None, str(answer["error"])), False
            return Checked(str(answer["grammar"])), False
        return Checked(None, f"the grammar took longer than {self._timeout_s:g} s to compile"), True

    def _build(self, spec: GrammarSpec, text: str) -> Grammar | str:
        try:
            tokenizer = grammar_tokenizer(*self._tokenizer_args)
            return build_grammar(spec, text, tokenizer, self._vocab_size)
        except ValueError as e:
            return str(e)
