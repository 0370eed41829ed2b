"""OpenAI Responses API: `POST /v1/responses`, streamed or not; ft keeps no responses.

`previous_response_id` and `store: true` are refused with a 400 (send the whole conversation as
`input` instead), and `GET`/`DELETE /v1/responses/{id}` answer 404. Errors are in OpenAI's shape.

A streamed response is a sequence of named events, each with a monotonic `sequence_number`:
`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
its content events (`response.content_part.added`, `response.output_text.delta`…,
`response.output_text.done`, `response.content_part.done`; or
`response.function_call_arguments.delta`… / `.done`; or `response.reasoning_text.*`),
`response.output_item.done`; and last `response.completed` — or `response.incomplete` when
`max_output_tokens` cut the output short, as OpenAI does — or `response.failed` on an error
after the headers went out. `: heartbeat` comments keep the stream alive while queued or
prefilling.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from ft.errors import FtError, InvalidRequest
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
from ft.server.body import parse_arguments
from ft.server.context import ServerContext, json_response, read_request
from ft.server.http_errors import HttpError, internal_error
from ft.server.schemas_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
)
from ft.server.sse import CONNECTED, HEARTBEAT, DeltaMux, sse_event, sse_response

ITEM_ID_PREFIXES = {"thinking": "rs_", "text": "msg_", "tool_call": "fc_"}


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the Responses routes to `app`."""

    @app.post("/v1/responses")
    async def create_response() -> Response:
        req = await read_request(ctx, ResponsesRequest)
        return await ResponseCall(ctx, req).respond()

    @app.route("/v1/responses/<response_id>", methods=["GET", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        raise HttpError(
            404,
            f"no response '{response_id[:64]}': this server keeps no responses (it is "
            "stateless); send the whole conversation as input",
            param="response_id",
            code="not_found",
        )


# --- request -> engine -----------------------------------------------------------------------


def template_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat-template messages.

    Consecutive `function_call` items join the assistant turn before them as its `tool_calls`
    (arguments as an object, as Hugging Face templates expect); `function_call_output` items
    become `tool` messages; reasoning items are dropped.
    """
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for item in req.input:
        match item:
            case MessageItem(role=role, content=content):
                out.append({"role": "system" if role == "developer" else role, "content": content})
            case FunctionCallItem(call_id=call_id, name=name, arguments=arguments):
                call = {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": parse_arguments(arguments)},
                }
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            case FunctionCallOutputItem(call_id=call_id, output=output):
                out.append({"role": "tool", "tool_call_id": call_id, "content": output})
    return out


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The Responses `usage` object."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def output_item(block: Block, item_id: str, status: str) -> dict[str, Any]:
    """A finished block as a Responses output item."""
    match block.kind:
        case "thinking":
            return {
                "id": item_id,
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}],
                "status": status,
            }
        case "text":
            return {
                "id": item_id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [output_text(block.text)],
            }
        case "tool_call":
            return {
                "id": item_id,
                "type": "function_call",
                "call_id": block.call_id,
                "name": block.name,
                "arguments": block.arguments,
                "status": status,
            }


def output_text(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseCall:
    """One `/v1/responses` request, from validated body to response."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest) -> None:
        self.ctx, self.req = ctx, req
        ctx.check_model(req.model)
        if req.previous_response_id is not None:
            raise InvalidRequest(
                "previous_response_id is not supported: this server keeps no responses; send "
                "the whole conversation as input",
                param="previous_response_id",
            )
        if req.store:
            raise InvalidRequest(
                "store: true is not supported: this server keeps no responses; omit store or set it to false",
                param="store",
            )
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type != "text":
            raise InvalidRequest(
                f"text.format type '{fmt.type}' is not supported yet (no constrained decoding); use 'text'",
                param="text.format",
            )
        messages = template_messages(req)
        self.tools: list[dict[str, Any]] | None = None
        choice = req.tool_choice
        if req.tools and choice != "none":
            self.tools = [function_tool(t.name, t.description, t.parameters) for t in req.tools]
            if isinstance(choice, FunctionChoice):
                if choice.name not in {t.name for t in req.tools}:
                    raise InvalidRequest(
                        f"tool_choice names an unknown function '{choice.name}'", param="tool_choice.name"
                    )
                messages = add_system_instruction(messages, require_tool_instruction(choice.name))
            elif choice == "required":
                messages = add_system_instruction(messages, require_tool_instruction(None))
        self.messages = messages
        config = ctx.engine.config
        self.tool_call_parser = tool_call_parser_name(config.tool_call_parser, bool(self.tools))
        self.reasoning_parser = config.reasoning_parser
        self.params = self.sampling_params()
        ctx.check_admission()
        self.id = random_id("resp_", 32)
        self.created = int(time.time())
        self.model = req.model or ctx.engine.model_id
        self.item_ids: dict[int, str] = {}

    def sampling_params(self) -> SamplingParams:
        """Engine sampling params; unset fields take the model's generation defaults."""
        req, defaults = self.req, self.ctx.engine.generation_defaults

        def pick(name: str, value: float | None, fallback: float) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            max_tokens=req.max_output_tokens,
            temperature=float(pick("temperature", req.temperature, 1.0)),
            top_p=float(pick("top_p", req.top_p, 1.0)),
            top_k=int(pick("top_k", req.top_k, 0)),
        )

    def open(self) -> Any:
        """The engine request scope."""
        return self.ctx.engine.open_request(messages=self.messages, params=self.params, tools=self.tools)

    def item_id(self, index: int, block: Block) -> str:
        """The id of output item `index` (made on first use)."""
        if index not in self.item_ids:
            self.item_ids[index] = random_id(ITEM_ID_PREFIXES[block.kind], 32)
        return self.item_ids[index]

    def items(self, blocks: list[Block], is_incomplete: bool) -> list[dict[str, Any]]:
        """Every block as an output item; the last is `incomplete` when the output was cut."""
        last = len(blocks) - 1
        return [
            output_item(b, self.item_id(i, b), "incomplete" if is_incomplete and i == last else "completed")
            for i, b in enumerate(blocks)
        ]

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage_: dict[str, Any] | None,
        *,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The `response` object."""
        req = self.req
        choice = req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": self.params.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "tools": [t.model_dump() for t in req.tools or ()],
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": usage_,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    async def respond(self) -> Response:
        """An event stream, or the whole response as JSON."""
        if self.req.stream:
            return sse_response(self.stream())
        async with self.open() as stream:
            (choice,) = await stream.collect()
        blocks = assemble_blocks(
            choice.text,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
        )
        is_incomplete = choice.finish_reason == "length"
        return json_response(
            self.response(
                "incomplete" if is_incomplete else "completed",
                self.items(blocks, is_incomplete),
                usage(stream.num_prompt_tokens, stream.num_completion_tokens),
            )
        )

    async def stream(self) -> AsyncIterator[bytes]:
        """The event stream (see the module docstring)."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            return sse_event(kind, {"type": kind, "sequence_number": next(numbers), **fields})

        yield CONNECTED
        yield event("response.created", response=self.response("in_progress", [], None))
        yield event("response.in_progress", response=self.response("in_progress", [], None))
        assembler = BlockAssembler(self.tool_call_parser, self.reasoning_parser)
        try:
            async with self.open() as stream:
                finish_reason: str | None = None
                mux = DeltaMux([stream])
                while not mux.is_done:
                    got = await mux.next(self.ctx.settings.sse_heartbeat_s)
                    if got.is_timeout:
                        yield HEARTBEAT
                    for _, delta in got.deltas:
                        for block_event in assembler.feed(delta.text):
                            for kind, fields in self.item_events(block_event, False):
                                yield event(kind, **fields)
                        if delta.finish_reason is not None:
                            finish_reason = delta.finish_reason
                is_incomplete = finish_reason == "length"
                for block_event in assembler.finish():
                    is_last = block_event.index == len(assembler.blocks) - 1
                    for kind, fields in self.item_events(block_event, is_incomplete and is_last):
                        yield event(kind, **fields)
                status = "incomplete" if is_incomplete else "completed"
                yield event(
                    f"response.{status}",
                    response=self.response(
                        status,
                        self.items(assembler.blocks, is_incomplete),
                        usage(stream.num_prompt_tokens, stream.num_completion_tokens),
                    ),
                )
        except Exception as e:  # noqa: BLE001 - reported in-stream (and logged if unexpected)
            err = e if isinstance(e, FtError) else internal_error(e)
            error = {"code": err.code or err.type, "message": err.message}
            yield event(
                "response.failed",
                response=self.response("failed", self.items(assembler.blocks, False), None, error=error),
            )

    def item_events(self, event: BlockEvent, is_incomplete: bool) -> list[tuple[str, dict[str, Any]]]:
        """The Responses events for one block event: (event type, fields)."""
        index = event.index
        item_id = self.item_ids.get(index, "")
        where = {"output_index": index}
        match event:
            case BlockStart(block=block):
                item_id = self.item_id(index, block)
                added = output_item(block, item_id, "in_progress")
                if block.kind == "tool_call":
                    return [("response.output_item.added", where | {"item": added})]
                added["content"] = []
                part = output_text("") if block.kind == "text" else {"type": "reasoning_text", "text": ""}
                return [
                    ("response.output_item.added", where | {"item": added}),
                    (
                        "response.content_part.added",
                        where | {"item_id": item_id, "content_index": 0, "part": part},
                    ),
                ]
            case BlockDelta(kind="tool_call", text=text):
                return [
                    ("response.function_call_arguments.delta", where | {"item_id": item_id, "delta": text})
                ]
            case BlockDelta(kind=kind, text=text):
                name = "output_text" if kind == "text" else "reasoning_text"
                extra: dict[str, Any] = {"logprobs": []} if kind == "text" else {}
                return [
                    (
                        f"response.{name}.delta",
                        where | {"item_id": item_id, "content_index": 0, "delta": text} | extra,
                    )
                ]
            case BlockStop(block=block):
                done = output_item(block, item_id, "incomplete" if is_incomplete else "completed")
                if block.kind == "tool_call":
                    return [
                        (
                            "response.function_call_arguments.done",
                            where | {"item_id": item_id, "name": block.name, "arguments": block.arguments},
                        ),
                        ("response.output_item.done", where | {"item": done}),
                    ]
                name = "output_text" if block.kind == "text" else "reasoning_text"
                extra_done: dict[str, Any] = {"logprobs": []} if block.kind == "text" else {}
                in_part = where | {"item_id": item_id, "content_index": 0}
                return [
                    (f"response.{name}.done", in_part | {"text": block.text} | extra_done),
                    ("response.content_part.done", in_part | {"part": done["content"][0]}),
                    ("response.output_item.done", where | {"item": done}),
                ]
        raise AssertionError(event)  # pragma: no cover
