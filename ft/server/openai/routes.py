"""OpenAI routes: `POST /v1/chat/completions` and `POST /v1/completions`, streamed or not.

Each class parses its body into prompts and sampling params and renders OpenAI's shapes; the
request's lifecycle (static checks, scopes, heartbeats, in-stream errors) is
`ft.server.generation.lifecycle`'s.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from ft.engine.stream import Choice
from ft.errors import FtError, InvalidRequest
from ft.ids import random_id
from ft.messages import Delta
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.server.generation.assemble import ChatAssembler, OutputFormat, openai_finish_reason
from ft.server.generation.context import ServerContext, read_request
from ft.server.generation.lifecycle import Generated, GenerationApi, Usage, respond_model
from ft.server.generation.policy import output_policy
from ft.server.generation.sse import DONE, sse_data, sse_error
from ft.server.generation.structured import openai_output
from ft.server.generation.tools import ToolChoice
from ft.server.openai.format import (
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    chat_message_for_template,
    check_echo_size,
    prompt_logprobs,
    sampling_params,
    usage,
)
from ft.server.openai.schemas import ChatCompletionRequest, CompletionRequest, PromptItem


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the OpenAI generation routes to `app`."""

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await read_request(ctx, ChatCompletionRequest)
        return await respond_model(
            ctx, req.model, lambda view: ChatCompletion(view, req), stream=req.stream, shape=ChatCompletion
        )

    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await read_request(ctx, CompletionRequest)
        return await respond_model(
            ctx, req.model, lambda view: TextCompletion(view, req), stream=req.stream, shape=TextCompletion
        )


def openai_id(prefix: str) -> str:
    """An OpenAI-style response id: `chatcmpl-…`, `cmpl-…`."""
    return random_id(f"{prefix}-", 32)


def chat_tool_choice(req: ChatCompletionRequest) -> ToolChoice:
    """Chat's `tool_choice` (and `parallel_tool_calls`) as the shared policy record."""
    choice, parallel = req.tool_choice, req.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        return ToolChoice(choice or "auto", parallel=parallel)
    return ToolChoice("required", choice.function.name, parallel)


