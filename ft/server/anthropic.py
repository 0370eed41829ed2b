"""Anthropic Messages API: `POST /v1/messages` (streamed or not) and `/v1/messages/count_tokens`.

Errors under `/v1/messages` leave in Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`); the status is ft's own (overload and loading are 503 with `Retry-After`, not
Anthropic's 529 — the SDK retries both). Auth takes `x-api-key` or `Authorization: Bearer`;
`anthropic-version` and `anthropic-beta` are accepted and ignored.

A streamed response follows Anthropic's event sequence exactly: `message_start`, then per
content block `content_block_start` / `content_block_delta`… / `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`; `ping` while the request is queued or
prefilling; `error` if the request fails after the headers went out. As on the OpenAI routes,
the engine work runs inside the response generator, so a client that leaves cancels it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from ft.engine.stream import RequestStream
from ft.errors import FtError, InvalidRequest, Overloaded
from ft.params import SamplingParams
from ft.server.assemble import (
    Block,
    BlockAssembler,
    BlockDelta,
    BlockEvent,
    BlockStart,
    BlockStop,
    add_system_instruction,
    assemble_blocks,
    function_tool,
    random_id,
    require_tool_instruction,
    tool_call_parser_name,
)
from ft.server.context import ServerContext, json_response, read_request
from ft.server.http_errors import internal_error
from ft.server.schemas_anthropic import CountTokensRequest, MessagesRequest, PromptFields
from ft.server.sse import CONNECTED, DeltaMux, sse_event, sse_response

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


def sse_anthropic_error(err: FtError) -> bytes:
    """`event: error` with Anthropic's error body; ASCII-escaped, so always valid JSON."""
    text = json.dumps(anthropic_error_body(err), separators=(",", ":"))
    return b"event: error\ndata: " + text.encode("ascii") + b"\n\n"


PING = sse_event("ping", {"type": "ping"})


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the Messages routes to `app`, and Anthropic's error shape for their paths."""
    ctx.error_formats.append((PATH_PREFIX, anthropic_error_body))

    @app.post("/v1/messages")
    async def messages() -> Response:
        req = await read_request(ctx, MessagesRequest)
        return await MessagesCall(ctx, req).respond()

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        req = await read_request(ctx, CountTokensRequest)
        ctx.check_model(req.model)
        ctx.check_admission()
        prompt = Prompt(ctx, req)
        ids = await ctx.engine.tokenize(
            messages=prompt.messages,
            tools=prompt.tools,
            chat_template_kwargs=prompt.chat_template_kwargs,
        )
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


class Prompt:
    """The engine-side prompt of a Messages request: template messages, tools, kwargs.

    `tool_choice` `none` sends no tools; `any` and `tool` are best effort: the tools are sent
    and the system prompt gains an instruction to call one (or the named one), since there is
    no constrained decoding to force it.
    """

    def __init__(self, ctx: ServerContext, req: PromptFields) -> None:
        choice = req.tool_choice
        messages = template_messages(req)
        tools = None
        if req.tools and (choice is None or choice.type != "none"):
            tools = [function_tool(t.name, t.description, t.input_schema) for t in req.tools]
            if choice is not None and choice.type == "tool":
                if choice.name is None:
                    raise InvalidRequest("tool_choice of type 'tool' needs a name", param="tool_choice.name")
                if choice.name not in {t.name for t in req.tools}:
                    raise InvalidRequest(
                        f"tool_choice names an unknown tool '{choice.name}'", param="tool_choice.name"
                    )
                messages = add_system_instruction(messages, require_tool_instruction(choice.name))
            elif choice is not None and choice.type == "any":
                messages = add_system_instruction(messages, require_tool_instruction(None))
        self.messages = messages
        self.tools = tools
        self.chat_template_kwargs: dict[str, Any] | None = None
        if req.thinking is not None:
            self.chat_template_kwargs = {"enable_thinking": req.thinking.type != "disabled"}
        config = ctx.engine.config
        self.tool_call_parser = tool_call_parser_name(config.tool_call_parser, tools is not None)
        self.reasoning_parser = config.reasoning_parser


