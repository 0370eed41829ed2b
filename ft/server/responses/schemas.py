"""Pydantic models of the OpenAI Responses request body (`POST /v1/responses`).

Strict types and engine-representable bounds; unknown fields are ignored (`reasoning`,
`truncation`, `service_tier`, `prompt_cache_key`, …). `top_k` is accepted as an extension.

Every tool type OpenAI defines is accepted: the ones a local model can call (`function`,
`custom`, `local_shell`, and `namespace` groups of them) are kept whole; hosted ones
(`web_search`, `file_search`, `mcp`, …) and types this server does not know are kept as their
`type` alone (their other fields are dropped while parsing, so a huge payload is not held).
`ft.server.responses.tools` decides what the model sees.
Lone surrogates and integers past 64 bits were already refused by `ft.server.edge.body.parse_json`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator

from ft.server.openai.schemas import (
    MAX_MESSAGES,
    MAX_NAME_LEN,
    MAX_TOOLS,
    CacheSalt,
    JsonSchema,
    MaxTokens,
    Name,
    StrictModel,
    Temperature,
    TopK,
    TopP,
    text_of_parts,
)


def _parts_as_text(value: Any) -> Any:
    return text_of_parts(value) if isinstance(value, list) else value


# A string, or a list of content parts joined into one (message content, tool outputs).
PartsText = Annotated[str, BeforeValidator(_parts_as_text)]

MAX_GRAMMAR_LEN = 64 * 1024  # a custom tool's grammar: Codex's apply_patch grammar is ~2 KiB
MAX_ENCRYPTED_LEN = 1 << 20
MAX_ARGV = 4096
MAX_COMMAND_LEN = 128 * 1024
# `metadata` as OpenAI bounds it: at most 16 string pairs, keys to 64 and values to 512 chars.
# A stored response keeps it, so unbounded it let one request fill the store (a 4 MiB body
# of metadata per response: 16 requests evicted every other client's stored responses).
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512


class MessageItem(StrictModel):
    """A message input item; `content` is normalized to a string."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: PartsText


class FunctionCallItem(StrictModel):
    """A function call the model made earlier (from a previous response's `output`)."""

    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: str


class FunctionCallOutputItem(StrictModel):
    """The client's result for call `call_id`."""

    type: Literal["function_call_output"]
    call_id: Name
    output: PartsText


class CustomToolCallItem(StrictModel):
    """A call of a custom (freeform) tool the model made earlier: its raw `input` string."""

    type: Literal["custom_tool_call"]
    call_id: Name
    name: Name
    input: str


class CustomToolCallOutputItem(StrictModel):
    """The client's result for custom tool call `call_id`."""

    type: Literal["custom_tool_call_output"]
    call_id: Name
    output: PartsText


class LocalShellAction(StrictModel):
    """`{"type": "exec", "command": [...]}`: what a `local_shell_call` runs."""

    type: Literal["exec"] = "exec"
    command: Annotated[list[Annotated[str, Field(max_length=MAX_COMMAND_LEN)]], Field(max_length=MAX_ARGV)]
    timeout_ms: Annotated[int, Field(ge=0, le=2**53)] | None = None
    working_directory: str | None = None


class LocalShellCallItem(StrictModel):
    """A `local_shell` call the model made earlier."""

    type: Literal["local_shell_call"]
    call_id: Name | None = None
    id: Name | None = None
    action: LocalShellAction

    @property
    def the_call_id(self) -> str:
        """`call_id`, or `id` where a client sent only that."""
        return self.call_id or self.id or ""


class LocalShellCallOutputItem(StrictModel):
    """The client's result for a `local_shell_call` (`id` is the call's id, as OpenAI spells it)."""

    type: Literal["local_shell_call_output"]
    call_id: Name | None = None
    id: Name | None = None
    output: str

    @property
    def the_call_id(self) -> str:
        """`call_id`, or `id` as OpenAI spells it."""
        return self.call_id or self.id or ""

    @model_validator(mode="after")
    def _has_call_id(self) -> LocalShellCallOutputItem:
        if not (self.call_id or self.id):
            raise ValueError("a local_shell_call_output needs the call's id (in 'id' or 'call_id')")
        return self


class ReasoningItem(StrictModel):
    """A reasoning item from a previous response (with `encrypted_content` where asked for);
    replayed as nothing, as chat templates drop the reasoning of earlier turns."""

    type: Literal["reasoning"]
    encrypted_content: Annotated[str, Field(max_length=MAX_ENCRYPTED_LEN)] | None = None


