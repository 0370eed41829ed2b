"""Pydantic models of the Anthropic Messages request bodies (`/v1/messages`, `count_tokens`).

Strict types and engine-representable bounds, as for the OpenAI routes; unknown fields are
ignored (`service_tier`, `container`, …). What Claude Code sends is typed and checked, though
ft has no use for some of it: `cache_control` on every block and tool (ft caches every
prompt page anyway), `output_config.effort`, `context_management` (its edits are not
applied: ft keeps what the client sends), `system` turns inside `messages` (beta
`mid-conversation-system-2026-04-07`). Lone surrogates and integers past 64 bits were already
refused, naming the field, by `ft.server.edge.body.parse_json`.
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
    CacheSalt,
    JsonSchema,
    MaxTokens,
    Name,
    StopString,
    StrictModel,
    TopP,
)

UnitTemperature = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0, le=1 << 30)]
MAX_CONTEXT_EDITS = 16


class CacheControl(StrictModel):
    """`cache_control` (a prompt-cache breakpoint): checked, then unused, since ft writes every
    prompt page to its prefix cache and reads any prefix it holds."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    """`{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(StrictModel):
    """An assistant's tool call: `{"type": "tool_use", "id", "name", "input": {...}}`."""

    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictModel):
    """The result of a tool call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Name
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

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
    """One conversation turn; `content` (a string or a list of blocks) becomes blocks.

    A `system` turn (mid-conversation instructions) holds text blocks only.
    """

    role: Literal["user", "assistant", "system"]
    content: Annotated[list[ContentBlock], Field(max_length=MAX_MESSAGES)]

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_text_block(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _system_turns_hold_text(self) -> Message:
        if self.role == "system" and not all(isinstance(b, TextBlock) for b in self.content):
            raise PydanticCustomError("system_text_only", "a system turn holds text blocks only")
        return self


class Tool(StrictModel):
    """A client tool: name, description and JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(StrictModel):
    """`{"type": "auto" | "any" | "tool" | "none", "name"?}`."""

    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(StrictModel):
    """`output_format` (Anthropic's structured outputs): `{"type": "json_schema", "schema"}`."""

    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class OutputConfig(StrictModel):
    """`output_config`: `format` (structured output, the SDK's `messages.parse` sends it here)
    and `effort` (accepted: a local model has one effort; any short name, so a level Anthropic
    adds later is no 400)."""

    format: OutputFormat | None = None
    effort: Annotated[str, Field(min_length=1, max_length=32)] | None = None


class Thinking(StrictModel):
    """`{"type": "enabled", "budget_tokens"} | {"type": "disabled"} | {"type": "adaptive"}`:
    the template's `enable_thinking` (templates without it ignore it); the budget is unused."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0, le=1 << 30)] | None = None


class ContextEdit(StrictModel):
    """One of `context_management.edits` (`clear_tool_uses_…`, `clear_thinking_…`): checked,
    not applied."""

    type: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]


class ContextManagement(StrictModel):
    """`context_management` (accepted; ft does not edit the conversation it is sent)."""

    edits: Annotated[list[ContextEdit], Field(max_length=MAX_CONTEXT_EDITS)] = []


class PromptFields(StrictModel):
    """What `/v1/messages` and `/v1/messages/count_tokens` share: the prompt and its tools."""

    model: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _not_only_system_turns(cls, value: list[Message]) -> list[Message]:
        if all(m.role == "system" for m in value):
            raise PydanticCustomError("no_turns", "messages need a user or assistant turn")
        return value


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
    # ft's own, as on the OpenAI routes: false turns speculative decoding off for this request.
    speculative: bool = True
    cache_salt: CacheSalt | None = None  # vLLM's, as on the OpenAI routes


class CountTokensRequest(PromptFields):
    """`POST /v1/messages/count_tokens`."""
