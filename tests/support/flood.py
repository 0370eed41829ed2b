"""A flood of large bodies from another process, probing `/health` meanwhile.

`python -m tests.support.flood HOST PORT PATH BODY_FILE COUNT` POSTs COUNT copies of the body
at once (one connection each, raw HTTP/1.1 so the client costs little), polls `/health` on its
own connection until every POST is answered, and prints `{"statuses": [...], "latencies": [...]}`
(seconds). Run out of process, the server's loop and GIL are measured as an outside probe (a
kubelet) sees them, not slowed by the client's own work.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import trio

HEALTH_PERIOD_S = 0.02


async def _exchange(stream: trio.SocketStream, request: bytes) -> int:
    """Send one request, read its whole response (Content-Length framed); return the status."""
    await stream.send_all(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(":", 1) for line in lines[1:])
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        body += chunk
    return int(lines[0].split()[1])


async def flood(host: str, port: int, path: str, body: bytes, count: int) -> dict[str, Any]:
    """POST `count` copies of `body` at once; the `/health` latencies until all are answered."""
    post = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    health = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    statuses: list[int] = []
    latencies: list[float] = []

    async def one_post() -> None:
        async with await trio.open_tcp_stream(host, port) as stream:
            statuses.append(await _exchange(stream, post))

    async def probe(cancel_scope: trio.CancelScope) -> None:
        async with await trio.open_tcp_stream(host, port) as stream:
            while True:
                started = trio.current_time()
                assert await _exchange(stream, health) == 200
                latencies.append(trio.current_time() - started)
                if len(statuses) == count:
                    cancel_scope.cancel()
                await trio.sleep(HEALTH_PERIOD_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe, nursery.cancel_scope)
        async with trio.open_nursery() as posts:
            for _ in range(count):
                posts.start_soon(one_post)
        await trio.sleep_forever()  # the probe cancels once it has seen every answer
    return {"statuses": statuses, "latencies": latencies}


def main() -> None:
    host, port, path, body_file, count = sys.argv[1:]
    with open(body_file, "rb") as f:
        body = f.read()
    print(json.dumps(trio.run(flood, host, int(port), path, body, int(count))))


if __name__ == "__main__":
    main()
