"""The errors a request can end with; each knows the HTTP status it maps to at the edge."""

from __future__ import annotations


class FtError(Exception):
    """Base of every error `ft` raises to a request."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(FtError):
    """The client sent something the engine cannot serve (400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus max_tokens cannot fit the context or the KV pool (400)."""

    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class Overloaded(FtError):
    """The waiting queue is full; retry later (503 with Retry-After)."""

    status = 503
    type = "overloaded_error"


class EngineStopping(FtError):
    """The engine is draining or stopped and admits nothing new (503)."""

    status = 503
    type = "unavailable_error"


class RequestFailed(FtError):
    """The engine failed while serving this request (500, `server_error`)."""

    status = 500
    type = "server_error"


class RequestAborted(FtError):
    """The engine aborted the request (drain timeout or operator abort)."""

    status = 503
    type = "unavailable_error"
