"""TokenizerActor: renders and tokenizes each request in a worker, then enqueues it.

The workers are shared fairly (`FairLimiter`: the next job is the one of the client that used
them least recently, refusals weighing four times), a long text is tokenized a slice at a time
and refused once its count passes the context (`ft.tokenizer.bounds`), and a job that kills
its worker waits in its slot for the replacement's start.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import cbor2
import trio
import trio_parallel

from ft.actors.fair_limiter import FairLimiter
from ft.actors.registry import Registry
from ft.core.fair_share import FairShareStatistics
from ft.errors import ContextLengthExceeded, FtError, InvalidRequest, RequestFailed
from ft.messages import Enqueue, PromptReady, SchedulerIn, Tokenize
from ft.params import check_token_ids
from ft.prompt import PromptSpec
from ft.tokenizer.bounds import too_long
from ft.tokenizer.codec import TokenizeResult, decode_result, encode_job, encode_slice_job, is_small_job
from ft.tokenizer.job import Executor, tokenize_slice_job, warm_tokenizer_job

log = logging.getLogger("ft.tokenizer")

ENCODE_THREADS = 1  # threads encoding jobs at once: encoding holds the GIL (see ft.server.edge.body)


@dataclass(frozen=True, slots=True)
class TokenizerStatistics:
    """What the tokenizer workers did: jobs run (a long text's slices each count), characters
    tokenized, workers replaced after a job crashed or was killed, slots waiting or held."""

    num_jobs: int
    num_chars_tokenized: int
    num_worker_restarts: int
    slots: FairShareStatistics


class TokenizerActor:
    """One task per job; the jobs share the workers through `limiter`, fairly by client."""

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[Tokenize],
        scheduler: trio.MemorySendChannel[SchedulerIn],
        registry: Registry,
        *,
        spec_path: str,
        vocab_size: int,
        executor: Executor,
        job: Callable[[bytes], bytes],
        limiter: FairLimiter,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.inbox = inbox
        self.scheduler = scheduler
        self.registry = registry
        self.spec_path = spec_path
        self.vocab_size = vocab_size
        self.executor = executor
        self.job = job  # what a worker runs: `ft.tokenizer.job.tokenize_job` (a test double in tests)
        self.limiter = limiter  # as many slots as the executor has workers
        self.max_prompt_tokens = max_prompt_tokens  # a request's prompt (`Tokenize`) fits this
        self.encode_limiter = trio.CapacityLimiter(ENCODE_THREADS)
        self.num_jobs = 0
        self.num_chars_tokenized = 0
        self.num_worker_restarts = 0

    def statistics(self) -> TokenizerStatistics:
        """What the workers did so far, and the slots now."""
        return TokenizerStatistics(
            self.num_jobs, self.num_chars_tokenized, self.num_worker_restarts, self.limiter.statistics()
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve jobs until the inbox closes."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for msg in self.inbox:
                nursery.start_soon(self._serve, msg)

    async def _serve(self, msg: Tokenize) -> None:
        if msg.uid not in self.registry:
            return
        try:
            ids = await self.tokenize(msg.prompt, max_tokens=self.max_prompt_tokens)
        except FtError as e:
            log.debug("uid %d: tokenization refused: %s", msg.uid, e)
            self.registry.fail(msg.uid, e)
            return
        # No checkpoint between this check and the sends: a request whose scope closed is
        # never enqueued, so the scheduler cannot hold a sequence nobody will abort.
        if msg.uid not in self.registry:
            return
        entry = self.registry.get(msg.uid)
        assert entry is not None
        entry.prompt_ids = tuple(ids)  # left context for the request's detokenizers
        log.debug("uid %d: tokenized, %d prompt tokens", msg.uid, len(ids), extra=entry.log_extra)
        entry.send.send_nowait(PromptReady(entry.prompt_ids))
        partition = msg.prompt.cache_partition
        self.scheduler.send_nowait(Enqueue(msg.uid, tuple(ids), msg.params, msg.grammar, partition))

    async def tokenize(
        self, prompt: PromptSpec, *, client: str | None = None, max_tokens: int | None = None
    ) -> list[int]:
        """Token ids for a prompt (rendered and tokenized in a worker). Raises `FtError`.

        `client` names who asks (a peer address; None: unnamed): the workers go to the client
        that used them least recently (`FairLimiter`). `max_tokens`: a prompt known to have
        more tokens than this is refused with `ContextLengthExceeded` as soon as that is known
        (by its bytes, or by a long text's slices so far), before the rest is tokenized.
        """
        if prompt.token_ids is not None:
            # The engine's own check of a request's ids (`open_request` is public: bench and
            # library callers pass ids no route has seen); a route checks them earlier too, for
            # a 400 before a stream's 200 and a `param` naming which prompt.
            check_token_ids(prompt.token_ids, self.vocab_size, param="prompt")
            return list(prompt.token_ids)
        encode = partial(encode_job, prompt, self.spec_path, max_tokens)
        # Encoding is linear in the messages and kwargs the client sent (tens of ms for 1 MB):
        # a large job is encoded off the loop, one at a time, like the body parse before it.
        if is_small_job(prompt):
            payload = encode()
        else:
            payload = await trio.to_thread.run_sync(encode, limiter=self.encode_limiter)
        first = await self._run(self.job, payload, client, prompt)
        ids = first.checked_ids()
        if first.rest is None:
            return ids
        # A long text: the rest a slice at a time, each slice a job of its own, so the workers
        # go round the clients between slices; refused once the count passes `max_tokens`.
        rest, num_chars = first.rest, first.num_chars
        edges = [0, *(first.cuts or ()), len(rest)]
        for start, end in itertools.pairwise(edges):
            if max_tokens is not None and len(ids) > max_tokens:
                how = f"counted in its first {num_chars} characters"
                raise ContextLengthExceeded(too_long(len(ids), max_tokens, how), param=prompt.param)
            payload = encode_slice_job(self.spec_path, rest[start:end])
            piece = await self._run(tokenize_slice_job, payload, client, prompt)
            ids += piece.checked_ids()
            num_chars += piece.num_chars
        return ids

    async def _run(
        self, job: Callable[[bytes], bytes], payload: bytes, client: str | None, prompt: PromptSpec
    ) -> TokenizeResult:
        """Run one job in a worker once it is `client`'s turn; a refusal or a crash is charged
        to `client` as a failure, and so is the replacement of a worker it cost."""
        async with self.limiter.slot(client) as slot:
            try:
                result = await self.executor(job, payload)
            except trio.TooSlowError as e:  # the worker was killed and replaced
                await self._replace_worker()
                what = "rendering the chat template and tokenizing" if prompt.is_chat else "tokenizing"
                raise InvalidRequest(f"{what} took too long: {e}", param=prompt.param) from e
            except FtError:
                raise  # the engine stopped while the job ran (RequestAborted)
            except trio_parallel.BrokenWorkerError as e:
                # The details (process, pid, exit code) go to the log, never to the client.
                log.error("the tokenizer worker died: %s", e)
                await self._replace_worker()
                raise RequestFailed("the tokenizer worker died; retry the request") from e
            except Exception as e:  # a bug or crash in the job fails this request, not the actor
                log.error("tokenization failed", exc_info=e)
                raise RequestFailed("tokenization failed (an internal error; see the server log)") from e
            self.num_jobs += 1
            answer = decode_result(result)
            self.num_chars_tokenized += answer.num_chars
            if answer.error is not None:
                slot.failed = True
            if answer.retired:
                await self._replace_worker()
            return answer

    async def _replace_worker(self) -> None:
        """Start the worker that replaces one a job killed, inside that job's slot: its client
        pays for the start (a second or more), not the next client's job."""
        self.num_worker_restarts += 1
        try:
            await self.executor(warm_tokenizer_job, cbor2.dumps({"spec_path": self.spec_path}))
        except (trio.TooSlowError, trio_parallel.BrokenWorkerError) as e:
            log.warning("a replacement tokenizer worker did not start: %s", e)
