"""Tools in a prompt, for every API: definitions and the `tool_choice` policy.

Each API spells tools and `tool_choice` its own way; it translates them into `function_tool`
definitions and a `ToolChoice`; `apply_tool_choice` decides, once for all of them, what the
chat template sees, and `output_grammar` what the output must follow: a forced choice is a
grammar of calls to the allowed tools, so the model cannot answer otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ft.errors import InvalidRequest
from ft.grammar import spec
from ft.grammar.spec import GrammarSpec

DEFAULT_TOOL_CALL_PARSER = "hermes"


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's `tool_choice` in any API's spelling: `auto`, `none`, `required`, or one tool.

    `name` (with `mode` "required") names the one tool the model must call, exactly once, as
    clients mean it (OpenAI's named function, Anthropic's `tool`); `parallel` (the API's
    `parallel_tool_calls`, or not Anthropic's `disable_parallel_tool_use`) lets an `auto` or
    `required` answer make several calls.
    """

    mode: Literal["auto", "none", "required"] = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def allows_several_calls(self) -> bool:
        """Whether one answer may hold more than one call: never for a named tool."""
        return self.parallel and self.name is None


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool definition as chat templates expect it (OpenAI's function shape)."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def tool_name(tool: dict[str, Any]) -> str | None:
    """The function name of a tool definition in OpenAI's shape (None when it has none)."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def apply_tool_choice(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, choice: ToolChoice
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools the template sees for `choice`.

    `none` sends no tools. For `required` and a named tool the system prompt also gains an
    instruction to call one (or the named one): `output_grammar` forces the call, and the
    instruction helps a small model choose sensible arguments.

    Raises:
        InvalidRequest: `choice` names a tool the request does not define.
    """
    if choice.mode == "none":
        return messages, None
    if choice.name is not None:
        # NOTE: before the check for no tools, so a named choice with none is refused, not ignored.
        if choice.name not in {tool_name(t) for t in tools or ()}:
            raise InvalidRequest(
                f"tool_choice names an unknown tool '{choice.name}'", param="tool_choice.name"
            )
        assert tools is not None
        return add_system_instruction(messages, require_tool_instruction(choice.name)), tools
    if not tools:
        return messages, None
    if choice.mode == "required":
        return add_system_instruction(messages, require_tool_instruction(None)), tools
    return messages, tools


def output_grammar(
    tools: list[dict[str, Any]] | None,
    choice: ToolChoice,
    parser: str | None,
    answer: GrammarSpec | None,
    markers: frozenset[str] = frozenset(),
) -> GrammarSpec | None:
    """What the output must follow, given the tools the template saw and the answer format
    (`markers`: the format's markers the vocabulary holds as tokens).

    A forced choice (`required`: one call or, with `parallel`, several; a named tool: exactly
    one call of it) is a grammar of calls in `parser`'s format to the allowed tools, arguments
    following each tool's parameter schema. With `auto`, a JSON
    `answer` format becomes "calls or that JSON"; any other answer format stands alone.
    """
    if not tools or parser not in spec.TOOL_CALL_FORMATS:
        return answer
    parallel = choice.allows_several_calls
    if choice.mode == "required":
        return spec.tool_calls(tools, name=choice.name, parallel=parallel, parser=parser, markers=markers)
    if answer is not None and answer.kind == "json_schema":
        return spec.tool_calls(
            tools, name=None, parallel=parallel, parser=parser, otherwise=answer, markers=markers
        )
    return answer


def tool_call_parser_name(configured: str | None, has_tools: bool) -> str | None:
    """The tool-call format to parse: none without tools, else the configured one or hermes."""
    if not has_tools:
        return None
    return configured or DEFAULT_TOOL_CALL_PARSER


def require_tool_instruction(name: str | None) -> str:
    """The system-prompt instruction that stands in for a forced tool choice (best effort)."""
    if name is None:
        return "You must respond by calling one or more of the provided tools."
    return f"You must respond by calling the tool `{name}`."


def add_system_instruction(messages: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    """`messages` with `instruction` appended to the system message (one is added if none)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content") or ""
        return [first | {"content": f"{content}\n\n{instruction}" if content else instruction}, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]
