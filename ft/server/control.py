"""Control plane: the root (`GET`/`HEAD /` with `--no-web-ui`), health and probes, models, stats, Prometheus
metrics, tokenize/detokenize, prepare-stop.

None of these open a request scope; they read the engine's derived state, so they answer at
once even while generations stream or the model loads. In router mode (several models,
`ft.server.models`) the probes, `/v1/models`, `/v1/stats` and `/metrics` read every model's
status and take no lease (they neither count as a model's use nor load one); tokenize and
detokenize resolve their `model` as generation does; `POST /v1/models/load` and `/unload` are
admin routes (`auth.ADMIN_PATHS`).
"""

from __future__ import annotations

import time
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from ft.config import DEFAULT_ABORT_TIMEOUT_S, MAX_SERVED_NAME_LEN
from ft.engine.engine import EngineState
from ft.prompt import PromptSpec
from ft.server.edge.auth import current_client
from ft.server.edge.http_errors import HttpError
from ft.server.generation.context import ServerContext, json_response, read_request
from ft.server.generation.policy import template_prompt
from ft.server.generation.tools import ToolChoice
from ft.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ft.server.models import ModelRouter, ModelSlot, ModelStatus
from ft.server.openai.format import chat_message_for_template
from ft.server.openai.schemas import (
    DetokenizeRequest,
    ModelActionRequest,
    PrepareStopRequest,
    TokenizeRequest,
)

