"""The quart-trio app (`create_app`) and its lifetime under hypercorn (`open_server`, `serve`).

The engine's lifetime contains the server's: `open_engine` is entered first and left last, so
no request can outlive the engine it runs on.
"""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial

import hypercorn.trio
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ft.config import DEFAULT_ABORT_TIMEOUT_S, EngineConfig
from ft.engine.engine import Engine, open_engine
from ft.engine.loading import EngineHooks
from ft.errors import FtError
from ft.server import control, web
from ft.server.anthropic import routes as anthropic_routes
from ft.server.edge import protocol, slow_clients
from ft.server.edge.auth import authorize
from ft.server.edge.http_errors import HttpError, internal_error
from ft.server.edge.protocol import FtHypercornConfig
from ft.server.edge.slow_clients import SendDeadlines
from ft.server.edge.tracing import Tracing, current_record
from ft.server.generation.context import ServerContext, error_response
from ft.server.models import ModelRouter, RouterSettings
from ft.server.openai import routes as openai_routes
from ft.server.pooling import routes as pooling_routes
from ft.server.responses import routes as responses_routes
from ft.server.settings import ServerSettings

log = logging.getLogger("ft.server")


HTTP_ERROR_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
}

RouteRegistrar = Callable[[QuartTrio, ServerContext], None]


class EngineFailed(RuntimeError):
    """The engine failed for good (the model did not load, or a rank died or hangs): the server
    stopped serving."""


def create_app(
    engine: Engine | None,
    settings: ServerSettings,
    *,
    router: ModelRouter | None = None,
    extra_routes: tuple[RouteRegistrar, ...] = (),
) -> QuartTrio:
    """The app serving `engine` (or, in router mode, `router`'s models): the OpenAI, Anthropic
    and Responses routes, the control plane, the chat page.

    `extra_routes` are called as `register(app, ctx)` after the built-in ones.
    """
    app = QuartTrio("ft")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # streams may run for as long as generation does
        BODY_TIMEOUT=60,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    # `//v1//stats` is not `/v1/stats`: no redirect (werkzeug's answers 308 with an HTML body).
    app.url_map.merge_slashes = False
    ctx = ServerContext(settings=settings, bound=engine, router=router)
    app.extensions["ft"] = ctx
    _install_edge(app, ctx)
    for module in (openai_routes, pooling_routes, anthropic_routes, responses_routes, control, web):
        module.register(app, ctx)
    for register in extra_routes:
        register(app, ctx)
    app.asgi_app = Tracing(  # type: ignore[method-assign,assignment]
        app.asgi_app, ctx.metrics.observe_http_request, log_prompts=settings.log_prompts
    )
    return app


def _install_edge(app: QuartTrio, ctx: ServerContext) -> None:
    """Auth, CORS and the error handlers: every error leaves as JSON."""
    settings = ctx.settings

    @app.before_request
    async def authenticate() -> None:
        current_record().tenant = authorize(request, settings, ctx.tenants).tenant

    @app.after_request
    async def cors(response: Response) -> Response:
        origins = settings.cors_origins
        origin = request.headers.get("Origin")
        if not origins or origin is None:
            return response
        if "*" in origins:
            response.headers["Access-Control-Allow-Origin"] = "*"
        elif origin in origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers.add("Vary", "Origin")
        else:
            return response
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        response.headers["Access-Control-Allow-Headers"] = (
            "Authorization, Content-Type, x-api-key, anthropic-version"
        )
        response.headers["Access-Control-Max-Age"] = "600"
        return response

    @app.errorhandler(FtError)
    async def on_ft_error(e: FtError) -> Response:
        return error_response(ctx, e)

    @app.errorhandler(HTTPException)
    async def on_http_exception(e: HTTPException) -> Response:
        status = e.code or 500
        if status >= 500:
            return error_response(ctx, internal_error(e))
        headers = {}
        if status == 405 and getattr(e, "valid_methods", None):
            headers["Allow"] = ", ".join(e.valid_methods)  # type: ignore[attr-defined]
        message = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: f"the request body exceeds {settings.max_body_bytes} bytes",
        }.get(status, e.description or e.name)
        err = HttpError(status, message, code=HTTP_ERROR_CODES.get(status), headers=headers)
        return error_response(ctx, err)

    @app.errorhandler(Exception)
    async def on_exception(e: Exception) -> Response:
        return error_response(ctx, internal_error(e))


