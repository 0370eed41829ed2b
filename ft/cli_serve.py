"""`ft serve`: the OpenAI-compatible HTTP server on the engine (options and entry point)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import trio

from ft.config import (
    ADMISSIONS,
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_STEP_TIMEOUT_S,
    DEFAULT_TEMPLATE_TIMEOUT_S,
    KV_CACHE_DTYPES,
    EngineConfig,
    add_model_arguments,
    model_config_fields,
)
from ft.logs import LOG_FORMATS, setup_logging
from ft.server.edge.slow_clients import DEFAULT_SEND_TIMEOUT_S
from ft.server.settings import LOG_LEVELS, ServerSettings

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes in `text`: `1073741824`, `512MiB`, `1G`, `1.5GB` (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB, 1G or bytes)")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** _UNITS[unit.lower()])


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `ft serve`'s options to `parser`."""
    model = parser.add_argument_group("model")
    add_model_arguments(model)
    model.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients see and send (default: from the model)",
    )
    model.add_argument(
        "--tool-call-parser", default=None, help="parse tool calls out of chat output with this parser"
    )
    model.add_argument(
        "--reasoning-parser", default=None, help="split reasoning out of chat output with this parser"
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-running-requests", type=int, default=32, help="sequences decoded together (default: 32)"
    )
    engine.add_argument(
        "--max-queued-requests", type=int, default=256, help="waiting requests before 503 (default: 256)"
    )
    engine.add_argument(
        "--max-queue-wait",
        type=float,
        default=None,
        help="seconds a request may wait in the queue for its first step before a 503 with "
        "Retry-After (in-stream for a stream; default: no bound)",
    )
    engine.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=1024,
        help="prompt tokens per step (a quarter of it while other requests decode; default: 1024)",
    )
    engine.add_argument(
        "--num-pages", type=int, default=None, help="KV cache pages (overrides --kv-cache-memory)"
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=DEFAULT_KV_CACHE_MEMORY,
        help="KV cache budget, e.g. 512MiB, 1G, or bytes (default: 1GiB)",
    )
    engine.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    engine.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache element type; float16/bfloat16 hold 2x the tokens of float32 (default: the model's)",
    )
    engine.add_argument(
        "--step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="seconds work may wait with no step completing (a hung step, rank or scheduler) before "
        "the server fails every request, /health says why and it exits 1 "
        f"(default: {DEFAULT_STEP_TIMEOUT_S:g})",
    )
    engine.add_argument(
        "--template-timeout",
        type=float,
        default=DEFAULT_TEMPLATE_TIMEOUT_S,
        help="seconds the model's chat template may take to render one request before it is "
        f"refused with a 400 (default: {DEFAULT_TEMPLATE_TIMEOUT_S:g})",
    )
    engine.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default="need",
        help="need: admit on what a request needs now and preempt when short; "
        "reserve: reserve each request's whole budget (default: need)",
    )

    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=1941, help="bind port (default: 1941)")
    http.add_argument(
        "--api-key",
        default=os.environ.get("FT_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $FT_API_KEY; /health and /metrics stay open)",
    )
    http.add_argument(
        "--admin-key",
        default=os.environ.get("FT_ADMIN_KEY"),
        help="serve /v1/admin/* to any caller with 'Authorization: Bearer KEY' (default: $FT_ADMIN_KEY; "
        "unset, admin is loopback-only and refused through a proxy)",
    )
    http.add_argument(
        "--http2",
        action="store_true",
        help="also serve cleartext HTTP/2 (h2c); off by default: hypercorn buffers it without limit",
    )
    http.add_argument(
        "--cors-origins",
        type=_origins,
        default=(),
        help="comma-separated allowed origins, or '*' (default: no CORS)",
    )
    http.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=4 * 1024 * 1024,
        help="largest request body, else 413 (default: 4MiB)",
    )
    http.add_argument(
        "--sse-heartbeat-s",
        type=float,
        default=2.0,
        help="seconds between stream heartbeats while waiting (default: 2)",
    )
    http.add_argument(
        "--send-timeout",
        type=float,
        default=DEFAULT_SEND_TIMEOUT_S,
        help="seconds a client may accept no bytes before its connection is closed and its request "
        f"aborted (a client that stops reading has left; default: {DEFAULT_SEND_TIMEOUT_S:g})",
    )
    http.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs the API key too (default: open, like /health)",
    )

    ops = parser.add_argument_group("operations")
    ops.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM: seconds to finish in-flight requests before aborting them (default: 10)",
    )
    ops.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    ops.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object per line (default: text)",
    )
    ops.add_argument(
        "--log-prompts",
        action="store_true",
        help="add prompts and outputs to the end-of-request log lines (default: never logged)",
    )


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """The engine config and server settings `args` describe. Raises `ValueError`."""
    engine = EngineConfig(
        **model_config_fields(args),
        served_model_name=args.served_model_name,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        admission=args.admission,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        max_queued_requests=args.max_queued_requests,
        max_queue_wait_s=args.max_queue_wait,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        step_timeout_s=args.step_timeout,
        template_timeout_s=args.template_timeout,
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        admin_key=args.admin_key or None,
        http2=args.http2,
        cors_origins=args.cors_origins,
        max_body_bytes=args.max_body_bytes,
        sse_heartbeat_s=args.sse_heartbeat_s,
        send_timeout_s=args.send_timeout,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
        metrics_require_key=args.metrics_require_key,
        served_model_name=args.served_model_name,
    )
    return engine, settings


def run_serve(args: argparse.Namespace) -> int:
    """Run `ft serve` until SIGINT/SIGTERM; 0 after a clean drain, 1 when the engine failed
    (the model did not load, or a rank died or hangs), 2 for bad options.

    With `--tensor-parallel-size` above 1 under torchrun (`RANK` set), a process with `RANK > 0`
    is a rank process, not a server.
    """
    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0 and "WORLD_SIZE" in os.environ:
        from ft.engine.ranks import run_rank

        setup_logging(args.log_level, args.log_format)
        return run_rank(args.device)
    from ft.server.app import EngineFailed, serve

    try:
        engine, settings = configs_from_args(args)
    except ValueError as e:
        print(f"ft serve: {e}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        trio.run(serve, engine, settings)
    except EngineFailed as e:
        # A supervisor restarts a server that exits non-zero; the ranks are already stopped.
        print(f"ft serve: the engine failed: {e}", file=sys.stderr, flush=True)
        # NOTE: exit now, skipping the interpreter's teardown: a step's thread may still be
        # blocked where nothing can interrupt it (a hung kernel or collective), and tearing down
        # torch after a broken group took 5-7 s here. Everything the server owned is closed.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (`python -m ft.cli_serve`)."""
    parser = argparse.ArgumentParser(prog="ft serve", description=__doc__)
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
