"""Control plane: the root (`GET`/`HEAD /` with `--no-web-ui`), health and probes, models, stats, Prometheus
metrics, tokenize/detokenize, prepare-stop.

None of these open a request scope; they read the engine's derived state, so they answer at
once even while generations stream or the model loads.
"""

from __future__ import annotations

import time
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from ft.config import MAX_SERVED_NAME_LEN
from ft.engine.engine import EngineState
from ft.prompt import PromptSpec
from ft.server.edge.http_errors import HttpError
from ft.server.generation.context import ServerContext, json_response, read_request
from ft.server.generation.policy import template_prompt
from ft.server.generation.tools import ToolChoice
from ft.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ft.server.openai.format import chat_message_for_template
from ft.server.openai.schemas import DetokenizeRequest, PrepareStopRequest, TokenizeRequest

# `/health`'s status for each engine state (any other: "stopping").
HEALTH_STATUS = {EngineState.READY: "ok", EngineState.LOADING: "loading", EngineState.ERROR: "error"}


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the control-plane routes to `app`."""
    engine = ctx.engine

    if not ctx.settings.web_ui:  # else `/` is the chat page (`ft.server.web`)

        @app.get("/")
        async def root() -> Response:
            # Clients probe the base URL before their first request (Claude Code sends `HEAD /`;
            # quart answers HEAD with the GET route's headers and no body).
            return json_response({"status": "ok", "model": engine.model_id})

    @app.get("/health")
    async def health() -> Response:
        status = HEALTH_STATUS.get(engine.state, "stopping")
        body: dict[str, Any] = {"status": status, "state": engine.state, "model": engine.model_id}
        if engine.state == EngineState.LOADING:
            body["loading_s"] = round(time.time() - ctx.started_at, 1)
            body["progress"] = engine.load_progress
        if engine.error:
            body["error"] = engine.error
        return json_response(body)

    @app.get("/health/live")
    async def live() -> Response:
        # The process runs and its event loop answers: whatever the engine's state.
        return json_response({"status": "alive"})

    @app.get("/health/ready")
    async def ready() -> Response:
        # What a load balancer checks: 503 while loading, draining, stopped or failed.
        is_ready = engine.state == EngineState.READY
        body = {"status": "ready" if is_ready else "unavailable", "state": engine.state}
        if engine.error:  # failed for good (a stalled step, a dead rank): say why
            body["error"] = engine.error
        return json_response(body, 200 if is_ready else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        # A load balancer probing here must not send traffic that would fail: 503 until ready.
        _check_models_ready(ctx)
        data = [model_entry(ctx, name) for name in engine.names.listed]
        return json_response({"object": "list", "data": data})

    @app.get("/v1/models/<path:model>")
    async def retrieve_model(model: str) -> Response:
        _check_models_ready(ctx)
        if len(model) > MAX_SERVED_NAME_LEN:  # no name is this long (a request's `model` neither)
            raise HttpError(404, "no model has a name this long", param="model", code="model_not_found")
        ctx.check_model(model)  # any name is the served model's unless --strict-model-names
        listed = engine.names.listed
        return json_response(model_entry(ctx, model if model in listed else engine.model_id))

    @app.get("/v1/stats")
    async def stats() -> Response:
        return json_response(engine.snapshot().as_json())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), content_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/tokenize")
    async def tokenize() -> Response:
        req = await read_request(ctx, TokenizeRequest)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise HttpError(400, "give exactly one of prompt or messages", param="prompt")
        _check_ready(ctx)
        ids = await engine.tokenize(tokenize_prompt(req))
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @app.post("/v1/detokenize")
    async def detokenize() -> Response:
        req = await read_request(ctx, DetokenizeRequest)
        ctx.check_model(req.model)
        _check_ready(ctx)
        # Up to ~500k ids fit the body limit: decode them off the event loop.
        text = await trio.to_thread.run_sync(engine.detokenize, req.tokens)
        return json_response({"prompt": text})

    @app.post("/v1/admin/prepare-stop")
    async def prepare_stop() -> Response:
        # Who may call it (loopback or --admin-key, no foreign Origin) is `auth.authorize_admin`.
        req = await read_request(ctx, PrepareStopRequest, allow_empty=True)
        snapshot = await engine.prepare_stop(req.drain_timeout_s, req.abort_timeout_s)
        return json_response(snapshot.as_json())


def tokenize_prompt(req: TokenizeRequest) -> PromptSpec:
    """What `/v1/tokenize` renders: the prompt, or the messages as a chat completion with the
    same fields renders them (`tool_choice` auto, through the shared policy: `tools: []` is
    no tools, as there, not an empty list a template may test against none)."""
    if req.messages is None:
        return PromptSpec(text=req.prompt)
    prompt = PromptSpec(
        messages=[chat_message_for_template(m) for m in req.messages],
        tools=req.tools,
        chat_template_kwargs=req.chat_template_kwargs or {},
        add_generation_prompt=req.add_generation_prompt,
    )
    return template_prompt(prompt, ToolChoice())


def model_entry(ctx: ServerContext, name: str) -> dict[str, Any]:
    """The `/v1/models` entry for `name`: OpenAI's fields, every other name the model accepts,
    its limits (`context_length` and `max_model_len`: the context a prompt and its output share
    at runtime, after `--max-model-len`) and what ft does with it (`capabilities`)."""
    engine = ctx.engine
    names = engine.names
    return {
        "id": name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "ft",
        "root": engine.model_id,
        "aliases": [n for n in (*names.listed, *names.aliases) if n != name],
        "context_length": engine.max_model_len,
        "max_model_len": engine.max_model_len,
        "capabilities": {
            "tools": True,  # every model: its template's format, or Hermes calls in the system prompt
            "reasoning": (ctx.settings.reasoning_parser or ctx.engine.reasoning_parser) is not None,
            "vision": False,  # text only: image, audio and file parts are refused
            # /v1/embeddings pools its hidden states (not a reranker's: its pooled output is a score)
            "embeddings": engine.pooling != "rank",
            # /v1/rerank and /v1/score: the reranker's head over each pair, else embeddings' cosine
            "rerank": "classifier" if engine.pooling == "rank" else "cosine",
        },
    }


def _check_models_ready(ctx: ServerContext) -> None:
    """503 until the model serves, and while it stops: a balancer probing here sends no traffic
    that would fail."""
    if ctx.engine.state != EngineState.READY:
        raise ctx.engine.refusal()


def _check_ready(ctx: ServerContext) -> None:
    """503 while the model loads or after the engine failed (a drain still answers these)."""
    if ctx.engine.state in (EngineState.LOADING, EngineState.ERROR):
        raise ctx.engine.refusal()