def hypercorn_config(settings: ServerSettings) -> FtHypercornConfig:
    """Hypercorn's config for `settings` (access log only at debug level; HTTP/1.x only
    unless `settings.http2`, see `ft.server.edge.protocol`)."""
    protocol.install()
    slow_clients.install()
    cfg = FtHypercornConfig()
    cfg.http2 = settings.http2
    cfg.send_deadlines = SendDeadlines(settings.send_timeout_s)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    cfg.bind = [f"{host}:{settings.port}"]
    cfg.graceful_timeout = settings.graceful_timeout_s
    cfg.accesslog = logging.getLogger("ft.access") if settings.log_level == "debug" else None
    cfg.errorlog = logging.getLogger("ft.hypercorn")
    cfg.keep_alive_timeout = 30
    return cfg


@dataclass
class RunningServer:
    """A server that is listening: its engine (router mode: None, and its `router`), app and
    the URLs it is bound to."""

    engine: Engine | None
    app: QuartTrio
    urls: list[str]
    stop_event: trio.Event = field(default_factory=trio.Event)
    router: ModelRouter | None = None

    @property
    def base_url(self) -> str:
        """`http://host:port` of the first bound address."""
        return self.urls[0]

    def stop(self) -> None:
        """Ask hypercorn to stop (graceful: open connections get `graceful_timeout_s`)."""
        self.stop_event.set()


@asynccontextmanager
async def open_server(
    engine_config: EngineConfig | None = None,
    settings: ServerSettings | None = None,
    *,
    hooks: EngineHooks | None = None,
    router: RouterSettings | None = None,
) -> AsyncIterator[RunningServer]:
    """Start the engine, then hypercorn on it; yield once listening (the model may still load).

    With `router` (several models, `ft.server.models`) the router runs instead of one engine;
    `engine_config` is each model's config but for its path and name. Leaving the block stops
    hypercorn first, then the engine (or every model's).
    """
    settings = settings or ServerSettings()
    if router is not None:
        models = ModelRouter(engine_config or EngineConfig(), router, hooks=hooks)
        async with trio.open_nursery() as nursery:
            await nursery.start(models.run)
            app = create_app(None, settings, router=models)
            async with _listen(app, settings, None, models) as server:
                yield server
            models.begin_stop(0.0, 0.0)
            nursery.cancel_scope.cancel()
        return
    async with open_engine(engine_config, hooks=hooks, wait_ready=False) as engine:
        app = create_app(engine, settings)
        async with _listen(app, settings, engine, None) as server:
            yield server


@asynccontextmanager
async def _listen(
    app: QuartTrio, settings: ServerSettings, engine: Engine | None, router: ModelRouter | None
) -> AsyncIterator[RunningServer]:
    """Hypercorn serving `app` for the block."""
    stop = trio.Event()
    config = hypercorn_config(settings)
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait))
        server = RunningServer(engine=engine, app=app, urls=list(urls), stop_event=stop, router=router)
        try:
            yield server
        finally:
            stop.set()
            # hypercorn cancels its connections after the graceful timeout, but a socket
            # write is shielded: give the writes the same deadline, so no client that
            # stopped reading holds the server open.
            assert config.send_deadlines is not None
            config.send_deadlines.close_all(trio.current_time() + settings.graceful_timeout_s)


