"""Pydantic models of the OpenAI Responses request body (`POST /v1/responses`).

Strict types and engine-representable bounds; unknown fields are ignored (`metadata`,
`reasoning`, `truncation`, `include`, `service_tier`, …). `top_k` is accepted as an extension.
Lone surrogates and integers past 64 bits were already refused by `ft.server.edge.body.parse_json`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from ft.server.openai.schemas import (
    MAX_MESSAGES,
    MAX_NAME_LEN,
    MAX_TOOLS,
    JsonSchema,
    MaxTokens,
    Name,
    StrictModel,
    Temperature,
    TopK,
    TopP,
    text_of_parts,
)


class MessageItem(StrictModel):
    """A message input item; `content` is normalized to a string."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return text_of_parts(value) if isinstance(value, list) else value


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
    output: str

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, value: Any) -> Any:
        return text_of_parts(value) if isinstance(value, list) else value


class ReasoningItem(StrictModel):
    """A reasoning item from a previous response; replayed as nothing (ft keeps no state)."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message=(
            "input items must be objects of type message, function_call, function_call_output or reasoning"
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


class FunctionChoice(StrictModel):
    """`{"type": "function", "name"}`: call this function."""

    type: Literal["function"]
    name: Name


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
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
