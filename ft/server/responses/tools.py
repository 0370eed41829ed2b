"""Responses tools as the model sees them, and its calls as Responses output items.

OpenAI's Responses API has many tool types; a local model can call three of them: `function`,
`custom` (one free-form `input` string, optionally following a lark or regex grammar) and
`local_shell` (a command the client runs). Codex groups functions in `namespace` tools; their
members are offered as plain functions. Every tool offered becomes one function definition in
the chat template's shape (`ft.server.generation.tools.function_tool`), so the configured
tool-call parser reads its calls like any other; `ToolSet.call_item` turns a parsed call back
into the item type its tool answers with (`function_call`, `custom_tool_call`,
`local_shell_call`). Hosted tools (`web_search`, `file_search`, `mcp`, `code_interpreter`, …)
and unknown types are dropped from the prompt (logged at debug): the model cannot run them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ft.errors import InvalidRequest
from ft.server.generation.tools import function_tool
from ft.server.openai.schemas import MAX_TOOLS
from ft.server.responses.schemas import (
    CustomTool,
    FunctionTool,
    HostedTool,
    LocalShellTool,
    NamespaceTool,
    Tool,
)

log = logging.getLogger(__name__)

LOCAL_SHELL = "local_shell"
LOCAL_SHELL_DESCRIPTION = "Run a command on the user's machine; `command` is its argv."
LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
    },
    "required": ["command"],
}
CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}

ToolKind = Literal["function", "custom", "local_shell"]


@dataclass(frozen=True, slots=True)
class OfferedTool:
    """A tool the model is offered: its kind, and the `namespace` it came in (if any)."""

    kind: ToolKind
    name: str
    namespace: str | None = None


@dataclass(slots=True)
class ToolSet:
    """The tools a request offers the model (`definitions`, for the chat template) by name."""

    definitions: list[dict[str, Any]] = field(default_factory=list)
    by_name: dict[str, OfferedTool] = field(default_factory=dict)
    num_dropped: int = 0

    def add(self, tool: OfferedTool, definition: dict[str, Any]) -> None:
        """Offer `tool`.

        Raises:
            InvalidRequest: two tools share a name, or more than `MAX_TOOLS` are offered.
        """
        if tool.name in self.by_name:
            raise InvalidRequest(f"two tools are named '{tool.name[:64]}'", param="tools")
        if len(self.by_name) >= MAX_TOOLS:
            raise InvalidRequest(
                f"more than {MAX_TOOLS} tools (counting the members of namespace tools)", param="tools"
            )
        self.by_name[tool.name] = tool
        self.definitions.append(definition)

    def call_item(self, call_id: str, name: str, arguments: str, item_id: str, status: str) -> dict[str, Any]:
        """The output item for the model's call of `name` with JSON `arguments`.

        A call of a name no tool has (a small model may invent one) stays a `function_call`.
        """
        tool = self.by_name.get(name)
        kind = tool.kind if tool is not None else "function"
        match kind:
            case "custom":
                return {
                    "id": item_id,
                    "type": "custom_tool_call",
                    "status": status,
                    "call_id": call_id,
                    "name": name,
                    "input": custom_input(arguments),
                }
            case "local_shell":
                return {
                    "id": item_id,
                    "type": "local_shell_call",
                    "status": status,
                    "call_id": call_id,
                    "action": shell_action(arguments),
                }
            case "function":
                item = {
                    "id": item_id,
                    "type": "function_call",
                    "status": status,
                    "call_id": call_id,
                    "name": name,
                    "arguments": arguments,
                }
                if tool is not None and tool.namespace is not None:
                    item["namespace"] = tool.namespace
                return item

    def kind_of(self, name: str) -> ToolKind:
        """The kind of tool `name` (a name no tool has is a function)."""
        tool = self.by_name.get(name)
        return tool.kind if tool is not None else "function"


def offered_tools(tools: Sequence[Tool] | None) -> ToolSet:
    """The tools of a request the model can call, as chat-template definitions.

    Raises:
        InvalidRequest: duplicate names, or more than `MAX_TOOLS` after flattening namespaces.
    """
    offered = ToolSet()
    for tool in tools or ():
        match tool:
            case FunctionTool() | CustomTool():
                _add_callable(offered, tool, None)
            case LocalShellTool():
                offered.add(
                    OfferedTool("local_shell", LOCAL_SHELL),
                    function_tool(LOCAL_SHELL, LOCAL_SHELL_DESCRIPTION, LOCAL_SHELL_PARAMETERS),
                )
            case NamespaceTool(name=namespace, tools=members):
                for member in members:
                    if isinstance(member, HostedTool):
                        _drop(offered, member)
                    else:
                        _add_callable(offered, member, namespace)
            case HostedTool():
                _drop(offered, tool)
    return offered


def _drop(offered: ToolSet, tool: HostedTool) -> None:
    offered.num_dropped += 1
    log.debug("tool of type %r dropped from the prompt: the model cannot run it", tool.type[:64])


def _add_callable(offered: ToolSet, tool: FunctionTool | CustomTool, namespace: str | None) -> None:
    if isinstance(tool, FunctionTool):
        definition = function_tool(tool.name, tool.description, tool.parameters)
        offered.add(OfferedTool("function", tool.name, namespace), definition)
        return
    definition = function_tool(tool.name, custom_description(tool), CUSTOM_PARAMETERS)
    offered.add(OfferedTool("custom", tool.name, namespace), definition)


def custom_description(tool: CustomTool) -> str:
    """A custom tool's description, with its input grammar (the model writes `input` to it)."""
    description = tool.description or ""
    fmt = tool.format
    if fmt is None or fmt.type == "text" or not fmt.definition:
        return description
    note = f"The `input` string must follow this {fmt.syntax or 'lark'} grammar:\n{fmt.definition}"
    return f"{description}\n\n{note}" if description else note


def custom_input(arguments: str) -> str:
    """The `input` string of a custom tool call from its JSON `arguments` (as sent if not JSON)."""
    value = _object(arguments)
    text = value.get("input") if value is not None else None
    return text if isinstance(text, str) else arguments


def shell_action(arguments: str) -> dict[str, Any]:
    """A `local_shell_call`'s `action` from its JSON `arguments`: `{"type": "exec", "command"}`.

    A `command` given as one string becomes `["bash", "-lc", command]`; no command is `[]`.
    """
    value = _object(arguments) or {}
    command = value.get("command")
    if isinstance(command, str):
        command = ["bash", "-lc", command]
    elif not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        command = []
    action: dict[str, Any] = {"type": "exec", "command": command}
    for key in ("working_directory", "timeout_ms"):
        if key in value:
            action[key] = value[key]
    return action


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
