"""One path for a pooling request, whatever its API: embeddings, rerank, score.

`embed` runs each input through the engine as a pooling request (`SamplingParams.pooling`): the
same admission, scheduler, prefix cache, preemption and request scopes as generation, but the
scheduler feeds only the prompt and the runner returns its pooled hidden state. The lifecycle:

1. **Static checks.** The engine admits the request (503 otherwise; the admission is held to the
   end of the HTTP request, as generation's is); every input is tokenized (text) or checked
   against the vocabulary (ids), cut to `truncate_prompt_tokens` when asked, and checked
   against the context and the KV pool: anything wrong is a 4xx naming the input, before any
   work.
2. **Pooling.** One request scope per input, at most `max_running_requests` of them open at
   once (so one large batch neither fills the queue nor is refused by it); each scope is closed
   when its vector arrives, when another input fails, or when the client leaves (the handler is
   cancelled and every open scope's exit frees its pages).
3. **Vectors.** Each pooled vector is cut to `dimensions` when asked and L2-normalized (a
   zero vector stays zero).

`rank` is the same lifecycle for a reranker (`engine.rank_format`, rank pooling): each
(query, document) pair is one input, formatted as the model's `RankFormat` says (its rerank
template, else its special tokens around the two texts' tokens), and its result is the
classification head's score instead of a vector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import trio
from quart import has_request_context, request

from ft.engine.engine import Admission
from ft.errors import ContextLengthExceeded, FtError, InvalidRequest
from ft.model.rerank import RankFormat
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.server.edge.auth import current_client
from ft.server.edge.tracing import RequestRecord, current_record
from ft.server.generation.context import ServerContext

LARGE_BATCH = 16  # inputs past which the vectors' arithmetic and JSON run in a thread


@dataclass(frozen=True, slots=True)
class Input:
    """One input to pool: its text or token ids, and the name a refusal of it gives."""

    prompt: PromptSpec
    param: str


@dataclass(frozen=True, slots=True)
class Pooled:
    """A pooling request's result: one unit vector per input, in order, and the token counts."""

    vectors: list[list[float]]
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Pair:
    """One (query, document) pair a reranker scores, and the name a refusal of it gives."""

    query: str
    document: str
    param: str


@dataclass(frozen=True, slots=True)
class Ranked:
    """A rank request's result: one relevance score per pair, in order, and the token counts."""

    scores: list[float]
    prompt_tokens: int
    cached_tokens: int


def inputs_of(items: Sequence[str | Sequence[int]], param: str, *, many: bool | None = None) -> list[Input]:
    """`Input`s of a body's texts or token-id lists, named `param[i]` when the body gave a list
    (`many`; None: when there is more than one), else `param`."""
    indexed = len(items) > 1 if many is None else many
    return [
        Input(
            PromptSpec(text=x) if isinstance(x, str) else PromptSpec(token_ids=x),
            f"{param}[{i}]" if indexed else param,
        )
        for i, x in enumerate(items)
    ]


def normalize(vector: Sequence[float], dimensions: int | None = None) -> list[float]:
    """`vector` cut to its first `dimensions` values (all when None), scaled to unit length."""
    cut = vector[:dimensions] if dimensions is not None else vector
    norm = math.sqrt(math.fsum(v * v for v in cut))
    return [v / norm for v in cut] if norm > 0 else [0.0 for _ in cut]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two unit vectors (their dot product)."""
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


async def embed(
    ctx: ServerContext,
    inputs: list[Input],
    *,
    truncate: int | None = None,
    dimensions: int | None = None,
    cache_salt: str | None = None,
) -> Pooled:
    """Pool each input (see the module docstring); return its unit vectors and the usage.
    Its pages are reused only by requests of its tenant and `cache_salt`.

    Raises:
        FtError: an input cannot be tokenized, does not fit, or failed; the engine refuses (503).
    """
    engine = ctx.engine
    record = current_record()
    record.route = request.path if has_request_context() else "embedded"
    record.stream = False
    if ctx.settings.log_prompts:
        record.prompts = [i.prompt.text or list(i.prompt.token_ids or ()) for i in inputs]
    params = SamplingParams(pooling=engine.pooling)
    admission = engine.admit(min(len(inputs), engine.config.max_running_requests))
    try:
        if dimensions is not None and dimensions > engine.hidden_size:
            raise InvalidRequest(
                f"dimensions must be at most {engine.hidden_size}, this model's embedding size",
                param="dimensions",
            )
        prompt_ids = [
            _fit(ctx, await _token_ids(ctx, i, admission, truncate), params, truncate, i.param)
            for i in inputs
        ]
        record.prompt_tokens = sum(len(ids) for ids in prompt_ids)
        vectors, cached = await _pool_all(ctx, params, prompt_ids, record, admission, cache_salt)
    finally:
        if not record.release_at_end(admission.release):
            admission.release()  # no HTTP request to hold it (embedded use): released now

    # NOTE: linear in the batch (2048 inputs x the hidden size): off the loop when large.
    def unit_vectors() -> list[list[float]]:
        return [normalize(v, dimensions) for v in vectors]

    units = await trio.to_thread.run_sync(unit_vectors) if is_large(inputs) else unit_vectors()
    return Pooled(units, record.prompt_tokens, cached)


async def rank(
    ctx: ServerContext, pairs: list[Pair], *, truncate: int | None = None, cache_salt: str | None = None
) -> Ranked:
    """Score each pair with the engine's reranker (see the module docstring), in the prefix-cache
    partition of its tenant and `cache_salt`.

    Raises:
        FtError: a pair cannot be tokenized, does not fit, or failed; the engine refuses (503).
    """
    engine = ctx.engine
    fmt = engine.rank_format
    assert fmt is not None, "rank() is for a reranker: the routes check engine.pooling"
    record = current_record()
    record.route = request.path if has_request_context() else "embedded"
    record.stream = False
    if ctx.settings.log_prompts:
        record.prompts = [f"{p.query}\n{p.document}" for p in pairs]
    params = SamplingParams(pooling="rank")
    admission = engine.admit(min(len(pairs), engine.config.max_running_requests))
    try:
        parts: dict[str, tuple[int, ...]] = {}  # each text's tokens, once (rerank: one query)
        prompt_ids = [
            _fit(ctx, await _pair_ids(ctx, fmt, p, parts, admission, truncate), params, truncate, p.param)
            for p in pairs
        ]
        record.prompt_tokens = sum(len(ids) for ids in prompt_ids)
        outputs, cached = await _pool_all(ctx, params, prompt_ids, record, admission, cache_salt)
    finally:
        if not record.release_at_end(admission.release):
            admission.release()
    return Ranked([fmt.score(o) for o in outputs], record.prompt_tokens, cached)


def is_large(inputs: Sequence[object]) -> bool:
    """Whether a batch's vectors are normalized and its body built off the event loop."""
    return len(inputs) > LARGE_BATCH


