"""Pydantic models of the pooling request bodies: OpenAI's embeddings, Jina/Cohere's rerank,
vLLM's score. Strict types, unknown fields ignored, as the OpenAI schemas are."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ft.server.openai.schemas import StrictModel, TokenId

# The most inputs one request may embed (OpenAI's limit): a larger batch is a 400 before any work.
MAX_INPUTS = 2048
MAX_TRUNCATE = 1 << 24

Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# -1: the model's context; n: keep an input's last n tokens (vLLM's left truncation).
Truncate = Annotated[int, Field(ge=-1, le=MAX_TRUNCATE)]


class EmbeddingRequest(StrictModel):
    """`POST /v1/embeddings`: `input` a string, strings, token ids or lists of token ids."""

    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # accepted and ignored, as a local server has no users to track
    truncate_prompt_tokens: Truncate | None = None


class Document(StrictModel):
    """A rerank document given as an object (Cohere, Jina): its `text`."""

    text: str


class RerankRequest(StrictModel):
    """`POST /v1/rerank` (also `/rerank`, `/v2/rerank`): `documents` ranked against `query`."""

    query: Text
    documents: Annotated[list[str | Document], Field(min_length=1, max_length=MAX_INPUTS - 1)]
    model: str | None = None
    top_n: Annotated[int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: Truncate | None = None


Texts = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoreRequest(StrictModel):
    """`POST /v1/score` (vLLM): `text_1` against `text_2`, one to many or pairwise."""

    text_1: Texts
    text_2: Texts
    model: str | None = None
    truncate_prompt_tokens: Truncate | None = None
