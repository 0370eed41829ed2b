"""Responses items both ways: input items as chat-template messages, output blocks as items.

Input: messages keep their role (`developer` is `system`); the calls an earlier response made
(`function_call`, `custom_tool_call`, `local_shell_call`) join the assistant turn before them
as its `tool_calls` (arguments as an object, as Hugging Face templates expect), and their
`*_output` items become `tool` messages. Reasoning items and hosted tools' items are dropped:
templates drop the reasoning of earlier turns, and the model cannot replay a hosted call.

Output: each block of the model's output (`ft.server.generation.assemble`) is one item:
`reasoning` (with `encrypted_content` when the request's `include` asks for it: the text,
base64-encoded; ft encrypts nothing, it keeps no key), `message`, or the call item its tool
answers with (`ToolSet.call_item`). `output_messages` turns output items back into messages,
for the store.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from ft.server.edge.body import parse_arguments
from ft.server.generation.assemble import Block
from ft.server.responses.schemas import (
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    HostedCallItem,
    InputItem,
    LocalShellCallItem,
    LocalShellCallOutputItem,
    MessageItem,
    ReasoningItem,
)
from ft.server.responses.tools import LOCAL_SHELL, ToolSet

ENCRYPTED_PREFIX = "ft1:"  # base64 of the reasoning text, not encrypted: see the module docstring


def input_messages(items: str | Sequence[InputItem]) -> list[dict[str, Any]]:
    """A request's `input` as chat-template messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        match item:
            case MessageItem(role=role, content=content):
                out.append({"role": "system" if role == "developer" else role, "content": content})
            case FunctionCallItem(call_id=call_id, name=name, arguments=arguments):
                _add_call(out, call_id, name, parse_arguments(arguments))
            case CustomToolCallItem(call_id=call_id, name=name, input=text):
                _add_call(out, call_id, name, {"input": text})
            case LocalShellCallItem(action=action):
                command = action.model_dump(exclude_none=True, exclude={"type"})
                _add_call(out, item.the_call_id, LOCAL_SHELL, command)
            case (
                FunctionCallOutputItem(call_id=call_id, output=output)
                | CustomToolCallOutputItem(call_id=call_id, output=output)
            ):
                out.append({"role": "tool", "tool_call_id": call_id, "content": output})
            case LocalShellCallOutputItem(output=output):
                out.append({"role": "tool", "tool_call_id": item.the_call_id, "content": output})
            case ReasoningItem() | HostedCallItem():
                pass
    return out


def _add_call(out: list[dict[str, Any]], call_id: str, name: str, arguments: Any) -> None:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def output_item(
    block: Block, item_id: str, status: str, tools: ToolSet, *, include_encrypted: bool = False
) -> dict[str, Any]:
    """A finished block as a Responses output item."""
    match block.kind:
        case "thinking":
            item: dict[str, Any] = {
                "id": item_id,
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}],
                "status": status,
            }
            if include_encrypted:
                item["encrypted_content"] = encrypted_reasoning(block.text)
            return item
        case "text":
            return {
                "id": item_id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [output_text(block.text)],
            }
        case "tool_call":
            return tools.call_item(block.call_id, block.name, block.arguments, item_id, status)


def output_text(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def encrypted_reasoning(text: str) -> str:
    """The opaque `encrypted_content` of a reasoning item (base64 of its text: not a secret)."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8", "surrogatepass")).decode("ascii")


def output_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant turn's chat-template messages."""
    out: list[dict[str, Any]] = []
    for item in items:
        match item["type"]:
            case "message":
                text = "".join(part["text"] for part in item["content"])
                if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                    out[-1]["content"] += text
                else:
                    out.append({"role": "assistant", "content": text})
            case "function_call":
                _add_call(out, item["call_id"], item["name"], parse_arguments(item["arguments"]))
            case "custom_tool_call":
                _add_call(out, item["call_id"], item["name"], {"input": item["input"]})
            case "local_shell_call":
                action = {k: v for k, v in item["action"].items() if k != "type"}
                _add_call(out, item["call_id"], LOCAL_SHELL, action)
    return out
