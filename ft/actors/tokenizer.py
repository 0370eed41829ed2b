"""TokenizerActor: renders and tokenizes each request in a worker, then enqueues it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio
import trio_parallel

from ft.actors.registry import Registry
from ft.errors import FtError, InvalidRequest, RequestFailed
from ft.messages import Enqueue, PromptReady, SchedulerIn, Tokenize
from ft.params import check_token_ids
from ft.prompt import PromptSpec
from ft.tokenizer.codec import decode_result, encode_job, is_small_job
from ft.tokenizer.job import Executor

log = logging.getLogger("ft.tokenizer")

ENCODE_THREADS = 1  # threads encoding jobs at once: encoding holds the GIL (see ft.server.edge.body)


class TokenizerActor:
    """One task per job; at most `limiter.total_tokens` jobs in workers at once."""

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
    ) -> None:
        self.inbox = inbox
        self.scheduler = scheduler
        self.registry = registry
        self.spec_path = spec_path
        self.vocab_size = vocab_size
        self.executor = executor
        self.job = job  # what a worker runs: `ft.tokenizer.job.tokenize_job` (a test double in tests)
        self.encode_limiter = trio.CapacityLimiter(ENCODE_THREADS)

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
            ids = await self.tokenize(msg.prompt)
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

    async def tokenize(self, prompt: PromptSpec) -> list[int]:
        """Token ids for a prompt (rendered and tokenized in a worker). Raises `FtError`."""
        if prompt.token_ids is not None:
            # The engine's own check of a request's ids (`open_request` is public: bench and
            # library callers pass ids no route has seen); a route checks them earlier too, for
            # a 400 before a stream's 200 and a `param` naming which prompt.
            check_token_ids(prompt.token_ids, self.vocab_size, param="prompt")
            return list(prompt.token_ids)
        encode = partial(encode_job, prompt, self.spec_path)
        # Encoding is linear in the messages and kwargs the client sent (tens of ms for 1 MB):
        # a large job is encoded off the loop, one at a time, like the body parse before it.
        if is_small_job(prompt):
            payload = encode()
        else:
            payload = await trio.to_thread.run_sync(encode, limiter=self.encode_limiter)
        try:
            result = await self.executor(self.job, payload)
        except trio.TooSlowError as e:  # the worker was killed and replaced
            what = "rendering the chat template and tokenizing" if prompt.is_chat else "tokenizing"
            raise InvalidRequest(f"{what} took too long: {e}", param=prompt.param) from e
        except FtError:
            raise  # the engine stopped while the job ran (RequestAborted)
        except trio_parallel.BrokenWorkerError as e:
            # The details (process, pid, exit code) go to the log, never to the client.
            log.error("the tokenizer worker died: %s", e)
            raise RequestFailed("the tokenizer worker died; retry the request") from e
        except Exception as e:  # a bug or crash in the job fails this request, not the actor
            log.error("tokenization failed", exc_info=e)
            raise RequestFailed("tokenization failed (an internal error; see the server log)") from e
        return decode_result(result)
