"""Pydantic models of the OpenAI request bodies: strict types, engine-representable bounds.

Unknown top-level fields are ignored (as OpenAI does); known fields are strictly typed (no
string-to-number coercion) and bounded by what the engine can represent. Free-form objects
(`chat_template_kwargs`, `tools`, `tool_calls`) were already checked for lone surrogates and
64-bit integers by `ft.server.edge.body.parse_json`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ft.config import DEFAULT_ABORT_TIMEOUT_S, DEFAULT_DRAIN_TIMEOUT_S
from ft.errors import InvalidRequest
from ft.params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
)
from ft.prompt import check_cache_salt

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_MESSAGES = 4096
MAX_TOOLS = 256
MAX_PROMPTS = 64
MAX_PROMPT_TOKENS = 1 << 20
MAX_NAME_LEN = 256

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=1 << 30)]
UnitFloat = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(ge=0.01, le=100.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
Name = Annotated[str, Field(max_length=MAX_NAME_LEN)]

# Content part types that carry media this text-only engine cannot read.
MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video", "video_url"}
)


def _str_to_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


StopList = Annotated[list[StopString], BeforeValidator(_str_to_list), Field(max_length=MAX_STOP_STRINGS)]


def _cache_salt(value: str) -> str:
    try:
        return check_cache_salt(value)
    except InvalidRequest as e:
        raise PydanticCustomError("cache_salt", e.message) from None


# vLLM's `cache_salt` (every API that fills the prefix cache takes it): the request's pages are
# reused only by requests of the same tenant and salt (`PromptSpec.cache_partition`).
CacheSalt = Annotated[str, AfterValidator(_cache_salt)]


class StrictModel(BaseModel):
    """Strict types; unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    """`stream_options`."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


JsonSchema = dict[str, Any] | bool


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: `{"name", "schema", "strict"?, "description"?}`."""

    name: Name = "response"
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")  # absent: any JSON object
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """`response_format`: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(
                "response_format", "response_format type 'json_schema' needs 'json_schema'"
            )
        return self


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`."""

    json_: JsonSchema | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def text_of_parts(parts: list[Any]) -> str:
    """The text of a list of content parts; media parts are refused (text-only model)."""
    texts: list[str] = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PydanticCustomError(
                "content_part", "content part {i} must be an object with a string 'type'", {"i": i}
            )
        kind = part["type"]
        if kind in MEDIA_PART_TYPES:
            raise PydanticCustomError(
                "text_only",
                "this model takes text only; content part {i} has type '{kind}'",
                {"i": i, "kind": kind},
            )
        if kind not in ("text", "input_text", "output_text"):
            raise PydanticCustomError(
                "content_part", "content part {i} has unknown type '{kind}'", {"i": i, "kind": kind}
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise PydanticCustomError("content_part", "content part {i} needs a string 'text'", {"i": i})
        texts.append(text)
    return "\n".join(texts)


class ChatMessage(StrictModel):
    """One chat message; `content` is normalized to a string (or None for tool-call turns)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(default=None, validate_default=True)
    name: Name | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for `reasoning_content`; either is read

    @property
    def reasoning_text(self) -> str | None:
        """The reasoning sent back with an assistant turn, under either name."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str | None:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return text_of_parts(value)
        if value is None:
            if info.data.get("role") == "assistant":
                return None
            raise PydanticCustomError("missing", "content is required for this role")
        raise PydanticCustomError("content_type", "content must be a string or a list of content parts")

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, call in enumerate(calls or ()):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise PydanticCustomError(
                    "tool_call", "tool call {i} needs a 'function' with a string 'name'", {"i": i}
                )
            if not isinstance(function.get("arguments", "{}"), (str, dict)):
                raise PydanticCustomError(
                    "tool_call", "tool call {i}: 'arguments' must be a JSON string", {"i": i}
                )
        return calls


class SamplingFields(StrictModel):
    """Sampling fields shared by chat and completions."""

    model: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    max_tokens: MaxTokens | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: UnitFloat | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    seed: Int64 | None = None
    stop: StopList | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # ft's own: false turns speculative decoding off for this request (the output is the same).
    speculative: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    cache_salt: CacheSalt | None = None
    # Structured output: OpenAI's `response_format`, and vLLM's fields (completions too).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise PydanticCustomError(
                    "logit_bias_key", "logit_bias keys must be token ids (decimal strings)"
                )
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` with integer keys."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class FunctionName(StrictModel):
    """`{"name": ...}`."""

    name: Name


class NamedToolChoice(StrictModel):
    """`{"type": "function", "function": {"name"}}`: call this function."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, value: bool, info: ValidationInfo) -> bool:
        messages = info.data.get("messages")
        if value and info.data.get("add_generation_prompt", True):
            raise PydanticCustomError("continue_final_message", "it needs add_generation_prompt: false")
        if value and messages and messages[-1].role != "assistant":
            raise PydanticCustomError(
                "continue_final_message", "it needs a final assistant message to continue"
            )
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or ()):
            function = tool.get("function")
            if tool.get("type", "function") != "function":
                raise PydanticCustomError(
                    "tool",
                    "tool {i} has type '{t}'; only 'function' tools are served",
                    {"i": i, "t": tool.get("type")},
                )
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise PydanticCustomError(
                    "tool", "tool {i} needs a 'function' with a string 'name'", {"i": i}
                )
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or choice in ("none", "auto"):
            return choice
        names = {t["function"]["name"] for t in info.data.get("tools") or ()}
        if choice == "required":
            if not names:
                raise PydanticCustomError("tool_choice", "tool_choice 'required' needs tools")
            return choice
        function = choice.get("function") if isinstance(choice, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PydanticCustomError(
                "tool_choice",
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
            )
        if function["name"] not in names:
            raise PydanticCustomError(
                "tool_choice", "tool_choice names an unknown tool '{name}'", {"name": function["name"][:100]}
            )
        return choice


PromptItem = str | list[int]


def _token_list(value: list[Any], where: str) -> list[int]:
    if not value:
        raise PydanticCustomError("prompt", "{where} is an empty token list", {"where": where})
    if len(value) > MAX_PROMPT_TOKENS:
        raise PydanticCustomError(
            "prompt", "{where} has more than {m} tokens", {"where": where, "m": MAX_PROMPT_TOKENS}
        )
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
            raise PydanticCustomError(
                "prompt", "{where} must hold token ids (non-negative integers)", {"where": where}
            )
    return value


def normalize_prompt(value: Any) -> list[PromptItem]:
    """A completions prompt as a list of prompts, each a string or a token-id list."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise PydanticCustomError(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        )
    if all(isinstance(x, str) for x in value):
        if not all(value):
            raise PydanticCustomError("prompt", "prompt must not be an empty string")
        items: list[PromptItem] = list(value)
    elif all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        items = [_token_list(value, "prompt")]
    elif all(isinstance(x, list) for x in value):
        items = [_token_list(x, f"prompt[{i}]") for i, x in enumerate(value)]
    else:
        raise PydanticCustomError("prompt", "prompt mixes strings, token ids and lists")
    if len(items) > MAX_PROMPTS:
        raise PydanticCustomError("prompt", "prompt holds more than {m} prompts", {"m": MAX_PROMPTS})
    return items


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: Annotated[list[PromptItem], BeforeValidator(normalize_prompt)]
    # 0 generates nothing: with `echo` and `logprobs`, the prompt's own logprobs (lm-eval)
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


class TokenizeRequest(StrictModel):
    """`POST /v1/tokenize`: a prompt, or chat messages rendered by the chat template."""

    model: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    """`POST /v1/detokenize`."""

    model: Annotated[str, Field(max_length=MAX_NAME_LEN)] | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]


class PrepareStopRequest(StrictModel):
    """`POST /v1/admin/prepare-stop`."""

    drain_timeout_s: Annotated[float, Field(ge=0.0, le=60.0)] = DEFAULT_DRAIN_TIMEOUT_S
    abort_timeout_s: Annotated[float, Field(ge=0.0, le=10.0)] = DEFAULT_ABORT_TIMEOUT_S


class ModelActionRequest(StrictModel):
    """`POST /v1/models/load` and `/v1/models/unload` (router mode: `ft.server.models`)."""

    model: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]
