"""The engine's compiled grammars: each distinct spec checked once in a worker, then cached.

A spec new to the engine is compiled first by `check_grammar_job` in a worker process under a
deadline (`timeout_s`, counted from when one of the `workers` is free; the worker is killed
past it, and a crash only loses the worker), then built in a thread here. Successes and
refusals are both remembered (least recently used first out), so a client resending a schema,
valid or hostile, costs a dictionary lookup.
Concurrent requests for the same new spec wait for one compilation.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import cbor2
import trio
import trio_parallel

from ft.errors import InvalidRequest
from ft.grammar.compiled import Grammar, compile_matcher, grammar_tokenizer
from ft.grammar.spec import GrammarSpec
from ft.tokenizer.job import check_grammar_job, grammar_payload

# Runs `check_grammar_job` somewhere and returns its CBOR answer; cancelling it must stop the job.
CheckExecutor = Callable[[Callable[[bytes], bytes], bytes], Awaitable[bytes]]

CACHE_SIZE = 256
# NOTE: a compiled grammar takes ~12x its source in memory (a 1 MiB choice list: 12 MiB), so
# the cache is bounded by its sources' size too: 256 large grammars would hold ~3 GiB.
CACHE_CHARS = 16 << 20
COMPILE_TIMEOUT_S = 5.0


async def run_in_killable_worker(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
    """Run `job` in a trio-parallel worker that is killed if the caller is cancelled."""
    result: bytes = await trio_parallel.run_sync(job, payload, kill_on_cancel=True)
    return result


class Grammars:
    """Compiled grammars by spec, for one model's tokenizer."""

    def __init__(
        self,
        *,
        spec_path: str,
        tokenizer_json: str,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        executor: CheckExecutor = run_in_killable_worker,
        timeout_s: float = COMPILE_TIMEOUT_S,
        workers: int = os.cpu_count() or 1,
        fault: str | None = None,
    ) -> None:
        self._spec_path = spec_path
        self._tokenizer_args = (tokenizer_json, vocab_size, eos_token_ids)
        self._vocab_size = vocab_size
        self._executor = executor
        self._timeout_s = timeout_s
        # NOTE: at most as many compilations as the executor has workers, so that a burst of
        # new specs waits here, before its deadline starts, and is not refused for queueing.
        self._workers = trio.CapacityLimiter(workers)
        self._fault = fault
        self._cache: OrderedDict[tuple[str, str], Grammar | str] = OrderedDict()  # str: the refusal
        self._pending: dict[tuple[str, str], trio.Event] = {}
        self._num_cached_chars = 0
        self.num_compiled = 0  # compilations run (cache misses), for tests and stats

    def __len__(self) -> int:
        return len(self._cache)

    async def get(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of `spec`.

        Raises:
            InvalidRequest: the grammar is invalid, exceeds the limits, takes longer than the
                deadline or crashes its compiler (naming `spec.param`).
        """
        while (hit := self._cache.get(spec.key)) is None and spec.key in self._pending:
            await self._pending[spec.key].wait()
        if hit is None:
            done = self._pending[spec.key] = trio.Event()
            try:
                hit = await self._compile(spec)
                self._remember(spec.key, hit)
            finally:
                del self._pending[spec.key]
                done.set()
        else:
            self._cache.move_to_end(spec.key)
        if isinstance(hit, str):
            raise InvalidRequest(f"{spec.param} cannot be used: {hit}", param=spec.param)
        return hit

    def _remember(self, key: tuple[str, str], value: Grammar | str) -> None:
        self._cache[key] = value
        self._num_cached_chars += len(key[1])
        while len(self._cache) > 1 and self._is_over_budget:
            (_, source), _ = self._cache.popitem(last=False)
            self._num_cached_chars -= len(source)

    @property
    def _is_over_budget(self) -> bool:
        return len(self._cache) > CACHE_SIZE or self._num_cached_chars > CACHE_CHARS

    async def _compile(self, spec: GrammarSpec) -> Grammar | str:
        self.num_compiled += 1
        payload = grammar_payload(spec, self._spec_path, self._vocab_size, self._fault)
        async with self._workers:
            with trio.move_on_after(self._timeout_s):
                try:
                    answer = cbor2.loads(await self._executor(check_grammar_job, payload))
                except trio_parallel.BrokenWorkerError:
                    return "the grammar crashed its compiler (it is too large or too deeply nested)"
                if "error" in answer:
                    return str(answer["error"])
                return await trio.to_thread.run_sync(self._build, spec, answer["grammar"])
            return f"the grammar took longer than {self._timeout_s:g} s to compile"

    def _build(self, spec: GrammarSpec, text: str) -> Grammar | str:
        try:
            tokenizer = grammar_tokenizer(*self._tokenizer_args)
            return Grammar(spec, compile_matcher(text, tokenizer, self._vocab_size))
        except ValueError as e:
            return str(e)