class OpenAIGeneration(GenerationApi):
    """What chat and completions share: the response object, the usage chunk, `[DONE]`."""

    id: str
    created: int
    model: str
    kind: str  # the `object` of the response and its chunks
    include_usage: bool

    def _object(self, choices: list[dict[str, Any]], kind: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind or self.kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def end(self, u: Usage) -> list[bytes]:
        """The usage chunk when asked for, then `[DONE]`."""
        if not self.include_usage:
            return [DONE]
        return [sse_data(self._object([]) | {"usage": usage(u)}), DONE]

    def error(self, err: FtError) -> list[bytes]:
        """`data: {"error": ...}` then `[DONE]`."""
        return self.stream_error(err)

    @classmethod
    def stream_error(cls, err: FtError) -> list[bytes]:
        """`data: {"error": ...}` then `[DONE]`."""
        return [sse_error(err), DONE]


class ChatCompletion(OpenAIGeneration):
    """One chat completion request: its prompt, and OpenAI's chat shapes."""

    kind = "chat.completion.chunk"

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        prompt = PromptSpec(
            messages=[chat_message_for_template(m) for m in req.messages],
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs or {},
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        self.policy = output_policy(ctx, prompt, chat_tool_choice(req), openai_output(req))
        self.params: SamplingParams = sampling_params(
            ctx,
            req,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0,
            grammar=self.policy.grammar,
        )
        self.prompts = [self.policy.prompt]
        self.stream, self.include_usage = req.stream, req.include_usage
        self.cache_salt = req.cache_salt
        self.is_body_large = self.params.logprobs  # n x tokens x top_logprobs entries
        self.id = openai_id("chatcmpl")
        self.created = int(time.time())
        self.model = ctx.engine.model_id  # the model that answers, whatever name was sent
        self.outputs: dict[int, ChatAssembler] = {}

    def body(self, done: Generated) -> dict[str, Any]:
        """The non-streamed `chat.completion` object."""
        out = []
        for c in done.choices[0]:
            message, reason = self.chat_output().message(c)
            self.tool_calls |= reason == "tool_calls"
            logprobs = chat_logprobs(c.logprobs) if self.params.logprobs else None
            out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return self._object(out, "chat.completion") | {"usage": usage(done.usage)}

    @cached_property
    def output_format(self) -> OutputFormat:
        """How the output is read back (asked once the prompt is rendered: its ids known)."""
        return self.policy.output_format(self.ctx, self.prompt_ids[0])

    def chat_output(self) -> ChatAssembler:
        """The output shaper for one choice: text, tool calls and reasoning, as the policy says."""
        return ChatAssembler(self.output_format)

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        logprobs: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> bytes:
        """One `chat.completion.chunk` frame for one choice."""
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse_data(self._object([choice]))

    def delta(self, k: int, delta: Delta) -> list[bytes]:
        """The role chunk first, then content / tool-call / reasoning deltas, then the finish."""
        frames = []
        out = self.outputs.get(delta.index)
        if out is None:
            out = self.outputs[delta.index] = self.chat_output()
            frames.append(self.chunk(delta.index, {"role": "assistant", "content": ""}))
        fields = out.delta(delta.text)
        lps = chat_logprobs(delta.logprobs) if delta.logprobs else None
        if fields is not None or lps is not None:
            frames.append(self.chunk(delta.index, fields or {"content": ""}, logprobs=lps))
        if delta.finish_reason is not None:
            rest, reason = out.finish(delta.finish_reason)
            self.tool_calls |= reason == "tool_calls"
            frames.append(self.chunk(delta.index, rest or {}, reason=reason))
        return frames


class TextCompletion(OpenAIGeneration):
    """One text completion request (possibly several prompts, each with `n` choices)."""

    kind = "text_completion"

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
        # max_tokens 0 (lm-eval's loglikelihood requests): the prompt echoed, nothing generated.
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest(
                "max_tokens 0 generates nothing: it is accepted with echo (the prompt, and with "
                "logprobs the prompt's logprobs)",
                param="max_tokens",
            )
        self.params = sampling_params(
            ctx,
            req,
            max_tokens=req.max_tokens,
            logprobs=req.logprobs is not None,
            top_logprobs=req.logprobs or 0,
            grammar=None if req.max_tokens == 0 else openai_output(req),  # nothing to constrain
            # echo with logprobs scores the prompt too (vLLM's shape, what lm-eval reads)
            prompt_logprobs=req.logprobs if req.echo else None,
        )
        check_echo_size(req, ctx.engine.max_model_len)
        self.prompts = [
            PromptSpec(text=p) if isinstance(p, str) else PromptSpec(token_ids=p) for p in req.prompt
        ]
        self.stream, self.include_usage = req.stream, req.include_usage
        self.cache_salt = req.cache_salt
        self.is_body_large = req.echo or self.params.logprobs  # as large as the client asks
        self.id = openai_id("cmpl")
        self.created = int(time.time())
        self.model = ctx.engine.model_id  # the model that answers, whatever name was sent
        self.started: set[int] = set()
        self.token_texts = TokenTexts(ctx.engine.detokenize)  # shared by the choices' echoes
        self.offsets: dict[int, CompletionLogprobs] = {}

    def prompt_text(self, prompt: PromptItem) -> str:
        """The prompt as text (for `echo`)."""
        return prompt if isinstance(prompt, str) else self.ctx.engine.detokenize(prompt)

    def body(self, done: Generated) -> dict[str, Any]:
        """The non-streamed `text_completion` object."""
        out = [
            self.choice_body(k, self.req.prompt[k], done.prompt_ids[k], c)
            for k, choices in enumerate(done.choices)
            for c in choices
        ]
        return self._object(out) | {"usage": usage(done.usage)}

    def echo_logprobs(
        self, lp: CompletionLogprobs, prompt_ids: tuple[int, ...], choice: Choice
    ) -> dict[str, Any]:
        """The echoed prompt's logprobs entries: null for its first token, then each one's."""
        text = self.token_texts
        return lp.add_prompt([text(t) for t in prompt_ids], prompt_logprobs(text, choice.prompt_logprobs))

    def choice_body(
        self, k: int, prompt: PromptItem, prompt_ids: tuple[int, ...], c: Choice
    ) -> dict[str, Any]:
        """One non-streamed choice."""
        text, logprobs = c.text, None
        echo = self.prompt_text(prompt) if self.req.echo else ""
        if self.params.logprobs:
            lp = CompletionLogprobs()
            logprobs = self.echo_logprobs(lp, prompt_ids, c) if echo else lp.add_prompt([])
            logprobs = CompletionLogprobs.merge(logprobs, lp.add(c.logprobs))
        return {
            "index": k * self.params.n + c.index,
            "text": echo + text,
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(c.finish_reason),
        }

    def chunk(
        self, index: int, text: str, *, logprobs: dict[str, Any] | None = None, reason: str | None = None
    ) -> bytes:
        """One streamed `text_completion` frame for one choice."""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return sse_data(self._object([choice]))

    def delta(self, k: int, delta: Delta) -> list[bytes]:
        """Every prompt's choices, interleaved as they arrive (prompt `k`'s at `k * n + i`)."""
        frames = []
        index = k * self.params.n + delta.index
        text = delta.text
        is_first = index not in self.started
        if is_first:
            self.started.add(index)
            if self.req.echo:
                text = self.prompt_text(self.req.prompt[k]) + text
        lps = None
        if self.params.logprobs:
            lp = self.offsets.setdefault(index, CompletionLogprobs())
            lps = lp.add_prompt([])
            if is_first and self.req.echo:
                choice = Choice(delta.index, prompt_logprobs=list(delta.prompt_logprobs))
                lps = self.echo_logprobs(lp, self.prompt_ids[k], choice)
            lps = CompletionLogprobs.merge(lps, lp.add(delta.logprobs))
        if text or (lps and lps["tokens"]):
            frames.append(self.chunk(index, text, logprobs=lps))
        if delta.finish_reason is not None:
            frames.append(self.chunk(index, "", reason=openai_finish_reason(delta.finish_reason)))
        return frames