async def serve(
    engine_config: EngineConfig | None = None,
    settings: ServerSettings | None = None,
    *,
    hooks: EngineHooks | None = None,
    router: RouterSettings | None = None,
    handle_signals: bool = True,
    freeze_heap: bool = False,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGINT/SIGTERM (or until cancelled); then drain and return.

    On the first signal the engine stops admitting (503; `/health/ready` says 503 too), waits up
    to `drain_timeout_s` for active requests, aborts the rest, and hypercorn stops. A second
    signal skips the drain.
    `handle_signals=False` (needed off the main thread) serves until cancelled.
    `freeze_heap`: for a process that does nothing but serve one model (`ft serve`), freeze
    the heap once the model has loaded (`_freeze_heap_once_ready`); ignored in router mode.

    Raises:
        EngineFailed: the engine failed for good: its model did not load, or its runner failed
            (a tensor-parallel rank died or hangs), every request was failed with a server
            error and the server stopped.
    """
    settings = settings or ServerSettings()
    if not handle_signals:
        async with open_server(engine_config, settings, hooks=hooks, router=router) as server:
            task_status.started(server)
            if freeze_heap and server.engine is not None:
                await _freeze_heap_once_ready(server.engine)
            await trio.sleep_forever()
    failure: str | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_server(engine_config, settings, hooks=hooks, router=router) as server:
            log.info("listening on %s", ", ".join(server.urls))
            task_status.started(server)
            if server.router is not None:
                # Several models: one that fails fails its own requests; the server serves on.
                await _drain_router(signals, server.router, settings)
                return
            assert server.engine is not None
            async with trio.open_nursery() as background:
                if freeze_heap:
                    background.start_soon(_freeze_heap_once_ready, server.engine)
                failure = await _first_signal_or_failure(signals, server.engine)
                background.cancel_scope.cancel()
            if failure is not None:
                # Every request has been failed; let their streams send the error and close.
                log.error("the engine failed: %s; stopping", failure)
                with trio.move_on_after(DEFAULT_ABORT_TIMEOUT_S):
                    await server.engine.registry.wait_empty()
            else:
                await _drain(signals, server, settings)
                if server.engine.has_failed:  # a rank failed while draining
                    failure = server.engine.error
    if failure is not None:
        raise EngineFailed(failure)


async def _freeze_heap_once_ready(engine: Engine) -> None:
    """Once the model has loaded, move every object alive into the collector's permanent
    generation (`gc.freeze`, as vLLM does after startup).

    The process then holds ~230k objects (torch, the model, the app) that live as long as it
    does. A full collection scans them all, ~0.1 s here (0.3 s with a larger heap), with the
    GIL held: the event loop, and every stream on it, stops for that long. Frozen, they are
    never scanned again: a full collection while serving scans only what was made since (26 us
    right after the freeze, against 0.109 s before).
    Only `ft serve` asks for it: it owns its process (an embedding program owns its heap), and
    serves one engine (the router unloads models, and a frozen engine's cycles would never be
    freed). The other ranks of a tensor-parallel group (`run_rank`) do not freeze theirs.
    """
    try:
        await engine.wait_ready()
    except RuntimeError:
        return  # the model did not load: `_first_signal_or_failure` reports it
    gc.collect()  # what is garbage now would never be freed once frozen
    gc.freeze()
    log.debug("froze %d objects of the startup heap", gc.get_freeze_count())


async def _first_signal_or_failure(signals: AsyncIterator[int], engine: Engine) -> str | None:
    """Wait for SIGINT/SIGTERM (None) or for the model runner to fail for good (why)."""
    outcome: list[str | None] = []
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            async for signum in signals:
                log.info("received %s", signal.Signals(signum).name)
                break
            outcome.append(None)
            nursery.cancel_scope.cancel()

        async def on_failure() -> None:
            outcome.append(await engine.wait_failed())
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        nursery.start_soon(on_failure)
    return outcome[0]


async def _drain_router(signals: AsyncIterator[int], router: ModelRouter, settings: ServerSettings) -> None:
    """Router mode: wait for SIGINT/SIGTERM, then drain every model's engine as `_drain` does
    one (a second signal skips it)."""
    async for signum in signals:
        log.info("received %s", signal.Signals(signum).name)
        break
    log.info("draining every model for up to %.1f s", settings.drain_timeout_s)
    async with trio.open_nursery() as nursery:

        async def force_on_second_signal() -> None:
            async for _ in signals:
                log.warning("second signal: stopping without draining")
                nursery.cancel_scope.cancel()

        nursery.start_soon(force_on_second_signal)
        router.begin_stop(settings.drain_timeout_s, DEFAULT_ABORT_TIMEOUT_S)
        with trio.move_on_after(settings.drain_timeout_s + DEFAULT_ABORT_TIMEOUT_S + 1.0):
            await router.wait_stopped()
            log.info("drained every model")
        nursery.cancel_scope.cancel()


async def _drain(signals: AsyncIterator[int], server: RunningServer, settings: ServerSettings) -> None:
    """Stop admitting, drain up to `drain_timeout_s`, abort the rest; a second signal skips it."""
    log.info("draining for up to %.1f s", settings.drain_timeout_s)
    async with trio.open_nursery() as nursery:

        async def force_on_second_signal() -> None:
            async for _ in signals:
                log.warning("second signal: stopping without draining")
                nursery.cancel_scope.cancel()

        nursery.start_soon(force_on_second_signal)
        # The drain runs in the engine's nursery; a drain an admin began earlier is
        # shortened to this deadline. The outer bound holds whatever state it is in.
        engine = server.engine
        assert engine is not None
        engine.begin_stop(settings.drain_timeout_s, DEFAULT_ABORT_TIMEOUT_S)
        with trio.move_on_after(settings.drain_timeout_s + DEFAULT_ABORT_TIMEOUT_S + 1.0):
            snapshot = await engine.wait_stopped()
            log.info("drained: %s", asdict(snapshot.requests))
        nursery.cancel_scope.cancel()