def sampling_params(ctx: ServerContext, req: MessagesRequest) -> SamplingParams:
    """Engine sampling params; unset fields take the model's generation defaults."""
    defaults = ctx.engine.generation_defaults

    def pick(name: str, value: float | None, fallback: float) -> Any:
        return value if value is not None else defaults.get(name, fallback)

    # Anthropic's max_tokens is a ceiling, and agents send far more than a small model's
    # context (Claude Code: 32000). One that reaches the context means "up to the context".
    max_tokens = None if req.max_tokens >= ctx.engine.max_model_len else req.max_tokens
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(pick("temperature", req.temperature, 1.0)),
            top_p=float(pick("top_p", req.top_p, 1.0)),
            top_k=int(pick("top_k", req.top_k, 0)),
            stop=tuple(req.stop_sequences or ()),
        )
    except InvalidRequest as e:
        if e.param == "stop":
            e.param = "stop_sequences"
        raise


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


class MessagesCall:
    """One `/v1/messages` request, from validated body to response."""

    def __init__(self, ctx: ServerContext, req: MessagesRequest) -> None:
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        self.prompt = Prompt(ctx, req)
        self.params = sampling_params(ctx, req)
        ctx.check_admission()
        self.id = random_id("msg_")
        self.model = req.model or ctx.engine.model_id

    def open(self) -> Any:
        """The engine request scope."""
        return self.ctx.engine.open_request(
            messages=self.prompt.messages,
            params=self.params,
            tools=self.prompt.tools,
            chat_template_kwargs=self.prompt.chat_template_kwargs,
        )

    def assembler(self) -> BlockAssembler:
        """A fresh block assembler for this request's parsers."""
        return BlockAssembler(self.prompt.tool_call_parser, self.prompt.reasoning_parser, new_tool_use_id)

    async def respond(self) -> Response:
        """An event stream, or the whole message as JSON."""
        if self.req.stream:
            return sse_response(self.stream())
        async with self.open() as stream:
            (choice,) = await stream.collect()
        blocks = assemble_blocks(
            choice.text,
            tool_call_parser=self.prompt.tool_call_parser,
            reasoning_parser=self.prompt.reasoning_parser,
            id_factory=new_tool_use_id,
        )
        has_calls = any(b.kind == "tool_call" for b in blocks)
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, has_calls)
        return json_response(self.message([content_block(b) for b in blocks], reason, sequence, stream))

    def message(
        self,
        content: list[dict[str, Any]],
        reason: str | None,
        sequence: str | None,
        stream: RequestStream,
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
            "usage": {
                "input_tokens": stream.num_prompt_tokens,
                "output_tokens": stream.num_completion_tokens,
            },
        }

    async def stream(self) -> AsyncIterator[bytes]:
        """The event stream (see the module docstring)."""
        yield CONNECTED
        heartbeat_s = self.ctx.settings.sse_heartbeat_s
        try:
            async with self.open() as stream:
                while True:  # queued or tokenizing: ping until the prompt's size is known
                    with trio.move_on_after(heartbeat_s) as scope:
                        await stream.wait_prompt()
                    if not scope.cancelled_caught:
                        break
                    yield PING
                yield sse_event(
                    "message_start",
                    {"type": "message_start", "message": self.message([], None, None, stream)},
                )
                assembler = self.assembler()
                finish: tuple[str | None, str | int | None] = (None, None)
                mux = DeltaMux([stream])
                while not mux.is_done:
                    got = await mux.next(heartbeat_s)
                    if got.is_timeout:
                        yield PING
                    for _, delta in got.deltas:
                        for event in assembler.feed(delta.text):
                            yield self.block_event(event)
                        if delta.finish_reason is not None:
                            finish = (delta.finish_reason, delta.stop_reason)
                for event in assembler.finish():
                    yield self.block_event(event)
                reason, sequence = stop_reason(*finish, assembler.has_tool_calls)
                yield sse_event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {
                            "input_tokens": stream.num_prompt_tokens,
                            "output_tokens": stream.num_completion_tokens,
                        },
                    },
                )
                yield sse_event("message_stop", {"type": "message_stop"})
        except FtError as e:
            yield sse_anthropic_error(e)
        except Exception as e:  # noqa: BLE001 - reported in-stream, logged
            yield sse_anthropic_error(internal_error(e))

    @staticmethod
    def block_event(event: BlockEvent) -> bytes:
        """One content block event."""
        match event:
            case BlockStart(index=index, block=block):
                return sse_event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": start_block(block),
                    },
                )
            case BlockDelta(index=index, kind=kind, text=text):
                delta_type, key = DELTA_TYPES[kind]
                return sse_event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": delta_type, key: text},
                    },
                )
            case BlockStop(index=index):
                return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
