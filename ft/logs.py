"""Logging for ft's commands: text or JSON lines, each naming the request it is about.

A record names its request by a `request_id` attribute: actors pass it explicitly
(`extra=entry.log_extra`); code running inside an HTTP request's task gets the id the server
set in `REQUEST_ID` (a context variable: hypercorn's and Quart's code in that task logs too, and
cannot be handed the id). A record may carry `fields`, a dict the JSON format adds as keys (the
end-of-request line's measurements).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

LOG_FORMATS = ("text", "json")

# The id of the HTTP request the current task serves (None outside one).
REQUEST_ID: ContextVar[str | None] = ContextVar("ft_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


# hypercorn's access log record carries the response's headers in its args under this key.
ACCESS_LOG_ID_KEY = "{x-request-id}o"

# What `setup_logging` last set (level, format): the processes this one starts log the same way.
_current = ("info", "text")


class RequestIdFilter(logging.Filter):
    """Give every record a `request_id`: its own, the current request's (or, for hypercorn's
    access log, the response's `X-Request-Id`), or None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            args = record.args
            from_access_log = args.get(ACCESS_LOG_ID_KEY) if isinstance(args, Mapping) else None
            record.request_id = from_access_log or REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger [request id or -] message`."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None) is None:
            record.request_id = "-"  # one handler formats a record: the mark stays its own
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `ts`, `level`, `logger`, `msg`, `request_id` (when the record is
    about a request), the record's `fields`, and `exc` for an exception's traceback."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            obj["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            obj.update(fields)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=True, default=str)


def _iso_time(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def setup_logging(level: str = "info", log_format: str = "text") -> None:
    """Send every logger's records to stderr in `log_format` ("text" or "json") from `level` up.

    Replaces the root logger's handlers, so calling it again switches the format.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    global _current
    _current = (level, log_format)


def logging_args() -> list[str]:
    """`--log-level L --log-format F` as `setup_logging` last set them, for a child process."""
    level, log_format = _current
    return ["--log-level", level, "--log-format", log_format]
