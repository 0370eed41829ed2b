"""Anthropic Messages API: `POST /v1/messages` (streamed or not) and `/v1/messages/count_tokens`.

Errors under `/v1/messages` leave in Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`); the status is ft's own (overload and loading are 503 with `Retry-After`, not
Anthropic's 529 — the SDK retries both). Auth takes `x-api-key` or `Authorization: Bearer`;
`anthropic-version` and `anthropic-beta` are accepted and ignored.

A streamed response follows Anthropic's event sequence exactly: `message_start`, then per
content block `content_block_start` / `content_block_delta`… / `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`; `ping` while the request is queued or
prefilling; `error` if the request fails after the headers went out. The lifecycle is
`ft.server.generation.lifecycle`'s; this module supplies the prompt and the shapes.

A final assistant turn is a prefill: the model continues it, and the response holds only the
continuation, as Anthropic's does. Usage reports the prefix-cache hits as
`cache_read_input_tokens` (not counted in `input_tokens`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from ft.errors import FtError, Overloaded
from ft.ids import random_id
from ft.messages import Delta
from ft.server.anthropic.format import (
    block_event,
    content_block,
    messages_prompt,
    new_tool_use_id,
    sampling_params,
    stop_reason,
    tool_choice,
    usage,
)
from ft.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from ft.server.edge.auth import current_client
from ft.server.generation.assemble import BlockAssembler, OutputFormat, assemble_blocks
from ft.server.generation.context import ServerContext, json_response, read_request
from ft.server.generation.lifecycle import Generated, GenerationApi, Usage, respond_model
from ft.server.generation.policy import output_policy, template_prompt
from ft.server.generation.sse import sse_error, sse_event
from ft.server.generation.structured import anthropic_output

PATH_PREFIX = "/v1/messages"

# Anthropic's error type for each status ft answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error_body(err: FtError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; the message names the field."""
    if isinstance(err, Overloaded) or err.code == "model_loading":
        kind = "overloaded_error"  # retry soon; a drain's refusals and aborts are api_error
    else:
        kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


PING = sse_event("ping", {"type": "ping"})


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the Messages routes to `app`, and Anthropic's error shape for their paths."""
    ctx.error_formats.append((PATH_PREFIX, anthropic_error_body))

    @app.post("/v1/messages")
    async def messages() -> Response:
        req = await read_request(ctx, MessagesRequest)
        return await respond_model(
            ctx, req.model, lambda view: MessagesCall(view, req), stream=req.stream, shape=MessagesCall
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        req = await read_request(ctx, CountTokensRequest)
        view = await ctx.for_model(req.model)
        prompt = messages_prompt(req, system_turns=view.engine.template_renders_mid_system)
        ids = await view.engine.tokenize(template_prompt(prompt, tool_choice(req)), client=current_client())
        return json_response({"input_tokens": len(ids)})


class MessagesCall(GenerationApi):
    """One `/v1/messages` request: its prompt, and Anthropic's shapes."""

    heartbeat = PING

    def __init__(self, ctx: ServerContext, req: MessagesRequest) -> None:
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        policy = output_policy(
            ctx,
            messages_prompt(req, system_turns=ctx.engine.template_renders_mid_system),
            tool_choice(req),
            anthropic_output(req),
            prefill_param="messages",
        )
        self.prompts = [policy.prompt]
        self.policy = policy
        self.params = sampling_params(ctx, req, policy.grammar)
        self.stream, self.cache_salt = req.stream, req.cache_salt
        self.id = random_id("msg_")
        self.model = ctx.engine.model_id  # the model that answers, whatever name was sent
        self.finish: tuple[str | None, str | int | None] = (None, None)

    @cached_property
    def output_format(self) -> OutputFormat:
        """How the output is read back (asked once the prompt is rendered: its ids known)."""
        return self.policy.output_format(self.ctx, self.prompt_ids[0])

    @cached_property
    def assembler(self) -> BlockAssembler:
        """The streamed output's blocks."""
        return BlockAssembler(self.output_format, new_tool_use_id)

    def message(
        self, content: list[dict[str, Any]], reason: str | None, sequence: str | None, u: Usage
    ) -> dict[str, Any]:
        """The `message` object (empty `content` and no stop reason in `message_start`)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(u),
        }

    def body(self, done: Generated) -> dict[str, Any]:
        """The whole message."""
        (choice,) = done.choices[0]
        blocks = assemble_blocks(
            choice.text,
            self.output_format,
            id_factory=new_tool_use_id,
            is_cut=choice.finish_reason == "length",
        )
        has_calls = self.tool_calls = any(b.kind == "tool_call" for b in blocks)
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, has_calls)
        return self.message([content_block(b) for b in blocks], reason, sequence, done.usage)

    def start(self, u: Usage) -> list[bytes]:
        """`message_start`, as soon as the prompt's size is known."""
        message = self.message([], None, None, u)
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def delta(self, k: int, delta: Delta) -> list[bytes]:
        """Content block events."""
        if delta.finish_reason is not None:
            self.finish = (delta.finish_reason, delta.stop_reason)
        return [block_event(e) for e in self.assembler.feed(delta.text)]

    def end(self, u: Usage) -> list[bytes]:
        """The last block events, `message_delta` (stop reason, usage) and `message_stop`."""
        frames = [block_event(e) for e in self.assembler.finish(is_cut=self.finish[0] == "length")]
        self.tool_calls = self.assembler.has_tool_calls
        reason, sequence = stop_reason(*self.finish, self.tool_calls)
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(u),
        }
        frames.append(sse_event("message_delta", message_delta))
        frames.append(sse_event("message_stop", {"type": "message_stop"}))
        return frames

    def error(self, err: FtError) -> list[bytes]:
        """`event: error`."""
        return self.stream_error(err)

    @classmethod
    def stream_error(cls, err: FtError) -> list[bytes]:
        """`event: error`."""
        return [sse_error(err, anthropic_error_body, event="error")]
