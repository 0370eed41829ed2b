"""What hypercorn accepts on a connection: HTTP/1.x only unless `--http2`, and no smuggling.

hypercorn serves cleartext HTTP/2 (h2c) to any client that asks (an `Upgrade: h2c` header or
the prior-knowledge preface `PRI * HTTP/2.0`), and its HTTP/2 output is buffered without
bound when the client's flow-control window stays at 0 (16 streams grew the server by 67 MiB
in 90 s while the client read 379 bytes). h11, its HTTP/1 parser, answers any `HTTP/x.y`
version and serves a request carrying both `Content-Length` and `Transfer-Encoding` (a
request-smuggling shape nginx refuses). `GuardedH11Protocol` checks each request line before
hypercorn acts on it:

- `Upgrade: h2c` is ignored (the request is served over HTTP/1.1) and the HTTP/2 preface is
  answered 505 and the connection closed, unless the config enables HTTP/2;
- versions other than HTTP/1.0 and HTTP/1.1 get 505, `Content-Length` with
  `Transfer-Encoding` gets 400; both close the connection.

hypercorn has no option for this, so `install()` puts the subclass where its `ProtocolWrapper`
looks the class up. Only configs of type `FtHypercornConfig` are guarded: any other hypercorn
server in the process keeps its behaviour.
"""

from __future__ import annotations

import h11
import hypercorn.protocol
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event
from hypercorn.protocol.h11 import H11Protocol

from ft.server.edge.slow_clients import SendDeadlines

HTTP1_VERSIONS = frozenset({b"1.0", b"1.1"})


class FtHypercornConfig(HypercornConfig):
    """hypercorn's config plus whether cleartext HTTP/2 is served and the deadlines of its
    socket writes (`ft.server.edge.slow_clients`)."""

    http2: bool = False
    send_deadlines: SendDeadlines | None = None


class RefusedRequest(Exception):
    """A request line `GuardedH11Protocol` answers with `status` and a closed connection."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def refusal(event: h11.Request, *, http2: bool) -> int | None:
    """The status to refuse `event` with, or None to serve it."""
    if http2 and event.method == b"PRI" and event.target == b"*":
        return None  # hypercorn switches to HTTP/2
    if event.http_version not in HTTP1_VERSIONS:
        return 505
    names = {name.lower() for name, _ in event.headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        return 400
    return None


class GuardedH11Protocol(H11Protocol):
    """hypercorn's HTTP/1 protocol with the checks in the module docstring."""

    async def handle(self, event: Event) -> None:
        """Feed `event` to hypercorn; answer a refused request and close the connection."""
        try:
            await super().handle(event)
        except RefusedRequest as refused:
            await self._send_error_response(refused.status)
            await self.send(Closed())

    async def _check_protocol(self, event: h11.Request) -> None:
        if not isinstance(self.config, FtHypercornConfig):
            return await super()._check_protocol(event)
        status = refusal(event, http2=self.config.http2)
        if status is not None:
            raise RefusedRequest(status)
        if self.config.http2:
            await super()._check_protocol(event)
        return None


def install() -> None:
    """Make hypercorn build `GuardedH11Protocol` for HTTP/1 connections (idempotent)."""
    hypercorn.protocol.H11Protocol = GuardedH11Protocol  # type: ignore[attr-defined]
