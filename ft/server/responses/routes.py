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
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from ft.errors import FtError, InvalidRequest
from ft.ids import random_id
from ft.messages import Delta
from ft.server.edge.body import parse_arguments
from ft.server.edge.http_errors import HttpError
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
from ft.server.generation.context import ServerContext, read_request
from ft.server.generation.lifecycle import Generated, GenerationApi, Prompt, Usage, respond
from ft.server.generation.sse import sse_event
from ft.server.generation.structured import reasoning_parser_name, responses_output
from ft.server.generation.tools import (
    ToolChoice,
    apply_tool_choice,
    function_tool,
    output_grammar,
    tool_call_parser_name,
)
from ft.server.responses.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
)

ITEM_ID_PREFIXES = {"thinking": "rs_", "text": "msg_", "tool_call": "fc_"}


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the Responses routes to `app`."""

    @app.post("/v1/responses")
    async def create_response() -> Response:
        req = await read_request(ctx, ResponsesRequest)
        return await respond(ctx, ResponseCall(ctx, req))

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


def usage(u: Usage) -> dict[str, Any]:
    """The Responses `usage` object, with the prefix-cache hits in `input_tokens_details`."""
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
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


class ResponseCall(GenerationApi):
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
        choice = req.tool_choice
        parallel = req.parallel_tool_calls is not False
        tool_choice = (
            ToolChoice("required", choice.name, parallel)
            if isinstance(choice, FunctionChoice)
            else ToolChoice(choice or "auto", parallel=parallel)
        )
        tools = [function_tool(t.name, t.description, t.parameters) for t in req.tools or ()]
        messages, sent_tools = apply_tool_choice(template_messages(req), tools, tool_choice)
        self.prompts = [Prompt(messages=messages, tools=sent_tools)]
        config = ctx.engine.config
        self.tool_call_parser = tool_call_parser_name(config.tool_call_parser, sent_tools is not None)
        self.text_format = req.text.format if req.text is not None else None
        answer = responses_output(self.text_format)
        self.params = lifecycle.sampling_params(
            ctx,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_output_tokens,
            grammar=output_grammar(sent_tools, tool_choice, self.tool_call_parser, answer),
        )
        self.reasoning_parser = reasoning_parser_name(config.reasoning_parser, self.params.grammar)
        self.stream = req.stream
        self.id = random_id("resp_", 32)
        self.created = int(time.time())
        self.model = req.model or ctx.engine.model_id
        self.item_ids: dict[int, str] = {}
        self.assembler = BlockAssembler(self.tool_call_parser, self.reasoning_parser)
        self.numbers = itertools.count()
        self.finish_reason: str | None = None

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
        u: Usage | None,
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
            "text": {"format": self.text_format.model_dump(by_alias=True, exclude_none=True)}
            if self.text_format is not None
            else {"format": {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "tools": [t.model_dump() for t in req.tools or ()],
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": usage(u) if u is not None else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def body(self, done: Generated) -> dict[str, Any]:
        """The whole response."""
        (choice,) = done.choices[0]
        blocks = assemble_blocks(
            choice.text,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            is_cut=choice.finish_reason == "length",
        )
        is_incomplete = choice.finish_reason == "length"
        status = "incomplete" if is_incomplete else "completed"
        self.tool_calls = any(b.kind == "tool_call" for b in blocks)
        return self.response(status, self.items(blocks, is_incomplete), done.usage)

    def event(self, kind: str, **fields: Any) -> bytes:
        """One named event with the next `sequence_number`."""
        return sse_event(kind, {"type": kind, "sequence_number": next(self.numbers), **fields})

    def start(self, u: Usage) -> list[bytes]:
        """`response.created` and `response.in_progress`."""
        return [
            self.event("response.created", response=self.response("in_progress", [], None)),
            self.event("response.in_progress", response=self.response("in_progress", [], None)),
        ]

    def delta(self, k: int, delta: Delta) -> list[bytes]:
        """Output item events."""
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return [
            self.event(kind, **fields)
            for block_event in self.assembler.feed(delta.text)
            for kind, fields in self.item_events(block_event, False)
        ]

    def end(self, u: Usage) -> list[bytes]:
        """The last item events, then `response.completed` (or `.incomplete`, cut short)."""
        is_incomplete = self.finish_reason == "length"
        last = len(self.assembler.blocks) - 1
        frames = [
            self.event(kind, **fields)
            for block_event in self.assembler.finish(is_cut=is_incomplete)
            for kind, fields in self.item_events(block_event, is_incomplete and block_event.index == last)
        ]
        self.tool_calls = self.assembler.has_tool_calls
        status = "incomplete" if is_incomplete else "completed"
        items = self.items(self.assembler.blocks, is_incomplete)
        frames.append(self.event(f"response.{status}", response=self.response(status, items, u)))
        return frames

    def error(self, err: FtError) -> list[bytes]:
        """`response.failed`, with the items so far."""
        error = {"code": err.code or err.type, "message": err.message}
        failed = self.response("failed", self.items(self.assembler.blocks, False), None, error=error)
        return [self.event("response.failed", response=failed)]

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
