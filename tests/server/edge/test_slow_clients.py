"""A client that stops reading is a client that left: its stream is aborted after the send
timeout, and a stopping server waits for no socket."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import httpx
import pytest
import trio
import trio.testing
from hypercorn.events import Closed, Event, RawData

from ft.engine.fake import FakeRunner, byte_token
from ft.server import RunningServer
from ft.server.edge.protocol import FtHypercornConfig
from ft.server.edge.slow_clients import GuardedTCPServer, SendDeadlines
from tests.support.server import TEST_SETTINGS, fake_server, wait_idle

# Far more output than the socket buffers hold (the client's window is 4 KiB; the server's
# send buffer grows to a few MiB at most): a client that never reads blocks the writes.
ENDLESS = {"ignore_eos": True, "max_tokens": 60000, "stream": True}


def endless_runner() -> FakeRunner:
    """A fake model that writes "x" for ever, as fast as it can."""
    return FakeRunner(script=lambda work: byte_token(ord("x")), step_s=0.0)


@asynccontextmanager
async def endless_server(send_timeout_s: float) -> AsyncIterator[RunningServer]:
    """A fake-model server with room for 60,000-token answers and the given send timeout."""
    settings = replace(TEST_SETTINGS, send_timeout_s=send_timeout_s)
    async with fake_server(endless_runner(), settings=settings, context_length=70000, num_pages=8192) as s:
        yield s


async def request_and_never_read(base_url: str, path: str, body: dict[str, object]) -> trio.socket.SocketType:
    """Send one HTTP request on a socket with a tiny receive window; return it, never read."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    await sock.send(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


async def wait_active(server: RunningServer, active: int) -> None:
    while len(server.engine.registry) != active:
        await trio.sleep(0.02)


async def test_a_stream_whose_client_stops_reading_is_aborted_after_the_send_timeout() -> None:
    """The request is aborted through its scope (registry empty, no page held) once the socket
    has accepted nothing for the send timeout, while the client keeps the connection open."""
    async with endless_server(send_timeout_s=1.0) as server:
        body = {"messages": [{"role": "user", "content": "hi"}]} | ENDLESS
        sock = await request_and_never_read(server.base_url, "/v1/chat/completions", body)
        with sock:
            with trio.fail_after(60):
                await wait_active(server, 1)
                await wait_active(server, 0)  # before: held for ever
            async with httpx.AsyncClient(base_url=server.base_url) as c:
                stats = await wait_idle(c)
            assert stats["requests"]["aborted"] == 1


async def test_a_non_streamed_body_the_client_does_not_read_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    """A large non-streamed body whose client never reads: the write is cut after the send
    timeout and the connection closed (the client finds a truncated body, then the end)."""
    caplog.set_level(logging.INFO, logger="ft.server")
    async with endless_server(send_timeout_s=0.5) as server:
        body = {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "n": 4, "logprobs": 5}
        sock = await request_and_never_read(server.base_url, "/v1/completions", body)
        with sock:
            with trio.fail_after(30):
                while server.engine.snapshot().requests.completed < 1:
                    await trio.sleep(0.05)
            with trio.fail_after(30):  # reading nothing until the server cuts the write
                while not any("read nothing" in r.getMessage() for r in caplog.records):
                    await trio.sleep(0.05)
            received = b""
            with trio.fail_after(60):  # before: the whole body, then a kept-alive connection
                while chunk := await sock.recv(1 << 20):
                    received += chunk
        head, _, rest = received.partition(b"\r\n\r\n")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
        )
        assert 0 < len(rest) < length
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200


