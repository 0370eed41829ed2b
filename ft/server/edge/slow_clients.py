"""A client that stops reading is a client that left: every socket write has a deadline.

hypercorn writes each response chunk with `send_all` inside a *shielded* cancel scope, with no
timeout: a client that never reads (its receive window at 0) blocks that write forever, and no
cancellation reaches it. The request's scope stays open across the blocked `yield`, so the
client holds its admission slot, and the server's shutdown waits for the write for ever.

`GuardedTCPServer` keeps hypercorn's shield (a write cut short must not leave a half-sent
frame on a live connection) but gives it a deadline: `send_timeout_s` for each 64 KiB piece
of a write, or the server's closing deadline once it stops, whichever is first. A write that misses
it closes the connection, which hypercorn reports to the app as a disconnect: the response
generator is cancelled and the request's scope frees what it held, as for a client that left.
So a client can hold a connection only while it reads, and a stopping server waits at most its
graceful timeout for any socket.

hypercorn has no option for this; `install()` puts the subclass where its trio worker looks the
class up. Only configs of type `FtHypercornConfig` are guarded.
"""

from __future__ import annotations

import logging
import math

import hypercorn.trio.run
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("ft.server")

DEFAULT_SEND_TIMEOUT_S = 30.0
# Bytes a client must accept within the send timeout: a write is sent in pieces of this size,
# each with the deadline, so the timeout bounds a client that accepts nothing, not a large body.
WRITE_PIECE_BYTES = 64 * 1024


class SendDeadlines:
    """The deadlines of a server's socket writes: `timeout_s` each, or `close_all`'s deadline."""

    def __init__(self, timeout_s: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.closing_at = math.inf  # set once the server stops: no write outlives it
        self._live: set[trio.CancelScope] = set()

    def deadline(self) -> float:
        """The deadline of a write that starts now."""
        return min(trio.current_time() + self.timeout_s, self.closing_at)

    def open(self) -> trio.CancelScope:
        """A shielded scope for one write, ended by its deadline (and by `close_all`)."""
        scope = trio.CancelScope(shield=True, deadline=self.deadline())
        self._live.add(scope)
        return scope

    def done(self, scope: trio.CancelScope) -> None:
        """Forget a finished write's scope."""
        self._live.discard(scope)

    def close_all(self, deadline: float) -> None:
        """No write may last past `deadline`, the ones under way included (synchronous)."""
        self.closing_at = min(self.closing_at, deadline)
        for scope in self._live:
            scope.deadline = min(scope.deadline, self.closing_at)


class GuardedTCPServer(TCPServer):
    """hypercorn's trio TCP connection with a deadline on every write (module docstring)."""

    async def protocol_send(self, event: Event) -> None:
        """Write `event`'s bytes before the deadline, or close the connection."""
        deadlines = getattr(self.config, "send_deadlines", None)
        if not isinstance(event, RawData) or not isinstance(deadlines, SendDeadlines):
            return await super().protocol_send(event)
        async with self.send_lock:
            scope = deadlines.open()
            try:
                with scope:
                    # NOTE: one write can be a whole non-streamed body (megabytes): the deadline
                    # bounds each piece, so a client that reads slowly but steadily is not cut.
                    data = memoryview(event.data)
                    for start in range(0, len(data), WRITE_PIECE_BYTES):
                        scope.deadline = deadlines.deadline()
                        await self.stream.send_all(data[start : start + WRITE_PIECE_BYTES])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
            finally:
                deadlines.done(scope)
            if not scope.cancelled_caught:
                return
            log.info("closing a connection whose client read nothing for %.3g s", deadlines.timeout_s)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()  # a cut write leaves the stream unusable
                await self.protocol.handle(Closed())


def install() -> None:
    """Make hypercorn's trio worker build `GuardedTCPServer` connections (idempotent)."""
    hypercorn.trio.run.TCPServer = GuardedTCPServer  # type: ignore[attr-defined]
