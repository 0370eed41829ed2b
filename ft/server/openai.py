"""OpenAI routes: `POST /v1/chat/completions` and `POST /v1/completions`, streamed or not.

Each request is validated whole before the engine sees it. A streamed response commits to
200 once admission passes, sends `: connected` before the request reaches the tokenizer, and
does the engine work inside the response generator, so a client that leaves cancels it and the
request scope frees everything it held.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from ft.engine.stream import Choice, RequestStream
from ft.errors import FtError, InvalidRequest
from ft.params import SamplingParams
from ft.server.assemble import ChatAssembler
from ft.server.context import (
    ServerContext,
    json_response,
    json_response_off_loop,
    new_id,
    read_request,
)
from ft.server.http_errors import internal_error
from ft.server.openai_format import (
    CompletionLogprobs,
    chat_logprobs,
    chat_message_for_template,
    check_echo_size,
    finish_reason,
    make_chat_output,
    sampling_params,
    usage,
)
from ft.server.schemas_openai import ChatCompletionRequest, CompletionRequest, PromptItem
from ft.server.sse import CONNECTED, DONE, HEARTBEAT, DeltaMux, sse_data, sse_error, sse_response


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the OpenAI generation routes to `app`."""

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await read_request(ctx, ChatCompletionRequest)
        return await ChatCompletion(ctx, req).respond()

    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await read_request(ctx, CompletionRequest)
        return await TextCompletion(ctx, req).respond()


