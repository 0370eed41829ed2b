"""Pydantic models of the Anthropic Messages request bodies (`/v1/messages`, `count_tokens`).

Strict types and engine-representable bounds, as for the OpenAI routes; unknown fields are
ignored (`service_tier`, `cache_control`, `container`, …). Lone surrogates and integers past
64 bits were already refused, naming the field, by `ft.server.edge.body.parse_json`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ft.params import MAX_STOP_STRINGS
from ft.server.openai.schemas import (
    MAX_MESSAGES,
    MAX_NAME_LEN,
    MAX_TOOLS,
    MEDIA_PART_TYPES,
    JsonSchema,
    MaxTokens,
    Name,
    StopString,
    StrictModel,
    TopP,
)

UnitTemperature = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0, le=1 << 30)]


class TextBlock(StrictModel):
    """`{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: str


class ToolUseBlock(StrictModel):
    """An assistant's tool call: `{"type": "tool_use", "id", "name", "input": {...}}`."""

    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]


class ToolResultBlock(StrictModel):
    """The result of a tool call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Name
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        """The result as one string."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content)


class ThinkingBlock(StrictModel):
    """An assistant's earlier reasoning, replayed."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    """Encrypted reasoning from Anthropic's servers; meaningless here and dropped."""

    type: Literal["redacted_thinking"]
    data: str = ""


class MediaBlock(StrictModel):
    """An image, document or other media block: refused, since the model reads text only."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        raise PydanticCustomError(
            "text_only",
            "this model takes text only; got a '{kind}' block",
            {"kind": value.get("type")},
        )


MEDIA_BLOCK_TYPES = MEDIA_PART_TYPES | {"document", "search_result"}


def _block_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return "media" if kind in MEDIA_BLOCK_TYPES else kind


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[MediaBlock, Tag("media")],
    Discriminator(
        _block_kind,
        custom_error_type="content_block",
        custom_error_message=(
            "content blocks must be objects of type text, tool_use, tool_result or thinking"
        ),
    ),
]


class Message(StrictModel):
    """One conversation turn; `content` (a string or a list of blocks) becomes blocks."""

    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], Field(max_length=MAX_MESSAGES)]

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_text_block(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value


class Tool(StrictModel):
    """A client tool: name, description and JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(StrictModel):
    """`{"type": "auto" | "any" | "tool" | "none", "name"?}`."""

    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(StrictModel):
    """`output_format` (Anthropic's structured outputs): `{"type": "json_schema", "schema"}`."""

    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class Thinking(StrictModel):
    """`{"type": "enabled", "budget_tokens"} | {"type": "disabled"}` (accepted; see docs)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0, le=1 << 30)] | None = None


class PromptFields(StrictModel):
    """What `/v1/messages` and `/v1/messages/count_tokens` share: the prompt and its tools."""

    model: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @property
    def system_text(self) -> str | None:
        """The system prompt as one string."""
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)


class MessagesRequest(PromptFields):
    """`POST /v1/messages`."""

    max_tokens: MaxTokens
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: UnitTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    output_format: OutputFormat | None = None


class CountTokensRequest(PromptFields):
    """`POST /v1/messages/count_tokens`."""
