"""The pooling routes: `/v1/embeddings` (OpenAI), `/v1/rerank` (Jina/Cohere, as vLLM and
llama-server accept it) and `/v1/score` (vLLM).

Every one pools its inputs through `embed`. A causal LM has no classification head, so rerank
and score are the cosine similarity of the query's (`text_1`'s) and each document's
(`text_2`'s) pooled, normalized embeddings, as vLLM scores with an embedding model.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Callable
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from ft.errors import InvalidRequest
from ft.ids import random_id
from ft.prompt import PromptSpec
from ft.server.generation.context import ServerContext, json_response, json_response_off_loop, read_request
from ft.server.pooling.embed import Input, Pooled, cosine, embed, inputs_of, is_large
from ft.server.pooling.schemas import MAX_INPUTS, EmbeddingRequest, RerankRequest, ScoreRequest


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the pooling routes to `app`."""

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        req = await read_request(ctx, EmbeddingRequest)
        view = await ctx.for_model(req.model)
        one = isinstance(req.input, str) or isinstance(req.input[0], int)
        items: list[Any] = [req.input] if one else list(req.input)
        pooled = await embed(
            view, inputs_of(items, "input"), truncate=req.truncate_prompt_tokens, dimensions=req.dimensions
        )
        return await answer(pooled, lambda: embeddings_body(view, pooled, req.encoding_format))

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")  # Cohere's client
    @app.post("/rerank")  # vLLM's and llama-server's other path
    async def rerank() -> Response:
        req = await read_request(ctx, RerankRequest)
        view = await ctx.for_model(req.model)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        query = Input(PromptSpec(text=req.query), "query")
        pooled = await embed(
            view, [query, *inputs_of(texts, "documents", many=True)], truncate=req.truncate_prompt_tokens
        )
        return await answer(pooled, lambda: rerank_body(view, req, texts, pooled))

    @app.post("/v1/score")
    @app.post("/score")  # vLLM's other path
    async def score() -> Response:
        req = await read_request(ctx, ScoreRequest)
        left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if len(left) != 1 and len(left) != len(right):
            raise InvalidRequest(
                f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as many "
                "as text_2 (scored pairwise)",
                param="text_1",
            )
        if len(left) + len(right) > MAX_INPUTS:
            raise InvalidRequest(f"score takes at most {MAX_INPUTS} texts in all", param="text_2")
        inputs = [
            *inputs_of(left, "text_1", many=isinstance(req.text_1, list)),
            *inputs_of(right, "text_2", many=isinstance(req.text_2, list)),
        ]
        view = await ctx.for_model(req.model)
        pooled = await embed(view, inputs, truncate=req.truncate_prompt_tokens)
        return await answer(pooled, lambda: score_body(view, pooled, len(left)))


async def answer(pooled: Pooled, build: Callable[[], dict[str, Any]]) -> Response:
    """The JSON response `build()` makes: built in a thread for a large batch (its cosines,
    base64 and JSON are linear in it)."""
    if is_large(pooled.vectors):
        return await json_response_off_loop(build)
    return json_response(build())


def usage(pooled: Pooled) -> dict[str, Any]:
    """The usage object: prompt tokens only (nothing is generated)."""
    return {
        "prompt_tokens": pooled.prompt_tokens,
        "total_tokens": pooled.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": pooled.cached_tokens},
    }


def base64_floats(vector: list[float]) -> str:
    """`vector` as little-endian float32 bytes in base64 (OpenAI's `encoding_format: base64`)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_body(ctx: ServerContext, pooled: Pooled, encoding_format: str) -> dict[str, Any]:
    """OpenAI's `list` of `embedding` objects, in input order."""
    data = [
        {
            "object": "embedding",
            "index": k,
            "embedding": base64_floats(v) if encoding_format == "base64" else v,
        }
        for k, v in enumerate(pooled.vectors)
    ]
    return {"object": "list", "data": data, "model": ctx.engine.model_id, "usage": usage(pooled)}


def rerank_body(ctx: ServerContext, req: RerankRequest, texts: list[str], pooled: Pooled) -> dict[str, Any]:
    """The documents' results by score, highest first (stable: ties keep input order), cut to
    `top_n`; each with its input `index` and, when asked, its `document`."""
    query, docs = pooled.vectors[0], pooled.vectors[1:]
    scores = [cosine(query, d) for d in docs]
    order = sorted(range(len(docs)), key=lambda k: -scores[k])
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for k in order:
        result: dict[str, Any] = {"index": k, "relevance_score": scores[k]}
        if req.return_documents:
            result["document"] = {"text": texts[k]}
        results.append(result)
    return {
        "id": random_id("rerank-", 32),
        "model": ctx.engine.model_id,
        "results": results,
        "usage": usage(pooled),
    }


def score_body(ctx: ServerContext, pooled: Pooled, num_left: int) -> dict[str, Any]:
    """vLLM's score list: one `score` per `text_2` item, against `text_1` (or its pair)."""
    left, right = pooled.vectors[:num_left], pooled.vectors[num_left:]
    data = [
        {"index": k, "object": "score", "score": cosine(left[k if num_left > 1 else 0], v)}
        for k, v in enumerate(right)
    ]
    return {
        "id": random_id("score-", 32),
        "object": "list",
        "created": int(time.time()),
        "model": ctx.engine.model_id,
        "data": data,
        "usage": usage(pooled),
    }