class ChatCompletion:
    """One chat completion request, from validated body to response."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        fmt = req.response_format
        if fmt is not None and fmt.type != "text":
            raise InvalidRequest(
                f"response_format type '{fmt.type}' is not supported yet (no constrained "
                "decoding); use 'text'",
                param="response_format",
            )
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        self.params = sampling_params(
            ctx,
            req,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0,
        )
        ctx.check_admission()  # after validation: a bad request is a 400 whatever the load
        self.messages = [chat_message_for_template(m) for m in req.messages]
        self.tools = req.tools if req.tools and req.tool_choice != "none" else None
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.model = req.model or ctx.engine.model_id

    def open(self) -> Any:
        """The engine request scope."""
        return self.ctx.engine.open_request(
            messages=self.messages,
            params=self.params,
            tools=self.tools,
            chat_template_kwargs=self.req.chat_template_kwargs,
            add_generation_prompt=self.req.add_generation_prompt,
        )

    async def respond(self) -> Response:
        """The response: an event stream, or the whole completion as JSON."""
        if self.req.stream:
            return sse_response(self.stream())
        async with self.open() as stream:
            choices = await stream.collect()
        if self.params.logprobs:  # n x tokens x top_logprobs entries: build them off the loop
            return await json_response_off_loop(lambda: self.body(choices, stream))
        return json_response(self.body(choices, stream))

    def body(self, choices: list[Choice], stream: RequestStream) -> dict[str, Any]:
        """The non-streamed `chat.completion` object."""
        out = []
        for c in choices:
            message, reason = make_chat_output(self.ctx, self.req).message(c)
            logprobs = chat_logprobs(c.logprobs) if self.params.logprobs else None
            out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": out,
            "usage": usage(stream.num_prompt_tokens, stream.num_completion_tokens),
        }

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        logprobs: Any = None,
        reason: str | None = None,
    ) -> bytes:
        """One `chat.completion.chunk` frame for one choice."""
        return sse_data(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
            }
        )

    async def stream(self) -> AsyncIterator[bytes]:
        """The event stream (see the module docstring for its lifetime)."""
        yield CONNECTED
        outputs: dict[int, ChatAssembler] = {}
        try:
            async with self.open() as stream:
                mux = DeltaMux([stream])
                while not mux.is_done:
                    got = await mux.next(self.ctx.settings.sse_heartbeat_s)
                    if got.is_timeout:
                        yield HEARTBEAT
                    for _, d in got.deltas:
                        out = outputs.get(d.index)
                        if out is None:
                            out = outputs[d.index] = make_chat_output(self.ctx, self.req)
                            yield self.chunk(d.index, {"role": "assistant", "content": ""})
                        fields = out.delta(d.text)
                        lps = chat_logprobs(d.logprobs) if d.logprobs else None
                        if fields is not None or lps is not None:
                            yield self.chunk(d.index, fields or {"content": ""}, logprobs=lps)
                        if d.finish_reason is not None:
                            rest, reason = out.finish(d.finish_reason)
                            yield self.chunk(d.index, rest or {}, reason=reason)
                if self.req.include_usage:
                    yield sse_data(
                        {
                            "id": self.id,
                            "object": "chat.completion.chunk",
                            "created": self.created,
                            "model": self.model,
                            "system_fingerprint": None,
                            "choices": [],
                            "usage": usage(stream.num_prompt_tokens, stream.num_completion_tokens),
                        }
                    )
        except FtError as e:
            yield sse_error(e)
        except Exception as e:  # noqa: BLE001 - reported in-stream, logged
            yield sse_error(internal_error(e))
        yield DONE


class TextCompletion:
    """One text completion request (possibly several prompts, each with `n` choices)."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequest("best_of is not supported (use n)", param="best_of")
        for i, p in enumerate(req.prompt):
            if isinstance(p, list):
                ctx.check_token_ids(p, "prompt" if len(req.prompt) == 1 else f"prompt[{i}]")
        self.params: SamplingParams = sampling_params(
            ctx,
            req,
            max_tokens=req.max_tokens,
            logprobs=req.logprobs is not None,
            top_logprobs=req.logprobs or 0,
        )
        check_echo_size(req, ctx.engine.max_model_len)
        ctx.check_admission()  # after validation: a bad request is a 400 whatever the load
        self.id = new_id("cmpl")
        self.created = int(time.time())
        self.model = req.model or ctx.engine.model_id

    def open(self, prompt: PromptItem) -> Any:
        """The engine request scope for one prompt."""
        if isinstance(prompt, str):
            return self.ctx.engine.open_request(prompt=prompt, params=self.params)
        return self.ctx.engine.open_request(prompt_token_ids=prompt, params=self.params)

    def prompt_text(self, prompt: PromptItem) -> str:
        """The prompt as text (for `echo`)."""
        return prompt if isinstance(prompt, str) else self.ctx.engine.detokenize(prompt)

    async def respond(self) -> Response:
        """The response: an event stream, or the whole completion as JSON."""
        if self.req.stream:
            return sse_response(self.stream())
        prompts = self.req.prompt
        results: list[tuple[list[Choice], tuple[int, ...], int] | None] = [None] * len(prompts)
        errors: list[Exception] = []

        async def run_one(k: int, nursery: trio.Nursery) -> None:
            try:
                async with self.open(prompts[k]) as stream:
                    choices = await stream.collect()
                results[k] = (choices, stream.prompt_ids, stream.num_completion_tokens)
            except Exception as e:  # noqa: BLE001 - the first error answers the request
                errors.append(e)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for k in range(len(prompts)):
                nursery.start_soon(run_one, k, nursery)
        if errors:
            first = errors[0]
            raise first if isinstance(first, FtError) else internal_error(first)
        if self.req.echo or self.params.logprobs:  # as large as the client asks: off the loop
            return await json_response_off_loop(lambda: self.body(results))
        return json_response(self.body(results))

    def body(self, results: list[tuple[list[Choice], tuple[int, ...], int] | None]) -> dict[str, Any]:
        """The non-streamed `text_completion` object (runs in a thread)."""
        prompts = self.req.prompt
        out: list[dict[str, Any]] = []
        num_prompt = num_completion = 0
        for k, result in enumerate(results):
            assert result is not None
            choices, prompt_ids, n_completion = result
            num_prompt += len(prompt_ids)
            num_completion += n_completion
            for c in choices:
                out.append(self.choice_body(k, prompts[k], prompt_ids, c))
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": out,
            "usage": usage(num_prompt, num_completion),
        }

    def choice_body(
        self, k: int, prompt: PromptItem, prompt_ids: tuple[int, ...], c: Choice
    ) -> dict[str, Any]:
        """One non-streamed choice."""
        text, logprobs = c.text, None
        echo = self.prompt_text(prompt) if self.req.echo else ""
        if self.params.logprobs:
            lp = CompletionLogprobs()
            logprobs = (
                lp.add_prompt([])
                if not echo
                else lp.add_prompt([self.ctx.engine.detokenize([t]) for t in prompt_ids])
            )
            logprobs = CompletionLogprobs.merge(logprobs, lp.add(c.logprobs))
        return {
            "index": k * self.params.n + c.index,
            "text": echo + text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(c.finish_reason),
        }

    def chunk(self, index: int, text: str, *, logprobs: Any = None, reason: str | None = None) -> bytes:
        """One streamed `text_completion` frame for one choice."""
        return sse_data(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}],
            }
        )

    async def stream(self) -> AsyncIterator[bytes]:
        """The event stream: every prompt's choices, interleaved as they arrive."""
        yield CONNECTED
        n = self.params.n
        prompts = self.req.prompt
        started: set[int] = set()
        offsets: dict[int, CompletionLogprobs] = {}
        try:
            async with AsyncExitStack() as stack:
                streams = [await stack.enter_async_context(self.open(p)) for p in prompts]
                mux = DeltaMux(streams)
                while not mux.is_done:
                    got = await mux.next(self.ctx.settings.sse_heartbeat_s)
                    if got.is_timeout:
                        yield HEARTBEAT
                    for k, d in got.deltas:
                        index = k * n + d.index
                        text = d.text
                        if index not in started:
                            started.add(index)
                            if self.req.echo:
                                text = self.prompt_text(prompts[k]) + text
                        lps = None
                        if self.params.logprobs:
                            lp = offsets.setdefault(index, CompletionLogprobs())
                            lps = lp.add(d.logprobs)
                        if text or (lps and lps["tokens"]):
                            yield self.chunk(index, text, logprobs=lps)
                        if d.finish_reason is not None:
                            yield self.chunk(index, "", reason=finish_reason(d.finish_reason))
                if self.req.include_usage:
                    yield sse_data(
                        {
                            "id": self.id,
                            "object": "text_completion",
                            "created": self.created,
                            "model": self.model,
                            "choices": [],
                            "usage": usage(
                                sum(s.num_prompt_tokens for s in streams),
                                sum(s.num_completion_tokens for s in streams),
                            ),
                        }
                    )
        except FtError as e:
            yield sse_error(e)
        except Exception as e:  # noqa: BLE001 - reported in-stream, logged
            yield sse_error(internal_error(e))
        yield DONE
