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

import json
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from ft.errors import FtError, InvalidRequest, Overloaded
from ft.grammar.spec import GrammarSpec
from ft.ids import random_id
from ft.messages import Delta
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.server.anthropic.schemas import CountTokensRequest, MessagesRequest, PromptFields
from ft.server.generation import lifecycle
from ft.server.generation.assemble import (
    Block,
    BlockAssembler,
    BlockDelta,
    BlockEvent,
    BlockStart,
    BlockStop,
    assemble_blocks,
)
from ft.server.generation.context import ServerContext, json_response, read_request
from ft.server.generation.lifecycle import Generated, GenerationApi, Usage, respond
from ft.server.generation.policy import output_policy, template_prompt
from ft.server.generation.sse import sse_error, sse_event
from ft.server.generation.structured import anthropic_output
from ft.server.generation.tools import ToolChoice, function_tool

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
        return await respond(ctx, MessagesCall(ctx, req))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        req = await read_request(ctx, CountTokensRequest)
        ctx.check_model(req.model)
        prompt = template_prompt(messages_prompt(req), tool_choice(req))
        ids = await ctx.engine.tokenize(prompt)
        return json_response({"input_tokens": len(ids)})


# --- request -> engine -----------------------------------------------------------------------


def template_messages(req: PromptFields) -> list[dict[str, Any]]:
    """Anthropic turns as chat-template messages (OpenAI's shape, as templates expect).

    `tool_use` blocks become the assistant's `tool_calls` (arguments as an object, as Hugging
    Face templates expect); each `tool_result` becomes a `tool` message, in block order;
    `thinking` becomes `reasoning_content`.
    """
    out: list[dict[str, Any]] = []
    system = req.system_text
    if system:
        out.append({"role": "system", "content": system})
    for message in req.messages:
        if message.role == "assistant":
            out.append(_assistant_message(message.content))
        else:
            out.extend(_user_messages(message.content))
    return out


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for block in blocks:
        match block.type:
            case "text":
                texts.append(block.text)
            case "thinking":
                thinking.append(block.thinking)
            case "tool_use":
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input},
                    }
                )
            case "tool_result":
                raise InvalidRequest("tool_result blocks belong in user turns", param="messages")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _user_messages(blocks: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in blocks:
        match block.type:
            case "text":
                texts.append(block.text)
            case "tool_result":
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
            case "tool_use" | "thinking":
                raise InvalidRequest(f"{block.type} blocks belong in assistant turns", param="messages")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def tool_choice(req: PromptFields) -> ToolChoice:
    """Anthropic's `tool_choice` as the shared policy record (`any` and `tool` force a call)."""
    if req.tool_choice is None:
        return ToolChoice()
    parallel = not req.tool_choice.disable_parallel_tool_use
    match req.tool_choice.type:
        case "none":
            return ToolChoice("none")
        case "any":
            return ToolChoice("required", parallel=parallel)
        case "tool":
            if req.tool_choice.name is None:
                raise InvalidRequest("tool_choice of type 'tool' needs a name", param="tool_choice.name")
            return ToolChoice("required", req.tool_choice.name, parallel=parallel)
        case _:
            return ToolChoice(parallel=parallel)


def messages_prompt(req: PromptFields) -> PromptSpec:
    """The engine-side prompt of a Messages request: template messages, every tool, kwargs.

    A final assistant turn is a prefill: the model continues it. `tool_choice` is applied by
    the shared policy (`ft.server.generation.policy`): `none` sends no tools.
    """
    tools = [function_tool(t.name, t.description, t.input_schema) for t in req.tools or ()]
    is_prefill = req.messages[-1].role == "assistant"
    return PromptSpec(
        messages=template_messages(req),
        tools=tools or None,
        chat_template_kwargs=(
            {"enable_thinking": req.thinking.type != "disabled"} if req.thinking is not None else {}
        ),
        add_generation_prompt=not is_prefill,
        continue_final_message=is_prefill,
    )


def sampling_params(ctx: ServerContext, req: MessagesRequest, grammar: GrammarSpec | None) -> SamplingParams:
    """Engine sampling params; unset fields take the model's generation defaults."""
    # Anthropic's max_tokens is a ceiling, and agents send far more than a small model's
    # context (Claude Code: 32000). One that reaches the context means "up to the context".
    max_tokens = None if req.max_tokens >= ctx.engine.max_model_len else req.max_tokens
    try:
        return lifecycle.sampling_params(
            ctx,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=max_tokens,
            stop=tuple(req.stop_sequences or ()),
            grammar=grammar,
        )
    except InvalidRequest as e:
        if e.param == "stop":
            e.param = "stop_sequences"
        raise


def usage(u: Usage) -> dict[str, int]:
    """Anthropic's `usage`: `input_tokens` excludes the prompt tokens read from the cache.

    ft writes every prompt page to its prefix cache at no extra cost, so nothing is reported
    as `cache_creation_input_tokens`.
    """
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


# --- engine -> response ----------------------------------------------------------------------


def content_block(block: Block) -> dict[str, Any]:
    """A finished block as an Anthropic content block."""
    match block.kind:
        case "thinking":
            return {"type": "thinking", "thinking": block.text, "signature": ""}
        case "text":
            return {"type": "text", "text": block.text}
        case "tool_call":
            return {
                "type": "tool_use",
                "id": block.call_id,
                "name": block.name,
                "input": json.loads(block.arguments),
            }


def start_block(block: Block) -> dict[str, Any]:
    """The empty block of a `content_block_start` event."""
    match block.kind:
        case "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        case "text":
            return {"type": "text", "text": ""}
        case "tool_call":
            return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}