class HostedCallItem(StrictModel):
    """An item of a hosted tool (`web_search_call`, `mcp_call`, `compaction`, …) from an earlier
    response; this server cannot replay it, and drops it (its other fields are not kept)."""

    type: str


# Items of hosted tools, and items only OpenAI's own state can replay: accepted and dropped.
HOSTED_ITEM_TYPES = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
        "compaction",
    }
)
INPUT_ITEM_TYPES = frozenset(
    {
        "message",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "local_shell_call",
        "local_shell_call_output",
        "reasoning",
    }
)


def _item_kind(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    if kind in HOSTED_ITEM_TYPES:
        return "hosted"
    return kind if kind in INPUT_ITEM_TYPES else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[LocalShellCallItem, Tag("local_shell_call")]
    | Annotated[LocalShellCallOutputItem, Tag("local_shell_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[HostedCallItem, Tag("hosted")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message=(
            "input items must be objects of type message, function_call(_output), "
            "custom_tool_call(_output), local_shell_call(_output), reasoning, or a hosted tool's item"
        ),
    ),
]


class FunctionTool(StrictModel):
    """`{"type": "function", "name", "description", "parameters", "strict"}`."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomToolFormat(StrictModel):
    """A custom tool's input format: free text, or a `lark` / `regex` grammar `definition`."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: Annotated[str, Field(max_length=MAX_GRAMMAR_LEN)] | None = None


class CustomTool(StrictModel):
    """`{"type": "custom", "name", "description", "format"}`: a tool whose input is one string."""

    type: Literal["custom"]
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]
    description: str | None = None
    format: CustomToolFormat | None = None


class LocalShellTool(StrictModel):
    """`{"type": "local_shell"}`: the model runs commands the client executes."""

    type: Literal["local_shell"]


class HostedTool(StrictModel):
    """A tool OpenAI runs itself (`web_search`, `file_search`, `mcp`, `code_interpreter`, …) or
    one of a type this server does not know: only its `type` is kept."""

    type: Annotated[str, Field(max_length=MAX_NAME_LEN)]


LOCAL_TOOL_TYPES = frozenset({"function", "custom", "local_shell", "namespace"})


def _tool_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in LOCAL_TOOL_TYPES else "hosted"


def _member_kind(value: Any) -> str | None:
    kind = _tool_kind(value)
    return kind if kind in ("function", "custom", None) else "hosted"


NamespaceMember = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(
        _member_kind,
        custom_error_type="tool",
        custom_error_message="a namespace's tools must be objects with a string 'type'",
    ),
]


class NamespaceTool(StrictModel):
    """Codex's `{"type": "namespace", "name", "tools": [...]}`: a group of function and custom
    tools, offered to the model as its members."""

    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]
    description: str | None = None
    tools: Annotated[list[NamespaceMember], Field(max_length=MAX_TOOLS)]


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[LocalShellTool, Tag("local_shell")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(
        _tool_kind,
        custom_error_type="tool",
        custom_error_message="tools must be objects with a string 'type'",
    ),
]


class FunctionChoice(StrictModel):
    """`{"type": "function" | "custom", "name"}`: call this tool."""

    type: Literal["function", "custom"]
    name: Name


class HostedChoice(StrictModel):
    """`{"type": "web_search" | "allowed_tools" | …}`: a choice this server cannot force (a
    hosted tool it does not run); served as `auto`."""

    type: Annotated[str, Field(max_length=MAX_NAME_LEN)]

    @field_validator("type")
    @classmethod
    def _not_named(cls, value: str) -> str:
        if value in ("function", "custom"):
            raise ValueError(f"a tool_choice of type '{value}' needs a 'name'")
        return value


class TextFormat(StrictModel):
    """`text.format`: free text, any JSON object, or JSON valid against `schema`."""

    type: Literal["text", "json_schema", "json_object"]
    name: Name | None = None
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")  # absent: any JSON object
    strict: bool | None = None


class TextConfig(StrictModel):
    """`text`: output format (and verbosity, accepted)."""

    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    """`POST /v1/responses`."""

    model: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | HostedChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    store: bool | None = None
    include: Annotated[list[Annotated[str, Field(max_length=MAX_NAME_LEN)]], Field(max_length=64)] | None = (
        None
    )
    stream: bool = False
    # ft's own, as on the OpenAI routes: false turns speculative decoding off for this request.
    speculative: bool = True
    cache_salt: CacheSalt | None = None  # vLLM's, as on the OpenAI routes
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=MAX_METADATA_KEY_LEN)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE_LEN)],
            ],
            Field(max_length=MAX_METADATA_PAIRS),
        ]
        | None
    ) = None
    user: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