async def _pair_ids(
    ctx: ServerContext,
    fmt: RankFormat,
    pair: Pair,
    parts: dict[str, tuple[int, ...]],
    admission: Admission,
    truncate: int | None,
) -> tuple[int, ...]:
    """`pair` as one sequence's token ids, in the reranker's format (`RankFormat`)."""
    try:
        if fmt.template is not None:
            text = fmt.render(pair.query, pair.document)
            return await _tokenized(ctx, PromptSpec(text=text, add_bos=False), admission, truncate)
        for text in (pair.query, pair.document):
            if text not in parts:
                spec = PromptSpec(text=text, add_bos=False)
                parts[text] = await _tokenized(ctx, spec, admission, truncate)
    except InvalidRequest as e:
        e.param = pair.param
        raise
    return tuple(fmt.pair_ids(parts[pair.query], parts[pair.document]))


async def _token_ids(
    ctx: ServerContext, item: Input, admission: Admission, truncate: int | None
) -> tuple[int, ...]:
    """`item`'s token ids: given (checked against the vocabulary) or tokenized."""
    if item.prompt.token_ids is not None:
        ids = tuple(item.prompt.token_ids)
        ctx.check_token_ids(list(ids), item.param)
        return ids
    try:
        return await _tokenized(ctx, item.prompt, admission, truncate)
    except ContextLengthExceeded as e:
        e.param = item.param
        raise


async def _tokenized(
    ctx: ServerContext, prompt: PromptSpec, admission: Admission, truncate: int | None
) -> tuple[int, ...]:
    """`prompt`'s ids; without `truncate`, one past the context is refused as soon as that is
    known (its bytes, its first slices), before the rest is tokenized."""
    engine = ctx.engine
    max_tokens = engine.max_model_len if truncate is None else None
    with engine.counting_rejections(ContextLengthExceeded):
        ids = await engine.tokenize(
            prompt, admission=admission, client=current_client(), max_tokens=max_tokens
        )
    return tuple(ids)


def _fit(
    ctx: ServerContext, ids: tuple[int, ...], params: SamplingParams, truncate: int | None, param: str
) -> tuple[int, ...]:
    """`ids` cut to `truncate` (the last tokens), checked to fit the engine (a 400 naming `param`)."""
    engine = ctx.engine
    if truncate is not None:
        keep = engine.max_model_len if truncate == -1 else truncate
        if keep > engine.max_model_len:
            raise InvalidRequest(
                f"truncate_prompt_tokens ({keep}) exceeds this model's maximum context length "
                f"({engine.max_model_len} tokens)",
                param="truncate_prompt_tokens",
            )
        ids = ids[-keep:]
    with engine.counting_rejections():
        try:
            engine.check_fits(len(ids), params)
        except InvalidRequest as e:
            e.param = param
            raise
    return ids


async def _pool_all(
    ctx: ServerContext,
    params: SamplingParams,
    prompt_ids: list[tuple[int, ...]],
    record: RequestRecord,
    admission: Admission,
    cache_salt: str | None,
) -> tuple[list[tuple[float, ...]], int]:
    """Each input's pooled vector (one scope each, a bounded number open); the cached tokens.

    The first input to fail cancels the others (their scopes close) and is raised, alone.
    """
    engine = ctx.engine
    vectors: list[tuple[float, ...]] = [() for _ in prompt_ids]
    cached = [0 for _ in prompt_ids]
    failure: list[FtError] = []
    window = trio.CapacityLimiter(engine.config.max_running_requests)

    async def pool_one(k: int, nursery: trio.Nursery) -> None:
        try:
            async with window:
                scope = engine.open_request(
                    PromptSpec(token_ids=prompt_ids[k], cache_salt=cache_salt, tenant=record.tenant),
                    params=params,
                    request_id=record.request_id,
                    admission=admission,
                )
                async with scope as stream:
                    vectors[k] = await stream.wait_embedding()
                    cached[k] = stream.num_cached_tokens
        except FtError as e:
            if not failure:
                failure.append(e)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for k in range(len(prompt_ids)):
            nursery.start_soon(pool_one, k, nursery)
    if failure:
        raise failure[0]
    record.cached_tokens = sum(cached)
    record.finish_reasons = ["stop" for _ in prompt_ids]
    return vectors, sum(cached)