async def test_clients_that_stop_reading_do_not_hold_the_engine_capacity() -> None:
    """Streams the engine has finished, whose clients read nothing, leave the engine's capacity:
    an honest request is served, not refused with 503 (they count as `sending`)."""
    settings = replace(TEST_SETTINGS, send_timeout_s=600)
    runner = endless_runner()
    cfg = {"context_length": 70000, "num_pages": 8192, "max_running_requests": 2, "max_queued_requests": 1}
    async with fake_server(runner, settings=settings, **cfg) as server:
        body = {"messages": [{"role": "user", "content": "hi"}]} | ENDLESS | {"max_tokens": 5000}
        socks = [
            await request_and_never_read(server.base_url, "/v1/chat/completions", body) for _ in range(3)
        ]
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
                with trio.fail_after(60):
                    while (await c.get("/v1/stats")).json()["requests"]["sending"] < 3:
                        await trio.sleep(0.05)
                stats = (await c.get("/v1/stats")).json()["requests"]
                assert stats["active"] == 3 and stats["running"] == 0 and stats["waiting"] == 0
                honest = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
                r = await c.post("/v1/chat/completions", json=honest)
                assert r.status_code == 200, r.text  # before: 503, the queue is full
        finally:
            for s in socks:
                s.close()


async def test_shutdown_waits_for_no_client_that_stops_reading() -> None:
    """Leaving the server takes its graceful timeout, not the send timeout, while a client that
    stopped reading holds a stream open: the server has left before that client gives up."""
    gave_up = trio.Event()
    async with trio.open_nursery() as nursery:
        async with endless_server(send_timeout_s=600) as server:
            body = {"messages": [{"role": "user", "content": "hi"}]} | ENDLESS
            sock = await request_and_never_read(server.base_url, "/v1/chat/completions", body)
            # Before the fix the server waits on the write for ever: this client gives up after
            # 60 s (closing its socket ends the write), so the test fails instead of hanging.
            nursery.start_soon(_close_after, sock, 60.0, gave_up)
            with trio.fail_after(30):
                await wait_active(server, 1)
            await trio.sleep(1.0)  # the writes are blocked by now (or soon: a later block only helps)
        left_first = not gave_up.is_set()
        nursery.cancel_scope.cancel()
    sock.close()
    assert left_first, "the server left only once the client that never reads had given up"


async def _close_after(sock: trio.socket.SocketType, delay_s: float, closed: trio.Event) -> None:
    await trio.sleep(delay_s)
    sock.close()
    closed.set()


class _Recorded:
    """The protocol side of a connection: records the events hypercorn's protocol is given."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)


def _guarded_connection(stream: trio.abc.Stream, timeout_s: float) -> tuple[GuardedTCPServer, _Recorded]:
    config = FtHypercornConfig()
    config.send_deadlines = SendDeadlines(timeout_s)
    server = GuardedTCPServer(None, config, None, None, stream)  # type: ignore[arg-type]
    protocol = _Recorded()
    server.protocol = protocol  # type: ignore[assignment]
    return server, protocol


async def test_a_client_that_reads_slowly_but_steadily_gets_a_large_write_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One write far larger than what the client reads in the send timeout (a non-streamed
    body) is not cut while the client keeps accepting bytes: the deadline is on progress."""
    send, receive = trio.testing.lockstep_stream_pair()
    server, protocol = _guarded_connection(send, timeout_s=10.0)
    body = bytes(range(256)) * 1024  # 256 KiB, read at 8 KiB/s: 32 s in all
    received = bytearray()

    async def read_steadily() -> None:
        while len(received) < len(body):
            received.extend(await receive.receive_some(4096))
            await trio.sleep(0.5)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_steadily)
            await server.protocol_send(RawData(body))
            nursery.cancel_scope.cancel()
    assert bytes(received) == body  # before: cut after 10 s, the connection closed
    assert not any(isinstance(e, Closed) for e in protocol.events)


async def test_a_client_that_accepts_nothing_is_cut_at_the_send_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client that stops accepting bytes mid-write is cut once the send timeout passes with
    nothing accepted, and the protocol is told the connection closed."""
    send, receive = trio.testing.lockstep_stream_pair()
    server, protocol = _guarded_connection(send, timeout_s=10.0)
    body = bytes(256 * 1024)

    async def read_then_stop() -> None:
        for _ in range(4):
            await receive.receive_some(4096)
        await trio.sleep_forever()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_then_stop)
            started = trio.current_time()
            await server.protocol_send(RawData(body))
            took = trio.current_time() - started
            nursery.cancel_scope.cancel()
    assert 10.0 <= took < 11.0
    assert any(isinstance(e, Closed) for e in protocol.events)
