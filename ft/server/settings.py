"""ServerSettings: the HTTP layer's configuration (the engine's is `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ft.core.reasoning import REASONING_PARSERS
from ft.core.toolcalls import TOOL_CALL_PARSERS
from ft.logs import LOG_FORMATS
from ft.server.edge.slow_clients import DEFAULT_SEND_TIMEOUT_S
from ft.server.edge.tenants import MAX_API_KEYS
from ft.server.responses.store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How the server listens, authenticates and frames responses.

    `api_keys` are the keys a request may carry, each its own tenant when there are several
    (`ft.server.edge.tenants`: the prefix cache is partitioned per key); `api_key` is one more,
    first among them (`all_api_keys`; none at all disables auth). At most 4096 keys, none
    empty; a key given twice is one key. `admin_key` set lets admin routes be called from anywhere
    with that key; None keeps them to loopback callers that did not come through a proxy.
    `cors_origins` empty sends no CORS headers; `("*",)` allows any origin (never for admin
    routes). `strict_model_names` refuses (404 `model_not_found`) a request whose `model` is not
    a name of the served model (`ft.model_names`); off, any name is served by the one model,
    as llama-server does, and responses name the model that answered. `tool_call_parser` and
    `reasoning_parser` name the output formats parsed out of chat output (None: tool calls in
    the Hermes format when a request has tools; the reasoning format of the model's family —
    `think` for Qwen3 — else no reasoning split). `port` 0 binds a free port
    (tests). `http2` enables cleartext HTTP/2 (h2c), which hypercorn buffers without
    back-pressure; off, only HTTP/1.x is served.
    `drain_timeout_s` bounds the drain on SIGINT/SIGTERM (then the aborted requests get
    `ft.config.DEFAULT_ABORT_TIMEOUT_S`); `graceful_timeout_s` is hypercorn's for open
    connections once it stops. `log_format` is "text" or "json";
    `log_prompts` adds prompts and outputs to the end-of-request log lines.
    `send_timeout_s`: a connection whose client accepts no bytes for that long is closed (a
    client that stops reading is a client that left: its request is aborted).
    `metrics_require_key` puts `/metrics` behind the API keys (open by default, like `/health`).
    `web_ui` serves the chat page at `/` (`ft.server.web`); off, `/` answers the JSON status.
    `response_store_*` bound the `/v1/responses` store (`ft.server.responses.store`): at most
    `max_entries` responses and `bytes` of JSON in all (least recently used out first), none
    kept past `max_age_s` seconds (oldest out first).
    """

    host: str = "127.0.0.1"
    port: int = 1941
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    sse_heartbeat_s: float = 2.0
    drain_timeout_s: float = 10.0
    log_level: str = "info"
    log_format: str = "text"
    log_prompts: bool = False
    metrics_require_key: bool = False
    strict_model_names: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    graceful_timeout_s: float = 3.0
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    admin_key: str | None = None
    http2: bool = False
    web_ui: bool = True
    response_store_max_entries: int = DEFAULT_MAX_ENTRIES
    response_store_bytes: int = DEFAULT_MAX_BYTES
    response_store_max_age_s: float = DEFAULT_MAX_AGE_S

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to disable auth)")
        if not all(self.api_keys):
            raise ValueError("api_keys must not hold an empty key")
        if len(self.all_api_keys) > MAX_API_KEYS:
            raise ValueError(f"at most {MAX_API_KEYS} API keys, got {len(self.all_api_keys)}")
        if self.admin_key is not None and not self.admin_key:
            raise ValueError("admin_key must not be empty (omit it to keep admin loopback-only)")
        if not 1024 <= self.max_body_bytes <= 1 << 30:
            raise ValueError(f"max_body_bytes must be in 1024..2**30, got {self.max_body_bytes}")
        if not 0.05 <= self.sse_heartbeat_s <= 600:
            raise ValueError(f"sse_heartbeat_s must be in 0.05..600, got {self.sse_heartbeat_s}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"drain_timeout_s must be in 0..3600, got {self.drain_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
        if not 0 <= self.graceful_timeout_s <= 600:
            raise ValueError(f"graceful_timeout_s must be in 0..600, got {self.graceful_timeout_s}")
        if not 0.1 <= self.send_timeout_s <= 3600:
            raise ValueError(f"send_timeout_s must be in 0.1..3600, got {self.send_timeout_s}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        if not 1 <= self.response_store_max_entries <= 1 << 20:
            raise ValueError(
                f"response_store_max_entries must be in 1..2**20, got {self.response_store_max_entries}"
            )
        if not 1024 <= self.response_store_bytes <= 1 << 40:
            raise ValueError(f"response_store_bytes must be in 1024..2**40, got {self.response_store_bytes}")
        if not 1 <= self.response_store_max_age_s <= 366 * 86400:
            raise ValueError(
                f"response_store_max_age_s must be in 1..{366 * 86400} (a year), "
                f"got {self.response_store_max_age_s}"
            )

    @property
    def all_api_keys(self) -> tuple[str, ...]:
        """Every key a request may carry: `api_key` first, then `api_keys`, each once."""
        first = (self.api_key,) if self.api_key is not None else ()
        return tuple(dict.fromkeys(first + self.api_keys))
