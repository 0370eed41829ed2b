"""DetokenizerActor: turns sampled tokens into text deltas and routes them to requests."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import assert_never

import trio

from ft.actors.registry import Registry, RequestEntry
from ft.core.detok import SeqDetokenizer
from ft.messages import (
    Delta,
    DetokenizerIn,
    Embedded,
    EmbeddingOut,
    FinishSeq,
    SchedulerIn,
    SeqFailed,
    TokenLogprob,
    TokenOut,
    TopLogprob,
)

DecodeFn = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text

log = logging.getLogger("ft.detokenizer")

CONTEXT_TOKENS = 6  # prompt tokens given to each decoder as left context


class DetokenizerActor:
    """Per-sequence decoders live in the request's registry entry and die with it."""

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[DetokenizerIn],
        scheduler: trio.MemorySendChannel[SchedulerIn],
        registry: Registry,
        decode: DecodeFn,
        on_tokens: Callable[[RequestEntry], None] | None = None,
    ) -> None:
        self.inbox = inbox
        self.scheduler = scheduler
        self.registry = registry
        self.decode = decode
        self.on_tokens = on_tokens  # once per step for each request that got tokens in it

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Route outputs until the inbox closes."""
        task_status.started()
        async for outs in self.inbox:
            routed: dict[int, RequestEntry] = {}
            # A choice's consecutive tokens in one step (accepted drafts) go out as one delta,
            # so the routes stream one chunk for them, not one per token (as vLLM does).
            held: tuple[int, Delta] | None = None  # (uid, delta) not sent yet
            for out in outs:
                if held is not None and not (
                    isinstance(out, TokenOut)
                    and (out.uid, out.index) == (held[0], held[1].index)
                    and held[1].finish_reason is None
                ):
                    self.registry.send_nowait(*held)
                    held = None
                match out:
                    case TokenOut():
                        routed_to = self._route(out)
                        if routed_to is not None:
                            to, delta = routed_to
                            routed[to.uid] = to
                            held = (to.uid, delta if held is None else _joined(held[1], delta))
                    case EmbeddingOut(uid=uid, vector=vector, num_cached_tokens=cached):
                        entry = self.registry.get(uid)
                        if entry is not None:
                            self.registry.note_finished(entry)
                            self.registry.send_nowait(uid, Embedded(vector, cached))
                    case SeqFailed(uid=uid, error=error):
                        self.registry.fail(uid, error)
                    case _:
                        assert_never(out)
            if held is not None:
                self.registry.send_nowait(*held)
            if self.on_tokens is not None:
                for entry in routed.values():
                    self.on_tokens(entry)

    def _decoder(self, entry: RequestEntry, index: int) -> SeqDetokenizer:
        detok = entry.detoks.get(index)
        if detok is None:
            skip = entry.params.skip_special_tokens
            # NOTE: stop strings do not apply under a grammar. It shapes the answer from its
            # first token and ends it where the answer is complete; a stop string matched
            # inside it would cut it and call the cut answer complete (`stop`, invalid JSON).
            stops = () if entry.params.grammar is not None else entry.params.stop
            context = entry.prompt_ids[-CONTEXT_TOKENS:]
            detok = SeqDetokenizer(lambda ids: self.decode(ids, skip), stops, context)
            entry.detoks[index] = detok
        return detok

    def _route(self, out: TokenOut) -> tuple[RequestEntry, Delta] | None:
        """Decode `out` into its request's next delta (None: the request or choice is done)."""
        entry = self.registry.get(out.uid)
        if entry is None:
            return None
        detok = self._decoder(entry, out.index)
        if detok.is_finished:
            return None
        is_last = out.finish_reason is not None
        text, stop = detok.add(out.token_id, is_last=is_last, is_hidden=out.is_hidden)
        finish_reason: str | None = out.finish_reason
        stop_reason: str | int | None = out.stop_reason
        if stop is not None:
            finish_reason, stop_reason = "stop", stop
            if not is_last:
                self.scheduler.send_nowait(FinishSeq(out.seq_id))
        if finish_reason is not None:
            log.debug(
                "uid %d: choice %d finished (%s)", entry.uid, out.index, finish_reason, extra=entry.log_extra
            )
            self.registry.note_finished(entry)
        logprobs: tuple[TokenLogprob, ...] = ()
        if entry.params.logprobs and out.logprob is not None and not out.is_hidden:
            logprobs = (self._logprob(out),)
        delta = Delta(
            index=out.index,
            text=text,
            token_ids=(out.token_id,),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=out.prompt_logprobs,
        )
        return entry, delta

    def _logprob(self, out: TokenOut) -> TokenLogprob:
        assert out.logprob is not None
        top = tuple(TopLogprob(tid, self.decode([tid], False), lp) for tid, lp in out.top_logprobs)
        return TokenLogprob(out.token_id, self.decode([out.token_id], False), out.logprob, top)


def _joined(first: Delta, then: Delta) -> Delta:
    """One delta for two consecutive ones of a choice (`first` has no finish reason)."""
    return Delta(
        index=first.index,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=first.logprobs + then.logprobs,
        finish_reason=then.finish_reason,
        stop_reason=then.stop_reason,
        num_cached_tokens=max(first.num_cached_tokens, then.num_cached_tokens),
        prompt_logprobs=first.prompt_logprobs + then.prompt_logprobs,
    )
