"""RequestStream: what `engine.open_request` yields; an async iterator of `Delta`s."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import trio

from ft.errors import RequestAborted
from ft.messages import Delta, Embedded, Failed, PromptReady, RequestEvent, TokenLogprob, TokenScore
from ft.params import SamplingParams


@dataclass(slots=True)
class Choice:
    """One choice's whole output, gathered by `RequestStream.collect`."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenScore] = field(default_factory=list)  # prompt tokens 1.., when asked

    def add(self, delta: Delta) -> None:
        """Append one of this choice's deltas."""
        self.prompt_logprobs += delta.prompt_logprobs
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class RequestStream:
    """Deltas for one request until each of its `n` choices has finished.

    Iteration raises the request's error (`FtError`) if it fails. Cancelling an iteration is
    safe: no event is lost. A pooling request gives no deltas: `wait_embedding` gives its
    vector (iterating it ends when the vector arrives).
    """

    def __init__(
        self, uid: int, params: SamplingParams, recv: trio.MemoryReceiveChannel[RequestEvent]
    ) -> None:
        self.uid = uid
        self.params = params
        self.prompt_ids: tuple[int, ...] = ()
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache supplied (once admitted)
        self._recv = recv
        self.finish_reasons: dict[int, str] = {}  # by choice index, once it has finished
        self._pending: Delta | None = None
        self.embedding: tuple[float, ...] | None = None  # a pooling request's, once it arrived

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt (0 until it is tokenized)."""
        return len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        """True once every choice has its finish reason."""
        return len(self.finish_reasons) == self.params.n

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.is_finished:
            raise StopAsyncIteration
        delta = await self._next_delta()
        if delta is None:
            raise StopAsyncIteration
        if self.params.max_tokens == 0:
            delta = prompt_only(delta)
        self.num_completion_tokens += len(delta.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.finish_reason is not None:
            self.finish_reasons[delta.index] = delta.finish_reason
        return delta

    async def wait_prompt(self) -> tuple[int, ...]:
        """Wait until the prompt is tokenized (or the request fails); return its ids."""
        while not self.prompt_ids and self._pending is None and self.embedding is None:
            self._pending = await self._next_delta()
        return self.prompt_ids

    async def wait_embedding(self) -> tuple[float, ...]:
        """Wait for a pooling request's vector (its prompt's hidden states pooled, not
        normalized); raise the request's error if it fails."""
        while self.embedding is None:
            if await self._next_delta() is not None:
                raise RuntimeError("wait_embedding on a request that generates tokens")
        return self.embedding

    async def _next_delta(self) -> Delta | None:
        # Absorbs PromptReady, raises Failed; a Delta read early by wait_prompt comes first.
        # None: a pooling request's vector arrived (it gives no deltas).
        if self._pending is not None:
            delta, self._pending = self._pending, None
            return delta
        while True:
            try:
                event = await self._recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError) as e:
                raise RequestAborted("the engine closed this request") from e
            match event:
                case PromptReady(prompt_ids=ids):
                    self.prompt_ids = ids
                case Failed(error=error):
                    raise error
                case Delta():
                    return event
                case Embedded(vector=vector, num_cached_tokens=cached):
                    self.embedding, self.num_cached_tokens = vector, cached
                    self.finish_reasons[0] = "stop"
                    return None

    async def collect(self) -> list[Choice]:
        """Consume the stream; return each choice's whole output."""
        choices = [Choice(i) for i in range(self.params.n)]
        async for delta in self:
            choices[delta.index].add(delta)
        return choices


def prompt_only(delta: Delta) -> Delta:
    """`delta` of a request with `max_tokens` 0, less the token sampled to end its prefill (the
    scheduler samples one to finish a sequence; the caller asked for none): its prompt
    logprobs, and "length" as its finish (what that token was is not the caller's)."""
    finish = None if delta.finish_reason is None else "length"
    return replace(delta, text="", token_ids=(), logprobs=(), finish_reason=finish, stop_reason=None)
