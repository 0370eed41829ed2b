"""OpenAI Responses API: `POST /v1/responses`, streamed or not, and `GET`/`DELETE
/v1/responses/{id}` of a stored one.

A response is stored unless the request says `store: false` (OpenAI's default), in a bounded
in-memory store of JSON bytes (`ft.server.responses.store`); `previous_response_id` continues a
stored one's conversation, decoded off the loop after the body's parsing. A stored response is
its tenant's (the caller's API key, where several are served): to any other it is not there.
The tools the model is offered, and the item types its calls come back as, are
`ft.server.responses.tools`; input and output items are `ft.server.responses.items`. Errors are
in OpenAI's shape.

A streamed response is a sequence of named events, each with a monotonic `sequence_number`:
`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
its content events (`response.content_part.added`, `response.output_text.delta`…,
`response.output_text.done`, `response.content_part.done`; or
`response.function_call_arguments.delta`… / `.done`; or `response.reasoning_text.*`),
`response.output_item.done` (a custom tool's call streams `response.custom_tool_call_input.*`,
a `local_shell_call` only its added / done items); and last `response.completed` — or
`response.incomplete` when `max_output_tokens` cut the output short, as OpenAI does — or
`response.failed` on an error after the headers went out. `: heartbeat` comments keep the
stream alive while queued or prefilling.
"""

from __future__ import annotations

import itertools
import time
from functools import cached_property
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from ft.errors import FtError, InvalidRequest
from ft.ids import random_id
from ft.messages import Delta
from ft.prompt import PromptSpec
from ft.server.edge.body import run_sized
from ft.server.edge.http_errors import HttpError
from ft.server.edge.tracing import current_record
from ft.server.generation import lifecycle
from ft.server.generation.assemble import (
    Block,
    BlockAssembler,
    BlockDelta,
    BlockEvent,
    BlockStart,
    BlockStop,
    OutputFormat,
)
from ft.server.generation.context import ServerContext, json_response, read_sized_request
from ft.server.generation.lifecycle import Generated, GenerationApi, Usage, respond_model
from ft.server.generation.policy import output_policy
from ft.server.generation.sse import sse_event
from ft.server.generation.structured import responses_output
from ft.server.generation.tools import ToolChoice
from ft.server.responses.items import input_messages, output_item, output_messages, output_text
from ft.server.responses.schemas import FunctionChoice, ResponsesRequest
from ft.server.responses.store import (
    Conversation,
    ResponseStore,
    StoredResponse,
    continue_conversation,
    stored,
)
from ft.server.responses.tools import custom_input, offered_tools

