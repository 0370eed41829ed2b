"""Anthropic Messages shapes: a request as the engine's prompt and sampling params, and the
engine's output as content blocks, block events, stop reasons and usage.

`ft.server.anthropic.routes` holds the routes and the per-request `MessagesCall`; this module
is what they translate with.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ft.errors import InvalidRequest
from ft.grammar.spec import GrammarSpec
from ft.ids import random_id
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.server.anthropic.schemas import MessagesRequest, PromptFields, TextBlock
from ft.server.generation import lifecycle
from ft.server.generation.assemble import Block, BlockDelta, BlockEvent, BlockStart, BlockStop
from ft.server.generation.context import ServerContext
from ft.server.generation.lifecycle import Usage
from ft.server.generation.sse import sse_event
from ft.server.generation.tools import ToolChoice, function_tool

# --- request -> engine -----------------------------------------------------------------------


# Request metadata that Claude Code sends as its first system block, shaped as an HTTP header
# (`x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=sdk-cli;`). Anthropic's
# API reads it and leaves it out of the prompt. Its value changes from request to request
# while the agent's long prompt after it does not, so a prompt that began with it would share
# no prefix with the previous turn's: ft leaves it out too. Longer blocks are prompt text.
HEADER_BLOCK = re.compile(r"x-anthropic-[a-z0-9-]+:[^\n]*")
MAX_HEADER_BLOCK_CHARS = 1024


def is_header_block(text: str) -> bool:
    """Whether a system block is request metadata (`x-anthropic-…: …`, one line), not prompt."""
    return len(text) <= MAX_HEADER_BLOCK_CHARS and HEADER_BLOCK.fullmatch(text.strip()) is not None


def system_text(req: PromptFields) -> str:
    """The system prompt as one string, without the header blocks (`is_header_block`)."""
    if req.system is None or isinstance(req.system, str):
        return req.system or ""
    return "\n".join(b.text for b in req.system if not is_header_block(b.text))


def template_messages(req: PromptFields, *, system_turns: bool) -> list[dict[str, Any]]:
    """Anthropic turns as chat-template messages (OpenAI's shape, as templates expect).

    `tool_use` blocks become the assistant's `tool_calls` (arguments as an object, as Hugging
    Face templates expect); each `tool_result` becomes a `tool` message, in block order;
    `thinking` becomes `reasoning_content`.

    `system` turns inside `messages` stay where they are: before the first user or assistant
    turn they join the system prompt; after it, they are system messages when the template
    renders those in place (`system_turns`, probed at load), else their text joins the
    neighbouring user turn (the next one, or the previous one at the end), so that roles
    still alternate as strict templates require.
    """
    out: list[dict[str, Any]] = []
    leading = [system_text(req)]
    folded: set[int] = set()  # indices in `out` of user messages that hold a system turn's text
    for message in req.messages:
        if message.role == "system":
            text = "\n".join(b.text for b in message.content if isinstance(b, TextBlock))
            if not out:
                leading.append(text)
            elif system_turns:
                out.append({"role": "system", "content": text})
            else:
                folded.add(len(out))
                out.append({"role": "user", "content": text})
        elif message.role == "assistant":
            out.append(_assistant_message(message.content))
        else:
            out.extend(_user_messages(message.content))
    system = "\n\n".join(t for t in leading if t)
    joined = _join_folded(out, folded)
    if not system_turns:
        joined = _join_after_tool_results(joined)
    return ([{"role": "system", "content": system}] if system else []) + joined


def _join_folded(messages: list[dict[str, Any]], folded: set[int]) -> list[dict[str, Any]]:
    """`messages` with each run of user messages that holds a folded system turn made one."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        prev = out[-1] if out else None
        joins = i in folded or (i - 1 in folded)
        if joins and prev is not None and prev["role"] == "user" and message["role"] == "user":
            out[-1] = prev | {"content": f"{prev['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out


def _join_after_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with user text that directly follows a tool result appended to that result.

    Strict templates (Mistral's) count an assistant turn with tool calls and its results as no
    turn at all, so user text after a result reads as two user turns in a row: Claude Code sends
    a system reminder (folded into user text here) after its tool results on every turn.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        prev = out[-1] if out else None
        if prev is not None and prev["role"] == "tool" and message["role"] == "user":
            out[-1] = prev | {"content": f"{prev['content']}\n\n{message['content']}"}
        else:
            out.append(message)
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


def messages_prompt(req: PromptFields, *, system_turns: bool) -> PromptSpec:
    """The engine-side prompt of a Messages request: template messages, every tool, kwargs.

    A final assistant turn is a prefill: the model continues it. `tool_choice` is applied by
    the shared policy (`ft.server.generation.policy`): `none` sends no tools. `system_turns`:
    the template renders system messages mid-conversation (`template_messages`).
    """
    tools = [function_tool(t.name, t.description, t.input_schema) for t in req.tools or ()]
    is_prefill = req.messages[-1].role == "assistant"
    return PromptSpec(
        messages=template_messages(req, system_turns=system_turns),
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
            speculative=req.speculative,
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
