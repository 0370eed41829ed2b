"""Output assembly: reasoning, text and tool calls as blocks and as OpenAI chat fields."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ft.engine.stream import Choice
from ft.server.generation.assemble import (
    Block,
    BlockAssembler,
    BlockDelta,
    BlockStart,
    BlockStop,
    ChatAssembler,
    OutputFormat,
    assemble_blocks,
)
from ft.server.generation.tools import add_system_instruction, function_tool, tool_call_parser_name

HERMES_THINK = OutputFormat("hermes", "think")
HERMES = OutputFormat("hermes")
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
OUTPUT = "<think>\nThe user wants weather.\n</think>\n\nLet me check. " + CALL + "\n" + CALL


def counter_ids() -> object:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def test_parser_defaults_to_hermes_only_with_tools() -> None:
    """The tool-call parser is hermes by default, and none without tools."""
    assert tool_call_parser_name(None, False) is None
    assert tool_call_parser_name("llama3_json", False) is None
    assert tool_call_parser_name(None, True) == "hermes"
    assert tool_call_parser_name("llama3_json", True) == "llama3_json"


def test_blocks_of_a_whole_output() -> None:
    """A whole output becomes thinking, text and tool-call blocks in order."""
    blocks = assemble_blocks(OUTPUT, HERMES_THINK, id_factory=counter_ids())  # type: ignore[arg-type]
    assert blocks == [
        Block("thinking", text="The user wants weather."),
        Block("text", text="Let me check. "),
        Block("tool_call", call_id="call_0", name="get_weather", arguments='{"city": "Paris"}'),
        Block("tool_call", call_id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
    ]


def test_without_parsers_everything_is_text() -> None:
    """Without parsers the whole output is one text block."""
    blocks = assemble_blocks(OUTPUT, OutputFormat())
    assert blocks == [Block("text", text=OUTPUT)]


def test_block_events_are_well_formed() -> None:
    """Block events nest: each block starts, gets deltas, stops, in index order."""
    asm = BlockAssembler(HERMES_THINK, counter_ids())  # type: ignore[arg-type]
    events = [e for ch in OUTPUT for e in asm.feed(ch)] + asm.finish()
    open_index = None
    for e in events:
        if isinstance(e, BlockStart):
            assert open_index is None
            open_index = e.index
            assert e.block.text == "" and e.block.arguments == ""
        elif isinstance(e, BlockDelta):
            assert e.index == open_index
        elif isinstance(e, BlockStop):
            assert e.index == open_index
            open_index = None
    assert open_index is None
    assert [e.index for e in events if isinstance(e, BlockStart)] == [0, 1, 2, 3]
    text = "".join(e.text for e in events if isinstance(e, BlockDelta) and e.kind == "text")
    assert text == "Let me check. "


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(OUTPUT)), max_size=12))
def test_blocks_do_not_depend_on_how_output_is_split(cuts: list[int]) -> None:
    """However the output is split, the blocks are the same."""
    bounds = [0, *sorted(cuts), len(OUTPUT)]
    asm = BlockAssembler(HERMES_THINK, counter_ids())  # type: ignore[arg-type]
    deltas: dict[int, str] = {}
    for a, b in itertools.pairwise(bounds):
        for e in asm.feed(OUTPUT[a:b]):
            if isinstance(e, BlockDelta):
                deltas[e.index] = deltas.get(e.index, "") + e.text
    for e in asm.finish():
        if isinstance(e, BlockDelta):
            deltas[e.index] = deltas.get(e.index, "") + e.text
    whole = assemble_blocks(OUTPUT, HERMES_THINK, id_factory=counter_ids())  # type: ignore[arg-type]
    assert asm.blocks == whole
    # the deltas add up to each block's text or arguments
    assert [deltas[i] for i in range(len(whole))] == [b.text or b.arguments for b in whole]


def test_chat_message_with_tool_calls_and_reasoning() -> None:
    """A chat message carries reasoning_content, content and tool_calls, finishing with tool_calls."""
    asm = ChatAssembler(HERMES_THINK)
    message, reason = asm.message(Choice(0, text=OUTPUT, finish_reason="stop"))
    assert reason == "tool_calls"
    assert message["content"] == "Let me check. "
    assert message["reasoning_content"] == "The user wants weather."
    calls = message["tool_calls"]
    assert len(calls) == 2 and calls[0]["id"] != calls[1]["id"]
    assert calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "index" not in calls[0]


def test_chat_message_with_only_a_call_has_null_content() -> None:
    """A chat message with only a call has null content."""
    message, reason = ChatAssembler(HERMES).message(Choice(0, text=CALL, finish_reason="stop"))
    assert message["content"] is None and reason == "tool_calls"
    plain, reason = ChatAssembler(HERMES).message(Choice(0, text="hi", finish_reason="length"))
    assert plain == {"role": "assistant", "content": "hi"} and reason == "length"


def test_chat_deltas_stream_tool_calls_with_index() -> None:
    """Streamed chat deltas carry each tool call with its index."""
    asm = ChatAssembler(HERMES_THINK)
    deltas = [d for ch in OUTPUT if (d := asm.delta(ch)) is not None]
    rest, reason = asm.finish("stop")
    if rest:
        deltas.append(rest)
    assert reason == "tool_calls"
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert reasoning == "The user wants weather." and content == "Let me check. "
    assert [c["index"] for c in calls] == [0, 1]
    assert all(json.loads(c["function"]["arguments"]) == {"city": "Paris"} for c in calls)


def test_function_tool_and_system_instruction() -> None:
    """Tool definitions get OpenAI's function shape; the instruction joins the system message."""
    assert function_tool("f", None, None) == {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
    assert add_system_instruction([{"role": "user", "content": "hi"}], "X") == [
        {"role": "system", "content": "X"},
        {"role": "user", "content": "hi"},
    ]
    assert add_system_instruction([{"role": "system", "content": "S"}], "X") == [
        {"role": "system", "content": "S\n\nX"}
    ]


CUT = "Let me check. " + CALL + "\n" + CALL[: len(CALL) // 2]  # the second call cut by max_tokens


def test_a_call_cut_by_max_tokens_is_dropped_from_every_shape() -> None:
    """Cut by max_tokens, a call's fragment is never text: chat message and deltas, blocks;
    the complete call before it stays, and the finish reason stays `length`."""
    message, reason = ChatAssembler(HERMES).message(Choice(0, text=CUT, finish_reason="length"))
    assert reason == "length"
    assert message["content"] == "Let me check. " and len(message["tool_calls"]) == 1
    asm = ChatAssembler(HERMES)
    deltas = [d for ch in CUT if (d := asm.delta(ch)) is not None]
    rest, reason = asm.finish("length")
    deltas += [rest] if rest else []
    assert reason == "length"
    assert "".join(d.get("content", "") for d in deltas) == "Let me check. "
    assert len([c for d in deltas for c in d.get("tool_calls", [])]) == 1
    blocks = assemble_blocks(CUT, HERMES, is_cut=True)
    assert [b.kind for b in blocks] == ["text", "tool_call"]
    assert "<tool_call>" not in blocks[0].text