DELTA_TYPES = {
    "thinking": ("thinking_delta", "thinking"),
    "text": ("text_delta", "text"),
    "tool_call": ("input_json_delta", "partial_json"),
}


def stop_reason(
    finish_reason: str | None, matched: str | int | None, has_tool_calls: bool
) -> tuple[str, str | None]:
    """Anthropic's (`stop_reason`, `stop_sequence`) for how the engine finished."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_tool_calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def new_tool_use_id() -> str:
    """An Anthropic-style tool call id."""
    return random_id("toolu_")


class MessagesCall(GenerationApi):
    """One `/v1/messages` request: its prompt, and Anthropic's shapes."""

    heartbeat = PING

    def __init__(self, ctx: ServerContext, req: MessagesRequest) -> None:
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        policy = output_policy(
            ctx,
            messages_prompt(req),
            tool_choice(req),
            anthropic_output(req.output_format),
            prefill_param="messages",
        )
        self.prompts = [policy.prompt]
        self.tool_call_parser, self.reasoning_parser = policy.tool_call_parser, policy.reasoning_parser
        self.params = sampling_params(ctx, req, policy.grammar)
        self.stream = req.stream
        self.id = random_id("msg_")
        self.model = ctx.engine.model_id  # the model that answers, whatever name was sent
        self.assembler = BlockAssembler(self.tool_call_parser, self.reasoning_parser, new_tool_use_id)
        self.finish: tuple[str | None, str | int | None] = (None, None)

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
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
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
        return [sse_error(err, anthropic_error_body, event="error")]


def block_event(event: BlockEvent) -> bytes:
    """One content block event."""
    match event:
        case BlockStart(index=index, block=block):
            start = {"type": "content_block_start", "index": index, "content_block": start_block(block)}
            return sse_event("content_block_start", start)
        case BlockDelta(index=index, kind=kind, text=text):
            delta_type, key = DELTA_TYPES[kind]
            delta = {"type": "content_block_delta", "index": index, "delta": {"type": delta_type, key: text}}
            return sse_event("content_block_delta", delta)
        case BlockStop(index=index):
            return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