ITEM_ID_PREFIXES = {"thinking": "rs_", "text": "msg_", "tool_call": "fc_"}
CALL_ID_PREFIXES = {"function": "fc_", "custom": "ctc_", "local_shell": "lsh_"}
ENCRYPTED_REASONING = "reasoning.encrypted_content"


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the Responses routes to `app`."""
    settings = ctx.settings
    store = ResponseStore(
        max_entries=settings.response_store_max_entries,
        max_bytes=settings.response_store_bytes,
        max_age_s=settings.response_store_max_age_s,
    )

    @app.post("/v1/responses")
    async def create_response() -> Response:
        req, num_bytes = await read_sized_request(ctx, ResponsesRequest)
        owner = current_record().tenant
        earlier = None
        if req.previous_response_id is not None:
            earlier = store.get(req.previous_response_id, owner=owner)
            if earlier is None:
                raise previous_not_found(req.previous_response_id)
            num_bytes += earlier.num_bytes
        conversation = await run_sized(num_bytes, request_conversation, req, earlier, store.max_entry_bytes)
        return await respond_model(
            ctx,
            req.model,
            lambda view: ResponseCall(view, req, conversation, store, owner),
            stream=req.stream,
            shape=ResponseCall,
        )

    @app.route("/v1/responses/<response_id>", methods=["GET", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        # NOTE: another tenant's response is answered as one never stored, so its id tells
        # nothing (the store finds nothing for another owner).
        owner = current_record().tenant
        if request.method == "DELETE":
            if store.delete(response_id, owner=owner):
                return json_response({"id": response_id, "object": "response", "deleted": True})
        elif (entry := store.get(response_id, owner=owner)) is not None:
            return Response(entry.response, status=200, content_type="application/json")
        raise HttpError(
            404,
            f"no stored response '{response_id[:64]}' (not stored, deleted, evicted from this "
            "server's bounded in-memory store, or stored with another API key)",
            param="response_id",
            code="not_found",
        )


# --- request -> engine -----------------------------------------------------------------------


def previous_not_found(response_id: str) -> InvalidRequest:
    """The 400 for a `previous_response_id` the store does not hold."""
    return InvalidRequest(
        f"previous response '{response_id[:64]}' not found: it was not stored "
        "(store: false), was deleted, was evicted from this server's bounded store, expired, "
        "or was stored with another API key",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def request_conversation(
    req: ResponsesRequest, earlier: StoredResponse | None, max_entry_bytes: int
) -> Conversation:
    """The conversation of `req` (without `instructions`, which OpenAI does not carry over):
    `earlier`'s turns, then its input; encoded to be stored unless it says `store: false`.
    Linear in both (run with the body's parsing, off the loop).

    Raises:
        InvalidRequest: continuing `earlier` makes too long a conversation.
    """
    return continue_conversation(
        earlier, input_messages(req.input), is_stored=req.store is not False, max_entry_bytes=max_entry_bytes
    )


def template_messages(req: ResponsesRequest, conversation: Conversation) -> list[dict[str, Any]]:
    """The chat-template messages of `req`: its `instructions`, then its conversation."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return [*system, *conversation.messages]


def responses_tool_choice(req: ResponsesRequest) -> ToolChoice:
    """The request's `tool_choice` (and `parallel_tool_calls`) as the shared policy record."""
    choice, parallel = req.tool_choice, req.parallel_tool_calls is not False
    if isinstance(choice, FunctionChoice):
        return ToolChoice("required", choice.name, parallel)
    if isinstance(choice, str):
        return ToolChoice(choice, parallel=parallel)
    return ToolChoice("auto", parallel=parallel)  # None, or a hosted tool's choice none can force


def usage(u: Usage) -> dict[str, Any]:
    """The Responses `usage` object, with the prefix-cache hits in `input_tokens_details`."""
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def cut_block(blocks: list[Block], finish_events: list[BlockEvent], is_cut: bool) -> int | None:
    """The index of the item the cut left incomplete: the last block, when the output was cut
    (`is_cut`) while it was open (the final flush, `finish_events`, closed it); else None. A
    block closed before the cut (a tool call whose closing tag came) is complete."""
    last = len(blocks) - 1
    closed_at_cut = any(isinstance(e, BlockStop) and e.index == last for e in finish_events)
    return last if is_cut and closed_at_cut else None


class ResponseCall(GenerationApi):
    """One `/v1/responses` request, from validated body to response, stored as `owner`'s (the
    caller's tenant)."""

    def __init__(
        self,
        ctx: ServerContext,
        req: ResponsesRequest,
        conversation: Conversation,
        store: ResponseStore,
        owner: str | None,
    ) -> None:
        self.ctx, self.req, self.conversation, self.store = ctx, req, conversation, store
        self.owner = owner
        ctx.check_model(req.model)
        self.is_stored = req.store is not False
        # NOTE: a stored response is encoded with its body, off the loop (the conversation is
        # the client's size); `finished` runs in `body` and in `end`.
        self.is_body_large = self.is_stored
        self.include_encrypted = ENCRYPTED_REASONING in (req.include or ())
        self.tools = offered_tools(req.tools)
        prompt = PromptSpec(
            messages=template_messages(req, conversation), tools=self.tools.definitions or None
        )
        self.text_format = req.text.format if req.text is not None else None
        policy = output_policy(ctx, prompt, responses_tool_choice(req), responses_output(self.text_format))
        self.prompts = [policy.prompt]
        self.policy = policy
        self.params = lifecycle.sampling_params(
            ctx,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_output_tokens,
            grammar=policy.grammar,
            speculative=req.speculative,
        )
        self.stream, self.cache_salt = req.stream, req.cache_salt
        self.id = random_id("resp_", 32)
        self.created = int(time.time())
        self.model = ctx.engine.model_id  # the model that answers, whatever name was sent
        self.item_ids: dict[int, str] = {}
        self.numbers = itertools.count()
        self.finish_reason: str | None = None

    @cached_property
    def output_format(self) -> OutputFormat:
        """How the output is read back (asked once the prompt is rendered: its ids known)."""
        return self.policy.output_format(self.ctx, self.prompt_ids[0])

    @cached_property
    def assembler(self) -> BlockAssembler:
        """The streamed output's blocks."""
        return BlockAssembler(self.output_format)

    def item_id(self, index: int, block: Block) -> str:
        """The id of output item `index` (made on first use)."""
        if index not in self.item_ids:
            prefix = (
                CALL_ID_PREFIXES[self.tools.kind_of(block.name)]
                if block.kind == "tool_call"
                else ITEM_ID_PREFIXES[block.kind]
            )
            self.item_ids[index] = random_id(prefix, 32)
        return self.item_ids[index]

    def output_item(self, block: Block, item_id: str, status: str) -> dict[str, Any]:
        """A block as an output item of this request."""
        return output_item(block, item_id, status, self.tools, include_encrypted=self.include_encrypted)

    def items(self, blocks: list[Block], cut: int | None) -> list[dict[str, Any]]:
        """Every block as an output item; block `cut` (see `cut_block`) is `incomplete`."""
        return [
            self.output_item(b, self.item_id(i, b), "incomplete" if i == cut else "completed")
            for i, b in enumerate(blocks)
        ]

    def finished(self, response: dict[str, Any]) -> dict[str, Any]:
        """`response` (completed or incomplete), stored first unless the request said not to
        (`"store": false` when it is too large to keep)."""
        if self.is_stored:
            entry = stored(response, self.conversation, output_messages(response["output"]))
            if entry is None or not self.store.put(self.id, entry, owner=self.owner):
                response["store"] = False
        return response

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
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.is_stored,
            "temperature": self.params.temperature,
            "text": {"format": self.text_format.model_dump(by_alias=True, exclude_none=True)}
            if self.text_format is not None
            else {"format": {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump() if choice else "auto",
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
        is_incomplete = choice.finish_reason == "length"
        # NOTE: fed and finished apart, as `end` sees them, so both mark the same item incomplete.
        assembler = BlockAssembler(self.output_format)
        assembler.feed(choice.text)
        cut = cut_block(assembler.blocks, assembler.finish(is_cut=is_incomplete), is_incomplete)
        status = "incomplete" if is_incomplete else "completed"
        self.tool_calls = any(b.kind == "tool_call" for b in assembler.blocks)
        return self.finished(self.response(status, self.items(assembler.blocks, cut), done.usage))

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
        events = self.assembler.finish(is_cut=is_incomplete)
        cut = cut_block(self.assembler.blocks, events, is_incomplete)
        frames = [
            self.event(kind, **fields)
            for block_event in events
            for kind, fields in self.item_events(block_event, block_event.index == cut)
        ]
        self.tool_calls = self.assembler.has_tool_calls
        status = "incomplete" if is_incomplete else "completed"
        items = self.items(self.assembler.blocks, cut)
        response = self.finished(self.response(status, items, u))
        frames.append(self.event(f"response.{status}", response=response))
        return frames

    def error(self, err: FtError) -> list[bytes]:
        """`response.failed`, with the items so far."""
        error = {"code": err.code or err.type, "message": err.message}
        failed = self.response("failed", self.items(self.assembler.blocks, None), None, error=error)
        return [self.event("response.failed", response=failed)]

    @classmethod
    def stream_error(cls, err: FtError) -> list[bytes]:
        """The Responses stream's `error` event (no response was created yet)."""
        body = {"type": "error", "sequence_number": 0, "code": err.code or err.type, "message": err.message}
        return [sse_event("error", body | {"param": err.param})]

    def item_events(self, event: BlockEvent, is_incomplete: bool) -> list[tuple[str, dict[str, Any]]]:
        """The Responses events for one block event: (event type, fields)."""
        index = event.index
        item_id = self.item_ids.get(index, "")
        where = {"output_index": index}
        match event:
            case BlockStart(block=block):
                item_id = self.item_id(index, block)
                added = self.output_item(block, item_id, "in_progress")
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
                if self.tools.kind_of(self.assembler.blocks[index].name) != "function":
                    return []  # the item's input is not this JSON: it comes whole at the stop
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
                done = self.output_item(block, item_id, "incomplete" if is_incomplete else "completed")
                if block.kind == "tool_call":
                    return self.call_done_events(block, item_id, where, done)
                name = "output_text" if block.kind == "text" else "reasoning_text"
                extra_done: dict[str, Any] = {"logprobs": []} if block.kind == "text" else {}
                in_part = where | {"item_id": item_id, "content_index": 0}
                return [
                    (f"response.{name}.done", in_part | {"text": block.text} | extra_done),
                    ("response.content_part.done", in_part | {"part": done["content"][0]}),
                    ("response.output_item.done", where | {"item": done}),
                ]
        raise AssertionError(event)  # pragma: no cover

    def call_done_events(
        self, block: Block, item_id: str, where: dict[str, Any], done: dict[str, Any]
    ) -> list[tuple[str, dict[str, Any]]]:
        """The events that end a tool call's item, as its tool's kind spells them."""
        match self.tools.kind_of(block.name):
            case "custom":
                text = custom_input(block.arguments)
                in_item = where | {"item_id": item_id}
                return [
                    ("response.custom_tool_call_input.delta", in_item | {"delta": text}),
                    ("response.custom_tool_call_input.done", in_item | {"input": text}),
                    ("response.output_item.done", where | {"item": done}),
                ]
            case "local_shell":
                return [("response.output_item.done", where | {"item": done})]
            case "function":
                return [
                    (
                        "response.function_call_arguments.done",
                        where | {"item_id": item_id, "name": block.name, "arguments": block.arguments},
                    ),
                    ("response.output_item.done", where | {"item": done}),
                ]
