"""Errors at the HTTP edge: one JSON body shape per API, never a 500 for client input.

Every error a route raises is an `FtError` (the engine's, or `HttpError` for statuses the engine
never produces: 401, 403, 404, 405, 413). The app's handlers turn it into a JSON response whose
body shape depends on the API the path belongs to (`ServerContext.error_formats`), so the
Anthropic and Responses routes reuse the same handlers with their own formatter.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ft.errors import EngineStopping, FtError, Overloaded

log = logging.getLogger("ft.server")

ErrorFormatter = Callable[[FtError], dict[str, Any]]


class HttpError(FtError):
    """An edge error with an explicit status (401, 403, 404, 405, 413, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = type
        self.headers = dict(headers or {})


def openai_error_body(err: FtError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
        }
    }


def dumps(obj: Any) -> str:
    """Compact JSON; non-ASCII escaped, so a lone surrogate in a message stays valid JSON."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def error_headers(err: FtError) -> dict[str, str]:
    """Headers an error response carries: `Retry-After` when retrying can succeed."""
    headers = dict(getattr(err, "headers", {}))
    if isinstance(err, (Overloaded, EngineStopping)) or err.code == "model_loading":
        headers.setdefault("Retry-After", "1")
    return headers


def internal_error(exc: BaseException) -> FtError:
    """A generic `server_error` for an unexpected exception (logged, never shown)."""
    log.error("unexpected error while serving a request", exc_info=exc)
    return HttpError(500, "internal server error", type="server_error", code="internal_error")