# `/health`'s status for each engine state (any other: "stopping").
HEALTH_STATUS = {EngineState.READY: "ok", EngineState.LOADING: "loading", EngineState.ERROR: "error"}


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Add the control-plane routes to `app`."""
    _register_tokens(app, ctx)
    if ctx.router is not None:
        _register_router(app, ctx, ctx.router)
        return
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

    @app.post("/v1/admin/prepare-stop")
    async def prepare_stop() -> Response:
        # Who may call it (loopback or --admin-key, no foreign Origin) is `auth.authorize_admin`.
        req = await read_request(ctx, PrepareStopRequest, allow_empty=True)
        snapshot = await engine.prepare_stop(req.drain_timeout_s, req.abort_timeout_s)
        return json_response(snapshot.as_json())

    @app.post("/v1/models/load")
    @app.post("/models/load")  # llama-server's path
    async def load_model() -> Response:
        req = await read_request(ctx, ModelActionRequest)
        ctx.check_model(req.model)
        return json_response({"success": True, "model": engine.model_id})

    @app.post("/v1/models/unload")
    @app.post("/models/unload")
    async def unload_model() -> Response:
        req = await read_request(ctx, ModelActionRequest)
        ctx.check_model(req.model)
        raise HttpError(
            400,
            "this server serves one model, which it cannot unload (serve several with --model given "
            "more than once or --models-dir)",
            param="model",
        )


def _register_tokens(app: QuartTrio, ctx: ServerContext) -> None:
    """`/v1/tokenize` and `/v1/detokenize`, on the engine of the request's `model`."""

    @app.post("/v1/tokenize")
    async def tokenize() -> Response:
        req = await read_request(ctx, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise HttpError(400, "give exactly one of prompt or messages", param="prompt")
        view = await ctx.for_model(req.model)
        _check_ready(view)
        ids = await view.engine.tokenize(tokenize_prompt(req), client=current_client())
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": view.engine.max_model_len})

    @app.post("/v1/detokenize")
    async def detokenize() -> Response:
        req = await read_request(ctx, DetokenizeRequest)
        view = await ctx.for_model(req.model)
        _check_ready(view)
        # Up to ~500k ids fit the body limit: decode them off the event loop.
        text = await trio.to_thread.run_sync(view.engine.detokenize, req.tokens)
        return json_response({"prompt": text})


def _register_router(app: QuartTrio, ctx: ServerContext, router: ModelRouter) -> None:
    """The control plane of a router-mode server (several models)."""

    if not ctx.settings.web_ui:

        @app.get("/")
        async def root() -> Response:
            return json_response({"status": "ok", "model": router.default.name})

    @app.get("/health")
    async def health() -> Response:
        # Live while any model can serve or be loaded; each model's status says the rest.
        is_live = any(s.status != ModelStatus.FAILED for s in router.slots)
        status = "stopping" if router.is_stopping else "ok" if is_live else "error"
        models = [{"id": s.name, "status": str(s.status)} | _error(s) for s in router.slots]
        return json_response({"status": status, "model": router.default.name, "models": models})

    @app.get("/health/live")
    async def live() -> Response:
        return json_response({"status": "alive"})

    @app.get("/health/ready")
    async def ready() -> Response:
        # Ready while the default model is loaded or can be loaded on demand (a request for it
        # waits for the load): not once it failed, nor while the server stops.
        default = router.default
        is_ready = not router.is_stopping and default.status != ModelStatus.FAILED
        body = {
            "status": "ready" if is_ready else "unavailable",
            "model": default.name,
            "state": str(default.status),
        }
        return json_response(body | _error(default), 200 if is_ready else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [slot_entry(ctx, s) for s in router.slots]})

    @app.get("/v1/models/<path:model>")
    async def retrieve_model(model: str) -> Response:
        if len(model) > MAX_SERVED_NAME_LEN:
            raise HttpError(404, "no model has a name this long", param="model", code="model_not_found")
        return json_response(slot_entry(ctx, router.find(model)))

    @app.get("/v1/stats")
    async def stats() -> Response:
        return json_response({"object": "stats", "models": [slot_stats(s) for s in router.slots]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), content_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/admin/prepare-stop")
    async def prepare_stop() -> Response:
        req = await read_request(ctx, PrepareStopRequest, allow_empty=True)
        router.begin_stop(req.drain_timeout_s, req.abort_timeout_s)
        with trio.move_on_after(req.drain_timeout_s + req.abort_timeout_s + 1.0):
            await router.wait_stopped()
        return json_response({"object": "stats", "models": [slot_stats(s) for s in router.slots]})

    @app.post("/v1/models/load")
    @app.post("/models/load")  # llama-server's path
    async def load_model() -> Response:
        # Who may call it is `auth.authorize_admin`'s. The load runs in the router's nursery:
        # a caller that leaves stops only its wait.
        req = await read_request(ctx, ModelActionRequest)
        slot = router.find(req.model)
        await router.load(slot)
        return json_response({"success": True, "model": slot_entry(ctx, slot)})

    @app.post("/v1/models/unload")
    @app.post("/models/unload")
    async def unload_model() -> Response:
        req = await read_request(ctx, ModelActionRequest)
        slot = router.find(req.model)
        router.unload(slot)  # the drain runs in the router's nursery, whoever waits for it
        with trio.move_on_after(router.settings.unload_timeout_s + DEFAULT_ABORT_TIMEOUT_S + 5.0):
            await router.wait_unloaded(slot)
        return json_response({"success": True, "model": slot_entry(ctx, slot)})


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


def slot_entry(ctx: ServerContext, slot: ModelSlot) -> dict[str, Any]:
    """A router-mode `/v1/models` entry: llama-server's router shape (`status.value`: loaded,
    loading, unloaded, unloading, failed with its error) and ft's fields; the limits are known
    once it has loaded (null before)."""
    engine = slot.engine
    context = (engine.max_model_len if engine is not None else 0) or slot.max_model_len or None
    names = slot.names
    reasoning = ctx.settings.reasoning_parser or (engine.reasoning_parser if engine is not None else None)
    pooling = slot.pooling or slot.config.pooling
    return {
        "id": slot.name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "ft",
        "root": slot.name,
        "status": {"value": str(slot.status)} | _error(slot),
        "path": slot.path,
        "aliases": [n for n in (*names.listed, *names.aliases) if n != slot.name],
        "context_length": context,
        "max_model_len": context,
        "capabilities": {
            "tools": True,
            "reasoning": reasoning is not None,
            "vision": False,
            # as `model_entry` says, from how it pooled at its last load (its option before)
            "embeddings": pooling != "rank",
            "rerank": "classifier" if pooling == "rank" else "cosine",
        },
    }


def slot_stats(slot: ModelSlot) -> dict[str, Any]:
    """One model's `/v1/stats` entry: its status, use and memory, and its engine's snapshot
    while it has an engine (null otherwise)."""
    engine = slot.engine
    return {
        "id": slot.name,
        "status": str(slot.status),
        "users": slot.num_users,
        "idle_s": round(trio.current_time() - slot.last_used, 3),
        "cost_bytes": slot.cost,
        "loaded_bytes": slot.loaded_bytes,
        "stats": engine.snapshot().as_json() if engine is not None else None,
    } | _error(slot)


def _error(slot: ModelSlot) -> dict[str, Any]:
    return {"error": slot.error} if slot.error else {}


def _check_models_ready(ctx: ServerContext) -> None:
    """503 until the model serves, and while it stops: a balancer probing here sends no traffic
    that would fail."""
    if ctx.engine.state != EngineState.READY:
        raise ctx.engine.refusal()


def _check_ready(ctx: ServerContext) -> None:
    """503 while the model loads or after the engine failed (a drain still answers these)."""
    if ctx.engine.state in (EngineState.LOADING, EngineState.ERROR):
        raise ctx.engine.refusal()
