"""Request ids, the record of each HTTP request, and its one log line when it ends.

`Tracing` wraps the app at the ASGI level, so it sees every request — errors, streams, 404s,
clients that leave — from the first byte to the last: it picks the request's id (a valid
incoming `X-Request-Id`, or a new one), returns it as the `X-Request-Id` response header, sets
`ft.logs.REQUEST_ID` for the request's task, and when the request ends logs one line and counts
it in the metrics. Routes add what they know to the `RequestRecord` (`current_record()`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ft.errors import EngineStopping, FtError, Overloaded, RequestAborted
from ft.ids import random_id
from ft.logs import REQUEST_ID

log = logging.getLogger("ft.request")

REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_LEN = 128
# Probes and scrapers: their end-of-request line is DEBUG, so a load balancer's health checks
# do not flood the log.
QUIET_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Any, Any, Any], Awaitable[None]]  # hypercorn's typed ASGI callables fit


def valid_request_id(value: str) -> bool:
    """True for 1 to 128 printable ASCII characters without spaces (0x21-0x7E)."""
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and all("!" <= c <= "~" for c in value)


def request_id_from(headers: list[tuple[bytes, bytes]]) -> tuple[str, bool]:
    """The request's id: the first `X-Request-Id` if valid, else a new one; and whether it was
    replaced (present but invalid)."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if valid_request_id(text):
                return text, False
            return random_id("req-"), True
    return random_id("req-"), False


@dataclass
class RequestRecord:
    """What one HTTP request did, filled in as it runs (`Tracing` and the routes)."""

    request_id: str
    method: str = ""
    path: str = ""
    started_at: float = field(default_factory=time.perf_counter)
    status: int | None = None
    route: str | None = None  # the generation route that served it (metrics label); else None
    stream: bool = False
    model: str | None = None  # router mode: the model the request named (metrics label)
    tenant: str | None = None  # who sent it (`ft.server.edge.tenants`: None with one API key or none)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    tool_calls: bool = False
    error: FtError | None = None
    is_sent: bool = False  # the whole response went out
    client_left: bool = False
    prompts: list[Any] = field(default_factory=list)  # with --log-prompts only
    outputs: list[str] = field(default_factory=list)  # with --log-prompts only
    is_traced: bool = False  # made by `Tracing`, which calls `releases` when the request ends
    releases: list[Callable[[], None]] = field(default_factory=list)

    def release_at_end(self, release: Callable[[], None]) -> bool:
        """Call `release` (synchronous) when the HTTP request ends, however it ends; False
        (and nothing is kept) when no `Tracing` serves this record."""
        if self.is_traced:
            self.releases.append(release)
        return self.is_traced

    def saw_token(self) -> None:
        """Note that output reached the request (the first time: its time to first token)."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    @property
    def finish_reason(self) -> str | None:
        """One reason for the whole request: abort (the client left, or a drain aborted it),
        error, tool_calls if any choice called a tool, length if any was cut, else stop."""
        if self.client_left or isinstance(self.error, RequestAborted):
            return "abort"
        if self.error is not None and self.status is not None and self.status < 400:
            return "error"  # failed after its headers went out
        if self.error is not None:
            return "error" if self.error.status >= 500 else None
        if not self.finish_reasons:
            return None
        if self.tool_calls:
            return "tool_calls"
        return "length" if "length" in self.finish_reasons else "stop"

    @property
    def rejection(self) -> str | None:
        """Why the request was refused before it ran (a label), or None if it was not."""
        err, status = self.error, self.status
        if err is None or isinstance(err, RequestAborted) or status is None:
            return None
        if status < 400 or (status >= 500 and status != 503):
            return None
        if isinstance(err, Overloaded):
            return "overload"
        if isinstance(err, EngineStopping):
            codes = {"model_loading": "loading", "engine_error": "error", "model_load_failed": "error"}
            return codes.get(err.code or "", "stopping")
        if err.code == "models_busy":  # router mode: no model could be unloaded to make room
            return "overload"
        if status in (401, 403):
            return "auth"
        return "validation"

    def fields(self, log_prompts: bool) -> dict[str, Any]:
        """The end-of-request line's fields (JSON keys)."""
        now = time.perf_counter()
        out: dict[str, Any] = {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_s": round(now - self.started_at, 4),
            "client_left": self.client_left,
        }
        if self.route is not None:
            ttft = None if self.first_token_at is None else round(self.first_token_at - self.started_at, 4)
            out |= {
                "stream": self.stream,
                "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens,
                "ttft_s": ttft,
                "finish_reason": self.finish_reason,
            }
        if self.error is not None:
            out["error"] = self.error.code or self.error.type
        if log_prompts and self.route is not None:
            out |= {"prompt": self.prompts, "output": self.outputs}
        return out


_RECORD: ContextVar[RequestRecord | None] = ContextVar("ft_request_record", default=None)


def current_record() -> RequestRecord:
    """The record of the HTTP request this task serves (a detached one outside `Tracing`)."""
    record = _RECORD.get()
    return record if record is not None else RequestRecord(REQUEST_ID.get() or random_id("req-"))


class Tracing:
    """ASGI middleware: request ids, the `RequestRecord`, the end-of-request line.

    `on_end(record)` runs when a request ends (synchronously: it may be in a cancelled task).
    """

    def __init__(
        self,
        app: AsgiApp,
        on_end: Callable[[RequestRecord], None],
        *,
        log_prompts: bool = False,
    ) -> None:
        self.app = app
        self.on_end = on_end
        self.log_prompts = log_prompts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id, replaced = request_id_from(scope.get("headers", []))
        record = RequestRecord(
            request_id, method=scope.get("method", ""), path=scope.get("path", ""), is_traced=True
        )
        # Set in this task before the app spawns the request's tasks, which copy the context.
        id_token, record_token = REQUEST_ID.set(request_id), _RECORD.set(record)
        if replaced:
            log.debug("replaced an invalid X-Request-Id header")

        async def traced_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not record.is_sent:
                record.client_left = True
            return message

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record.is_sent = True
            await send(message)

        try:
            await self.app(scope, traced_receive, traced_send)
        finally:
            if not record.is_sent:
                record.client_left = True  # cancelled, or the connection broke mid-response
            for release in record.releases:
                release()
            self._end(record)
            REQUEST_ID.reset(id_token)
            _RECORD.reset(record_token)

    def _end(self, record: RequestRecord) -> None:
        fields = record.fields(self.log_prompts)
        level = logging.DEBUG if record.path in QUIET_PATHS else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "%s", _summary(fields), extra={"request_id": record.request_id, "fields": fields})
        self.on_end(record)


def _summary(fields: dict[str, Any]) -> str:
    """The text form of the end-of-request line: `POST /path 200 key=value ...`.

    The path arrives percent-decoded (`%0A` is a newline): one with anything but printable
    ASCII is quoted, so a URL cannot forge a log line or reach a terminal as escape codes.
    """
    path = str(fields["path"])
    if not all("!" <= c <= "~" for c in path):
        path = json.dumps(path, ensure_ascii=True)
    head = f"{fields['method']} {path} {fields['status']}"
    rest = " ".join(
        f"{k}={json.dumps(v, ensure_ascii=True) if isinstance(v, (str, list)) else v}"
        for k, v in fields.items()
        if k not in ("method", "path", "status")
    )
    return f"{head} {rest}"
