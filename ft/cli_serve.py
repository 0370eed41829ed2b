"""`ft serve`: the OpenAI-compatible HTTP server on the engine (options and entry point)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from functools import partial

import trio

from ft.config import (
    ADMISSIONS,
    ENGINE_DEFAULTS,
    KV_CACHE_DTYPES,
    POOLING_CHOICES,
    EngineConfig,
    add_model_arguments,
    model_config_fields,
)
from ft.core.reasoning import REASONING_PARSERS
from ft.core.toolcalls import TOOL_CALL_PARSERS
from ft.logs import LOG_FORMATS, setup_logging
from ft.server.edge.tenants import MAX_API_KEYS
from ft.server.models import RouterSettings, ServedModel, discover_models, parse_model_option
from ft.server.settings import LOG_LEVELS, ServerSettings

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
MAX_API_KEY_FILE_BYTES = 1 << 20


def parse_size(text: str) -> int:
    """Bytes in `text`: `1073741824`, `512MiB`, `1G`, `1.5GB` (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB, 1G or bytes)")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** _UNITS[unit.lower()])


def format_size(size: int) -> str:
    """`size` bytes the way `parse_size` reads it back: `1GiB`, `4MiB`, `1536KiB`, `1000`."""
    for unit, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if size and size % 1024**power == 0:
            return f"{size // 1024**power}{unit}"
    return str(size)


