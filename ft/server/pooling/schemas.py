"""Pydantic models of the pooling request bodies: OpenAI's embeddings, Jina/Cohere's rerank,
vLLM's score. Strict types, unknown fields ignored, as the OpenAI schemas are."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ft.server.openai.schemas import CacheSalt, StrictModel, TokenId

# The most inputs one request may embed (OpenAI's limit): a larger batch is a 400 before any work.
MAX_INPUTS = 2048
MAX_TRUNCATE = 1 << 24

TokenIds = list[TokenId]


# -1: the model's context; n: keep an input's last n tokens (vLLM's left truncation).
def _not_zero(value: int) -> int:
    if value == 0:
        raise PydanticCustomError("truncate", "truncate_prompt_tokens must be -1 or at least 1")
    return value


Truncate = Annotated[int, Field(ge=-1, le=MAX_TRUNCATE), AfterValidator(_not_zero)]


def check_texts(value: str | list[str] | list[int] | list[list[int]], what: str) -> None:
    """Refuse an empty input (no text, no ids, an empty list) or more than `MAX_INPUTS`."""
    if isinstance(value, str) or not value or isinstance(value[0], int):
        if not value:
            raise PydanticCustomError("empty_input", "{what} must not be empty", {"what": what})
        return
    if len(value) > MAX_INPUTS:
        raise PydanticCustomError(
            "too_many_inputs",
            "at most {limit} inputs in one request, got {n}",
            {"limit": MAX_INPUTS, "n": len(value)},
        )
    for i, item in enumerate(value):
        if not item:
            raise PydanticCustomError("empty_input", "{what} {i} is empty", {"what": what, "i": i})


class EmbeddingRequest(StrictModel):
    """`POST /v1/embeddings`: `input` a string, strings, token ids or lists of token ids."""

    input: str | list[str] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # accepted and ignored, as a local server has no users to track
    truncate_prompt_tokens: Truncate | None = None
    cache_salt: CacheSalt | None = None  # as on the generation routes: pooling fills the cache too

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[str] | list[int] | list[list[int]]) -> object:
        check_texts(value, "input")
        return value


class Document(StrictModel):
    """A rerank document given as an object (Cohere, Jina): its `text`."""

    text: str


class RerankRequest(StrictModel):
    """`POST /v1/rerank`: `documents` (strings or `{"text"}` objects) ranked against `query`."""

    query: str
    documents: list[str | Document]
    model: str | None = None
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: Truncate | None = None
    cache_salt: CacheSalt | None = None

    @field_validator("query")
    @classmethod
    def _query_not_empty(cls, value: str) -> str:
        check_texts(value, "query")
        return value

    @field_validator("documents")
    @classmethod
    def _documents_not_empty(cls, value: list[str | Document]) -> list[str | Document]:
        texts = [d if isinstance(d, str) else d.text for d in value]
        check_texts(texts, "document")
        if len(texts) + 1 > MAX_INPUTS:
            raise PydanticCustomError("too_many_inputs", "at most {n} documents", {"n": MAX_INPUTS - 1})
        return value


class ScoreRequest(StrictModel):
    """`POST /v1/score` (vLLM): `text_1` against `text_2`, one to many or pairwise."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: Truncate | None = None
    cache_salt: CacheSalt | None = None

    @field_validator("text_1", "text_2")
    @classmethod
    def _not_empty(cls, value: str | list[str], info: ValidationInfo) -> str | list[str]:
        check_texts(value, str(info.field_name))
        return value
