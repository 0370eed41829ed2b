"""Turning a choice's streamed text into reasoning, answer text and tool calls, for every API.

What to parse is one record, `OutputFormat`: the tool-call format with the tools whose schemas
type its values, and the reasoning format, begun inside the block when the prompt left it open.
Two layers, both synchronous:

- `OutputAssembler` chains the reasoning parser (`<think>…</think>` or Gemma 4's channel, when
  configured) and the
  tool-call parser (when the request has tools) into one stream of events: `ReasoningDelta`,
  `TextDelta`, `ToolCallStart`, `ToolCallArgsDelta`, `ToolCallEnd`.
- `BlockAssembler` groups those events into *blocks* — a thinking block, a text block, one block
  per tool call — with start / delta / stop events. Anthropic content blocks and Responses
  output items are both such blocks, so `/v1/messages` and `/v1/responses` translate block
  events one to one, and their non-streamed bodies are built by feeding the whole text through
  the same assembler (streamed and non-streamed output cannot disagree).

`ChatAssembler` shapes chat completions (`message`, `delta`,
`finish`) for the chat completions route: `delta.tool_calls`, the reasoning under both its
names (`reasoning_content`, which the AI SDK and opencode read, and `reasoning`, vLLM's newer
name), and finish reason `tool_calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ft.core.reasoning import ContentDelta, ReasoningDelta, make_reasoning_parser
from ft.core.toolcall_events import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, new_tool_call_id
from ft.core.toolcalls import make_tool_call_parser
from ft.engine.stream import Choice
from ft.prompt import Message

OutputEvent = ReasoningDelta | TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """How a choice's text is read back.

    `tool_call_parser` (None: the request offers no tools) with `tools`, the definitions whose
    parameter schemas type the values of a format that writes them as text (`qwen3_coder`);
    `reasoning_parser` (None: no reasoning block), begun inside the block when
    `opens_in_reasoning` (the prompt ended with an open block, `<think>`, so the model's output
    starts in its reasoning and only writes its close, `</think>`).
    """

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tools: Sequence[Message] = ()
    opens_in_reasoning: bool = False


class OutputAssembler:
    """Reasoning parser, then tool-call parser on the answer part; events in output order."""

    def __init__(self, output: OutputFormat, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._reasoning = make_reasoning_parser(
            output.reasoning_parser, starts_in_reasoning=True if output.opens_in_reasoning else None
        )
        self._tools = make_tool_call_parser(
            output.tool_call_parser, id_factory=id_factory, tools=output.tools
        )

    @property
    def has_tool_calls(self) -> bool:
        """True once any tool call has been parsed."""
        return self._tools.has_tool_calls

    def feed(self, text: str) -> list[OutputEvent]:
        """Consume a text delta; return what it completes."""
        return self._route(self._reasoning.feed(text), finish=False)

    def finish(self, *, is_cut: bool = False) -> list[OutputEvent]:
        """End of output: flush everything held back (a tool call the cut, `is_cut`, left
        unfinished is dropped, never text)."""
        return self._route(self._reasoning.finish(), finish=True, is_cut=is_cut)

    def _route(
        self, events: list[ReasoningDelta | ContentDelta], *, finish: bool, is_cut: bool = False
    ) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out.append(event)
            else:
                out.extend(self._tools.feed(event.text))
        if finish:
            out.extend(self._tools.finish(is_cut=is_cut))
        return out


BlockKind = Literal["thinking", "text", "tool_call"]


@dataclass(slots=True)
class Block:
    """One output block: thinking or text (in `text`), or a tool call (`call_id`, `name`,
    `arguments`, the JSON arguments string)."""

    kind: BlockKind
    text: str = ""
    call_id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class BlockStart:
    """Block `index` opens (empty: its text / arguments come in `BlockDelta`s)."""

    index: int
    block: Block


@dataclass(frozen=True, slots=True)
class BlockDelta:
    """More text (thinking, text) or arguments JSON (tool_call) for block `index`."""

    index: int
    kind: BlockKind
    text: str


@dataclass(frozen=True, slots=True)
class BlockStop:
    """Block `index` is complete; `block` holds all of it."""

    index: int
    block: Block


BlockEvent = BlockStart | BlockDelta | BlockStop


@dataclass
class BlockAssembler:
    """Groups a choice's output events into blocks; `blocks` holds every block so far."""

    output: OutputFormat
    id_factory: Callable[[], str] = new_tool_call_id
    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _output: OutputAssembler = field(init=False)

    def __post_init__(self) -> None:
        self._output = OutputAssembler(self.output, self.id_factory)

    @property
    def has_tool_calls(self) -> bool:
        """True once any tool call has been parsed."""
        return self._output.has_tool_calls

    def feed(self, text: str) -> list[BlockEvent]:
        """Consume a text delta; return the block events it completes."""
        return self._group(self._output.feed(text))

    def finish(self, *, is_cut: bool = False) -> list[BlockEvent]:
        """End of output: flush, and close the open block (`is_cut`: cut by `max_tokens`)."""
        out = self._group(self._output.finish(is_cut=is_cut))
        self._close(out)
        return out

    def _group(self, events: list[OutputEvent]) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for event in events:
            match event:
                case ReasoningDelta(text=text):
                    self._append("thinking", text, out)
                case TextDelta(text=text):
                    self._append("text", text, out)
                case ToolCallStart(id=call_id, name=name):
                    self._close(out)
                    self._start(Block("tool_call", call_id=call_id, name=name), out)
                case ToolCallArgsDelta(arguments=arguments):
                    assert self._open is not None and self._open.kind == "tool_call"
                    self._open.arguments += arguments
                    out.append(BlockDelta(len(self.blocks) - 1, "tool_call", arguments))
                case ToolCallEnd(arguments=arguments):
                    assert self._open is not None and self._open.kind == "tool_call"
                    self._open.arguments = arguments
                    self._close(out)
        return out

    def _append(self, kind: BlockKind, text: str, out: list[BlockEvent]) -> None:
        if not text:
            return
        if self._open is None or self._open.kind != kind:
            self._close(out)
            self._start(Block(kind), out)
        assert self._open is not None
        self._open.text += text
        out.append(BlockDelta(len(self.blocks) - 1, kind, text))

    def _start(self, block: Block, out: list[BlockEvent]) -> None:
        self.blocks.append(block)
        self._open = block
        # NOTE: the start event carries an empty copy; the block itself keeps growing.
        out.append(
            BlockStart(len(self.blocks) - 1, Block(block.kind, call_id=block.call_id, name=block.name))
        )

    def _close(self, out: list[BlockEvent]) -> None:
        if self._open is not None:
            out.append(BlockStop(len(self.blocks) - 1, self._open))
            self._open = None


