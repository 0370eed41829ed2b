"""The pooling routes: `/v1/embeddings` (OpenAI), `/v1/rerank` (Jina/Cohere, as vLLM and
llama-server accept it) and `/v1/score` (vLLM).

A reranker (rank pooling: a model with a classification head) scores each (query, document)
pair as one sequence through `rank`, as llama-server `--rerank` and vLLM's cross-encoders do, and
refuses `/v1/embeddings` (its pooled output is a score, not a vector). Any other model pools its
inputs through `embed`, and rerank and score are the cosine similarity of the query's
(`text_1`'s) and each document's (`text_2`'s) pooled, normalized embeddings, as vLLM scores with
an embedding model. The bodies say which in `scoring`: `classifier` or `cosine`.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from ft.errors import InvalidRequest
from ft.ids import random_id
from ft.prompt import PromptSpec
from ft.server.generation.context import ServerContext, json_response, json_response_off_loop, read_request
from ft.server.pooling.embed import Input, Pair, Pooled, Ranked, cosine, embed, inputs_of, is_large, rank
from ft.server.pooling.schemas import MAX_INPUTS, EmbeddingRequest, RerankRequest, ScoreRequest


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the pooling routes to `app`."""

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        req = await read_request(ctx, EmbeddingRequest)
        view = await ctx.for_model(req.model)
        if view.engine.pooling == "rank":
            raise InvalidRequest(
                "this model is served as a reranker (--pooling rank): its pooled output is a "
                "relevance score, not an embedding; use /v1/rerank or /v1/score, or serve it with "
                "--pooling last for embeddings of its hidden states",
                param="input",
            )
        one = isinstance(req.input, str) or isinstance(req.input[0], int)
        items: list[Any] = [req.input] if one else list(req.input)
        pooled = await embed(
            view,
            inputs_of(items, "input"),
            truncate=req.truncate_prompt_tokens,
            dimensions=req.dimensions,
            cache_salt=req.cache_salt,
        )
        return await answer(pooled.vectors, lambda: embeddings_body(view, pooled, req.encoding_format))

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")  # Cohere's client
    @app.post("/rerank")  # vLLM's and llama-server's other path
    async def rerank() -> Response:
        req = await read_request(ctx, RerankRequest)
        view = await ctx.for_model(req.model)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        if view.engine.pooling == "rank":
            pairs = [Pair(req.query, t, f"documents[{k}]") for k, t in enumerate(texts)]
            ranked = await rank(view, pairs, truncate=req.truncate_prompt_tokens, cache_salt=req.cache_salt)
            return await answer(pairs, lambda: rerank_body(view, req, texts, ranked.scores, ranked))
        query = Input(PromptSpec(text=req.query), "query")
        pooled = await embed(
            view,
            [query, *inputs_of(texts, "documents", many=True)],
            truncate=req.truncate_prompt_tokens,
            cache_salt=req.cache_salt,
        )
        scores = [cosine(pooled.vectors[0], d) for d in pooled.vectors[1:]]
        return await answer(pooled.vectors, lambda: rerank_body(view, req, texts, scores, pooled))

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
        view = await ctx.for_model(req.model)
        if view.engine.pooling == "rank":
            name = "text_2[{}]" if isinstance(req.text_2, list) else "text_2"
            pairs = [Pair(left[k if len(left) > 1 else 0], t, name.format(k)) for k, t in enumerate(right)]
            ranked = await rank(view, pairs, truncate=req.truncate_prompt_tokens, cache_salt=req.cache_salt)
            return await answer(pairs, lambda: score_body(view, ranked.scores, ranked))
        inputs = [
            *inputs_of(left, "text_1", many=isinstance(req.text_1, list)),
            *inputs_of(right, "text_2", many=isinstance(req.text_2, list)),
        ]
        pooled = await embed(view, inputs, truncate=req.truncate_prompt_tokens, cache_salt=req.cache_salt)
        lefts, rights = pooled.vectors[: len(left)], pooled.vectors[len(left) :]

        def build() -> dict[str, Any]:
            scores = [cosine(lefts[k if len(lefts) > 1 else 0], v) for k, v in enumerate(rights)]
            return score_body(view, scores, pooled)

        return await answer(pooled.vectors, build)


async def answer(inputs: Sequence[object], build: Callable[[], dict[str, Any]]) -> Response:
    """The JSON response `build()` makes: built in a thread for a large batch of `inputs` (its
    cosines, base64 and JSON are linear in it)."""
    if is_large(inputs):
        return await json_response_off_loop(build)
    return json_response(build())


def scoring(ctx: ServerContext) -> str:
    """How rerank and score compute a score here: `classifier` (the reranker's head over the
    pair) or `cosine` (of the two texts' embeddings)."""
    return "classifier" if ctx.engine.pooling == "rank" else "cosine"


def usage(pooled: Pooled | Ranked) -> dict[str, Any]:
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


def rerank_body(
    ctx: ServerContext, req: RerankRequest, texts: list[str], scores: list[float], counts: Pooled | Ranked
) -> dict[str, Any]:
    """The documents' results by score, highest first (stable: ties keep input order), cut to
    `top_n`; each with its input `index` and, when asked, its `document`."""
    order = sorted(range(len(scores)), key=lambda k: -scores[k])
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
        "scoring": scoring(ctx),
        "usage": usage(counts),
    }


def score_body(ctx: ServerContext, scores: list[float], counts: Pooled | Ranked) -> dict[str, Any]:
    """vLLM's score list: one `score` per `text_2` item, against `text_1` (or its pair)."""
    data = [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)]
    return {
        "id": random_id("score-", 32),
        "object": "list",
        "created": int(time.time()),
        "model": ctx.engine.model_id,
        "data": data,
        "scoring": scoring(ctx),
        "usage": usage(counts),
    }