def read_api_key_file(path: str) -> tuple[str, ...]:
    """The API keys in `path`: one a line, surrounding spaces stripped, blank lines and lines
    starting with `#` skipped, a leading BOM dropped; a file with no key is refused. Raises
    `argparse.ArgumentTypeError` (the message never holds a key)."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # a leading BOM is not part of a key
            lines = f.read(MAX_API_KEY_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read API keys from {path!r}: {type(e).__name__}") from None
    if len(lines) > MAX_API_KEY_FILE_BYTES:
        raise argparse.ArgumentTypeError(f"{path!r} is over {MAX_API_KEY_FILE_BYTES} bytes")
    keys = tuple(k for k in (line.strip() for line in lines.splitlines()) if k and not k.startswith("#"))
    if not keys:  # NOTE: a file with no keys must not turn authentication off
        raise argparse.ArgumentTypeError(f"{path!r} holds no API key")
    if len(keys) > MAX_API_KEYS:
        raise argparse.ArgumentTypeError(f"{path!r} holds {len(keys)} keys; at most {MAX_API_KEYS}")
    return keys


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


# The defaults `ft serve` shows and uses: read from the records, written once (there).
_E = ENGINE_DEFAULTS
_S = ServerSettings()
_R = RouterSettings(models=(ServedModel("default", "default"),))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `ft serve`'s options to `parser`; every default is the `EngineConfig` or
    `ServerSettings` field's, and every help ends with `(default: ...)` (the README's options
    table says the same, `tests/test_readme_options.py`)."""
    model = parser.add_argument_group("model")
    add_model_arguments(model, several=True)
    model.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=_E.served_model_name,
        help="the model id responses and /v1/models show; with several, the first is shown and "
        "every one is accepted (default: the model file's name)",
    )
    model.add_argument(
        "--strict-model-names",
        action="store_true",
        default=_S.strict_model_names,
        help="refuse (404) a request whose model is not a name of the served model; off, any name "
        "is served by it (default: off)",
    )
    model.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=_S.tool_call_parser,
        help="the format tool calls are parsed out of chat output in (default: the model "
        "family's, else the one its chat template spells (qwen3_coder for Qwen3-Coder's and "
        "Qwen3.5's XML), else hermes, when a request has tools)",
    )
    model.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=_S.reasoning_parser,
        help="split reasoning out of chat output with this parser (default: the model family's: "
        "think for Qwen3, Qwen3.5 and Qwen3-Next, gemma4 for Gemma 4, else none (the format of "
        "a block the prompt's template leaves open, such as <think>))",
    )

    models = parser.add_argument_group("several models (router mode)")
    models.add_argument(
        "--models-dir",
        metavar="DIR",
        default=None,
        help="serve every *.gguf file and Hugging Face model folder in DIR, by its file or folder "
        "name, each loaded on demand (default: none)",
    )
    models.add_argument(
        "--models-max",
        metavar="N",
        type=int,
        default=_R.max_loaded,
        help="the most models loaded at once; loading another unloads the least recently used "
        "idle one (default: no limit)",
    )
    models.add_argument(
        "--models-memory",
        metavar="SIZE",
        type=parse_size,
        default=_R.memory_bytes,
        help="the most memory the loaded models may cost together (weights + KV budget each), "
        "e.g. 8GiB; the least recently used idle ones are unloaded to make room (default: no limit)",
    )
    models.add_argument(
        "--sleep-idle-seconds",
        metavar="S",
        type=float,
        default=_R.sleep_idle_s,
        help="unload a model nobody used for S seconds; probes, /metrics, /v1/models and /v1/stats "
        "do not count as use (default: never)",
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-running-requests",
        metavar="N",
        type=int,
        default=_E.max_running_requests,
        help="sequences decoded together (default: %(default)s)",
    )
    engine.add_argument(
        "--max-queued-requests",
        metavar="N",
        type=int,
        default=_E.max_queued_requests,
        help="waiting requests before 503 (default: %(default)s)",
    )
    engine.add_argument(
        "--max-queue-wait",
        metavar="S",
        type=float,
        default=_E.max_queue_wait_s,
        help="seconds a request may wait in the queue for its first step before a 503 with "
        "Retry-After, in-stream for a stream (default: none)",
    )
    engine.add_argument(
        "--max-prefill-tokens",
        metavar="N",
        type=int,
        default=_E.max_prefill_tokens,
        help="prompt tokens per step, a quarter of it while other requests decode (default: %(default)s)",
    )
    engine.add_argument(
        "--num-pages",
        metavar="N",
        type=int,
        default=_E.num_pages,
        help="KV cache pages, overriding --kv-cache-memory (default: from --kv-cache-memory)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        type=parse_size,
        default=_E.kv_cache_memory,
        help=f"KV cache budget, e.g. 512MiB, 1G, or bytes (default: {format_size(_E.kv_cache_memory)})",
    )
    engine.add_argument(
        "--page-size",
        metavar="N",
        type=int,
        default=_E.page_size,
        help="tokens per KV page (default: %(default)s)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=_E.kv_cache_dtype,
        help="KV cache element type; float16/bfloat16 hold 2x the tokens of float32; q8_0 (int8 blocks "
        "of 32 with a scale, packed GGUF path on the CPU only) 1.88x those of float16; auto is float16 "
        "for packed GGUF weights, else the compute dtype (default: %(default)s)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_E.enable_prefix_caching,
        help="reuse the KV pages of prompt prefixes already computed (default: on)",
    )
    engine.add_argument(
        "--state-snapshots",
        metavar="N",
        type=int,
        default=_E.state_snapshots,
        help="models with recurrent layers (LFM2): snapshots of sequences' states kept for prefix "
        "reuse, beside one slot per running request; 0 turns their prefix cache off (default: %(default)s)",
    )
    engine.add_argument(
        "--prompt-cache-dir",
        metavar="DIR",
        default=_E.prompt_cache_dir,
        help="keep full prompt KV pages in files in DIR too (one server per DIR), so they come back "
        "after evictions and restarts (default: off)",
    )
    engine.add_argument(
        "--prompt-cache-size",
        metavar="SIZE",
        type=parse_size,
        default=_E.prompt_cache_size,
        help="the most bytes --prompt-cache-dir holds; least recently used pages go first "
        f"(default: {format_size(_E.prompt_cache_size)})",
    )
    engine.add_argument(
        "--tokenizer-workers",
        metavar="N",
        type=int,
        default=_E.tokenizer_workers,
        help="processes that render chat templates and tokenize prompts (default: %(default)s)",
    )
    engine.add_argument(
        "--pooling",
        choices=POOLING_CHOICES,
        default=_E.pooling,
        help="how /v1/embeddings, /v1/rerank and /v1/score pool an input's hidden states: their "
        "mean, the first token's or the last token's; rank: a reranker's, the last token's through "
        "its classification head, each (query, document) pair one sequence; auto is the GGUF's "
        "pooling_type, rank for a *ForSequenceClassification, else last (default: %(default)s)",
    )
    engine.add_argument(
        "--step-timeout",
        metavar="S",
        type=float,
        default=_E.step_timeout_s,
        help="seconds work may wait with no step completing (a hung step, rank or scheduler) before "
        "the server fails every request, /health says why and it exits 1 (default: %(default)g)",
    )
    engine.add_argument(
        "--template-timeout",
        metavar="S",
        type=float,
        default=_E.template_timeout_s,
        help="seconds the model's chat template may take to render one request before it is "
        "refused with a 400 (default: %(default)g)",
    )
    engine.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default=_E.admission,
        help="need: admit on what a request needs now and preempt when short; "
        "reserve: reserve each request's whole budget (default: %(default)s)",
    )

    http = parser.add_argument_group("http")
    http.add_argument("--host", metavar="ADDR", default=_S.host, help="bind address (default: %(default)s)")
    http.add_argument(
        "--port", metavar="N", type=int, default=_S.port, help="bind port (default: %(default)s)"
    )
    http.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY'; /health and /metrics stay open; repeat it (or "
        "--api-key-file) for several keys, each a tenant with its own prefix cache "
        "(default: $FT_API_KEY)",
    )
    http.add_argument(
        "--api-key-file",
        metavar="FILE",
        type=read_api_key_file,
        default=_S.api_keys,
        help=f"more API keys, one a line ('#' starts a comment line), at most {MAX_API_KEYS} in all "
        "(default: none)",
    )
    http.add_argument(
        "--admin-key",
        metavar="KEY",
        default=os.environ.get("FT_ADMIN_KEY", _S.admin_key),
        help="serve /v1/admin/* to any caller with 'Authorization: Bearer KEY'; unset, admin is "
        "loopback-only and refused through a proxy (default: $FT_ADMIN_KEY)",
    )
    http.add_argument(
        "--http2",
        action="store_true",
        default=_S.http2,
        help="also serve cleartext HTTP/2 (h2c); hypercorn buffers it without limit (default: off)",
    )
    http.add_argument(
        "--cors-origins",
        metavar="LIST",
        type=_origins,
        default=_S.cors_origins,
        help="comma-separated allowed origins, or '*' (default: none)",
    )
    http.add_argument(
        "--max-body-bytes",
        metavar="SIZE",
        type=parse_size,
        default=_S.max_body_bytes,
        help=f"largest request body, else 413 (default: {format_size(_S.max_body_bytes)})",
    )
    http.add_argument(
        "--response-store-max-entries",
        metavar="N",
        type=int,
        default=_S.response_store_max_entries,
        help="the most responses /v1/responses keeps for GET and previous_response_id; the least "
        "recently used go first (default: %(default)s)",
    )
    http.add_argument(
        "--response-store-size",
        metavar="SIZE",
        type=parse_size,
        default=_S.response_store_bytes,
        help="the most bytes of JSON the stored responses hold in all, e.g. 256MiB; the least "
        f"recently used go first (default: {format_size(_S.response_store_bytes)})",
    )
    http.add_argument(
        "--response-store-max-age",
        metavar="S",
        type=float,
        default=_S.response_store_max_age_s,
        help="seconds a stored response is kept; then it is gone, as if deleted (default: %(default)g)",
    )
    http.add_argument(
        "--sse-heartbeat-s",
        metavar="S",
        type=float,
        default=_S.sse_heartbeat_s,
        help="seconds between stream heartbeats while waiting (default: %(default)g)",
    )
    http.add_argument(
        "--send-timeout",
        metavar="S",
        type=float,
        default=_S.send_timeout_s,
        help="seconds a client may accept no bytes before its connection is closed and its request "
        "aborted; a client that stops reading has left (default: %(default)g)",
    )
    http.add_argument(
        "--metrics-require-key",
        action="store_true",
        default=_S.metrics_require_key,
        help="/metrics needs the API key too; off, it is open like /health (default: off)",
    )
    http.add_argument(
        "--web-ui",
        action=argparse.BooleanOptionalAction,
        default=_S.web_ui,
        help="serve the chat page at / (its files need no key; its API calls do) (default: on)",
    )

    ops = parser.add_argument_group("operations")
    ops.add_argument(
        "--drain-timeout",
        metavar="S",
        type=float,
        default=_S.drain_timeout_s,
        help="on SIGINT/SIGTERM: seconds to finish in-flight requests before aborting them "
        "(default: %(default)g)",
    )
    ops.add_argument(
        "--log-level",
        metavar="LEVEL",
        choices=LOG_LEVELS,
        default=_S.log_level,
        help="(default: %(default)s)",
    )
    ops.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=_S.log_format,
        help="text lines, or one JSON object per line (default: %(default)s)",
    )
    ops.add_argument(
        "--log-prompts",
        action="store_true",
        default=_S.log_prompts,
        help="add prompts and outputs to the end-of-request log lines; never logged otherwise (default: off)",
    )