def assemble_blocks(
    text: str,
    output: OutputFormat,
    *,
    id_factory: Callable[[], str] = new_tool_call_id,
    is_cut: bool = False,
) -> list[Block]:
    """The blocks of a whole output (what the streamed events add up to); `is_cut`: the output
    was cut short (finish reason `length`)."""
    assembler = BlockAssembler(output, id_factory)
    assembler.feed(text)
    assembler.finish(is_cut=is_cut)
    return assembler.blocks


# --- OpenAI chat completions ---------------------------------------------------------------


def openai_finish_reason(reason: str | None, has_tool_calls: bool = False) -> str | None:
    """The engine's finish reason in OpenAI's vocabulary (`tool_calls` when calls were parsed)."""
    if reason is None:
        return None
    if reason == "stop" and has_tool_calls:
        return "tool_calls"
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


def chat_tool_call(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of an OpenAI `tool_calls` list (streamed deltas carry `index` too)."""
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ChatAssembler:
    """A chat choice's output with tool calls and reasoning split out (OpenAI shapes).

    `message` for a whole choice, `delta` per
    text delta, `finish` at the end. Tool calls stream as one `delta.tool_calls` entry each
    (id, type, name and the complete arguments string), as soon as the call is parsed.
    """

    def __init__(self, output: OutputFormat) -> None:
        self._format = output
        self._output = OutputAssembler(output)

    def message(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a non-streamed choice, and its finish reason."""
        output = OutputAssembler(self._format)
        is_cut = choice.finish_reason == "length"
        fields = self._fields(output.feed(choice.text) + output.finish(is_cut=is_cut))
        calls = fields.get("tool_calls", [])
        message: dict[str, Any] = {
            "role": "assistant",
            "content": fields.get("content", "") or (None if calls else ""),
        }
        if "reasoning_content" in fields:
            message["reasoning_content"] = message["reasoning"] = fields["reasoning_content"]
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return message, openai_finish_reason(choice.finish_reason, output.has_tool_calls)

    def delta(self, text: str) -> dict[str, Any] | None:
        """Delta fields for new text (None: nothing to send yet)."""
        return self._fields(self._output.feed(text)) or None

    def finish(self, reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """Delta fields held back until the end, and the finish reason."""
        fields = self._fields(self._output.finish(is_cut=reason == "length"))
        return fields or None, openai_finish_reason(reason, self._output.has_tool_calls)

    @staticmethod
    def _fields(events: list[OutputEvent]) -> dict[str, Any]:
        content, reasoning = "", ""
        calls: dict[int, dict[str, Any]] = {}
        for event in events:
            match event:
                case ReasoningDelta(text=text):
                    reasoning += text
                case TextDelta(text=text):
                    content += text
                case ToolCallStart(index=index, id=call_id, name=name):
                    calls[index] = chat_tool_call(index, call_id, name, "")
                case ToolCallArgsDelta(index=index, arguments=arguments):
                    calls[index]["function"]["arguments"] += arguments
                case ToolCallEnd():
                    pass
        fields: dict[str, Any] = {}
        if reasoning:  # both spellings: clients read one or the other
            fields["reasoning_content"] = fields["reasoning"] = reasoning
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = [calls[i] for i in sorted(calls)]
        return fields
