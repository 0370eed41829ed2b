"""Server-sent events: framing, the streaming response, and waiting on streams with heartbeats.

A streaming route returns `sse_response(gen)`; `gen` is an async generator that yields
`CONNECTED` first, then opens its engine request(s) and yields `sse_data(...)` frames. It must
never hold a nursery or cancel scope across a `yield` (the consumer is Quart's sender), so
waiting on several streams at once is done by `DeltaMux.next`, which opens and closes its
nursery within one call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from quart import Response

from ft.engine.stream import RequestStream
from ft.errors import FtError
from ft.messages import Delta
from ft.server.edge.http_errors import ErrorFormatter, openai_error_body

CONNECTED = b": connected\n\n"
HEARTBEAT = b": heartbeat\n\n"
DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(obj: Any) -> bytes:
    """One `data:` frame holding `obj` as JSON."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode("utf-8", errors="replace") + b"\n\n"


def sse_event(event: str, obj: Any) -> bytes:
    """One named event (`event: <name>` then `data:`), as Anthropic-style streams use."""
    return f"event: {event}\n".encode() + sse_data(obj)


def sse_error(
    err: FtError, formatter: ErrorFormatter = openai_error_body, *, event: str | None = None
) -> bytes:
    """An in-stream error frame (named `event` when given, as Anthropic's `error`); valid JSON
    whatever the message holds."""
    text = json.dumps(formatter(err), separators=(",", ":"))  # ASCII-escaped: always encodable
    name = f"event: {event}\n".encode("ascii") if event is not None else b""
    return name + b"data: " + text.encode("ascii") + b"\n\n"


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> Response:
    """A `text/event-stream` response whose body is produced by `body` as the client reads."""
    response = Response(body, status=200, content_type="text/event-stream")
    response.headers.update(SSE_HEADERS | (headers or {}))
    response.timeout = None  # streams may outlive any timeout
    return response


@dataclass
class MuxResult:
    """What one `DeltaMux.next` call saw: deltas by stream index, or nothing (a timeout)."""

    deltas: list[tuple[int, Delta]] = field(default_factory=list)
    is_timeout: bool = False


class DeltaMux:
    """Waits on several request streams at once; each call returns whatever arrived first.

    Cancelling a stream's `__anext__` loses no event, so racing them and cancelling the losers
    is safe. No task outlives a call, so the caller may `yield` between calls.
    """

    def __init__(self, streams: Sequence[RequestStream]) -> None:
        self.streams = list(streams)
        self._open = set(range(len(self.streams)))

    @property
    def is_done(self) -> bool:
        """True once every stream has ended."""
        return not self._open

    async def next(self, timeout_s: float) -> MuxResult:
        """Deltas from whichever streams produce first; an empty timeout result after `timeout_s`.

        Raises the first stream error (`FtError`) seen.
        """
        result = MuxResult()
        errors: list[BaseException] = []
        if len(self._open) == 1:
            (k,) = self._open
            with trio.move_on_after(timeout_s) as scope:
                await self._one(k, result, errors, None)
            result.is_timeout = scope.cancelled_caught
        else:
            with trio.move_on_after(timeout_s) as scope:
                async with trio.open_nursery() as nursery:
                    for k in sorted(self._open):
                        nursery.start_soon(self._one, k, result, errors, nursery.cancel_scope)
            result.is_timeout = scope.cancelled_caught and not result.deltas and not errors
        if errors:
            raise errors[0]
        return result

    async def _one(
        self,
        k: int,
        result: MuxResult,
        errors: list[BaseException],
        done: trio.CancelScope | None,
    ) -> None:
        try:
            delta = await self.streams[k].__anext__()
        except StopAsyncIteration:
            self._open.discard(k)
        except Exception as e:  # noqa: BLE001 - handed to the caller, raised there
            errors.append(e)
        else:
            result.deltas.append((k, delta))
        if done is not None:
            done.cancel()