def router_from_args(args: argparse.Namespace) -> RouterSettings | None:
    """Router mode's settings when `args` ask for it (several `--model`s, `--models-dir`, or a
    router flag); None for one model, served as always. Raises `ValueError`."""
    given = [parse_model_option(m) for m in args.model or ()]
    is_router = (
        len(given) > 1
        or args.models_dir is not None
        or args.models_max is not None
        or args.models_memory is not None
        or args.sleep_idle_seconds is not None
    )
    if not is_router:
        return None
    if args.served_model_name is not None:
        raise ValueError("--served-model-name names one model; with several, name each --model NAME=PATH")
    models = given + (discover_models(args.models_dir) if args.models_dir is not None else [])
    if not models:
        raise ValueError("router mode needs a --model or a --models-dir")
    return RouterSettings(
        models=tuple(models),
        max_loaded=args.models_max,
        memory_bytes=args.models_memory,
        sleep_idle_s=args.sleep_idle_seconds,
        unload_timeout_s=args.drain_timeout,
    )


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Every `--api-key` (else `$FT_API_KEY`), then the `--api-key-file`'s keys."""
    given = args.api_key if args.api_key is not None else [os.environ.get("FT_API_KEY", "")]
    return tuple(k for k in given if k) + tuple(args.api_key_file)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """The engine config and server settings `args` describe (with several models, the config
    each model's is made from). Raises `ValueError`."""
    served = args.served_model_name
    fields = model_config_fields(args)
    models = [parse_model_option(m) for m in args.model or ()]
    fields["model"] = models[0].path if models else None
    if len(models) == 1 and served is None and models[0].path != args.model[0]:
        served = [models[0].name]  # one `--model NAME=PATH`: served as NAME
    engine = EngineConfig(
        **fields,
        served_model_name=tuple(served) if served is not None else None,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        admission=args.admission,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        max_queued_requests=args.max_queued_requests,
        max_queue_wait_s=args.max_queue_wait,
        enable_prefix_caching=args.enable_prefix_caching,
        state_snapshots=args.state_snapshots,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_size=args.prompt_cache_size,
        tokenizer_workers=args.tokenizer_workers,
        step_timeout_s=args.step_timeout,
        pooling=args.pooling,
        template_timeout_s=args.template_timeout,
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_keys=api_keys_from_args(args),
        admin_key=args.admin_key or None,
        http2=args.http2,
        cors_origins=args.cors_origins,
        max_body_bytes=args.max_body_bytes,
        response_store_max_entries=args.response_store_max_entries,
        response_store_bytes=args.response_store_size,
        response_store_max_age_s=args.response_store_max_age,
        sse_heartbeat_s=args.sse_heartbeat_s,
        send_timeout_s=args.send_timeout,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
        metrics_require_key=args.metrics_require_key,
        web_ui=args.web_ui,
        strict_model_names=args.strict_model_names,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
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
        router = router_from_args(args)
    except ValueError as e:
        print(f"ft serve: {e}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        trio.run(partial(serve, engine, settings, router=router, freeze_heap=True))
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
