"""SIGTERM: stop admitting, drain up to the shutdown timeout, abort the rest, exit 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import trio

from ft.config import DEFAULT_ABORT_TIMEOUT_S

ROOT = Path(__file__).parents[2]  # `python -m tests.support.serve_fake` runs from here
USER = [{"role": "user", "content": "hi"}]


async def _start(shutdown_timeout: float, *options: str) -> tuple[trio.Process, str, trio.abc.ReceiveStream]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.support.serve_fake", str(shutdown_timeout), *options],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    buf = b""
    with trio.fail_after(120):  # a fresh interpreter imports torch: tens of seconds on a loaded machine
        while b"\n" not in buf:
            chunk = await proc.stdout.receive_some()
            assert chunk, "the server exited before printing its URL"
            buf += chunk
    return proc, buf.split(b"\n")[0].decode(), proc.stdout


async def _rest(stdout: trio.abc.ReceiveStream) -> bytes:
    out = b""
    while chunk := await stdout.receive_some():
        out += chunk
    return out


async def test_sigterm_drains_then_aborts_and_exits_zero() -> None:
    """SIGTERM stops admitting, aborts a stream that outlives the drain, and exits 0."""
    proc, url, stdout = await _start(shutdown_timeout=0.5)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            body = {"messages": USER, "stream": True, "max_tokens": 1000}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                proc.send_signal(signal.SIGTERM)
                with trio.fail_after(30):  # the server's loop takes the signal when it can
                    while (await c.get("/health/ready")).status_code != 503:
                        await trio.sleep(0.02)
                refused = await c.post("/v1/chat/completions", json={"messages": USER})
                assert refused.status_code == 503
                rest = [line async for line in lines if line.startswith("data: ")]
            assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"
        with trio.fail_after(60):
            assert await proc.wait() == 0
            assert b"exited cleanly" in await _rest(stdout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigint_on_an_idle_server_exits_zero_at_once() -> None:
    """SIGINT on an idle server exits 0 without waiting for the drain timeout."""
    proc, url, _ = await _start(shutdown_timeout=120)
    try:
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/health")).json()["status"] == "ok"
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(60):  # half the drain timeout
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_exits_in_time_after_an_abandoned_prepare_stop() -> None:
    """SIGTERM after an abandoned prepare-stop still exits within the drain timeout."""
    proc, url, stdout = await _start(shutdown_timeout=0.5)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            body = {"messages": USER, "stream": True, "max_tokens": 1000}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                async with trio.open_nursery() as admin:  # the admin caller hangs up during a 60 s drain
                    admin.start_soon(partial(c.post, "/v1/admin/prepare-stop", json={"drain_timeout_s": 60}))
                    with trio.fail_after(30):
                        while (await c.get("/health")).json()["status"] != "stopping":
                            await trio.sleep(0.02)
                    admin.cancel_scope.cancel()
                proc.send_signal(signal.SIGTERM)
                with trio.fail_after(30):  # 0.5 s drain, then the abort: not the 60 s asked for
                    rest = [line async for line in lines if line.startswith("data: ")]
            assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"
        with trio.fail_after(60):
            assert await proc.wait() == 0
            assert b"exited cleanly" in await _rest(stdout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_exits_in_time_while_a_client_never_reads() -> None:
    """A stream whose client never reads does not keep a stopping server alive: SIGTERM exits
    within the drain timeout, the abort grace and the graceful timeout."""
    proc, url, stdout = await _start(1.0, "--endless", "--step-s", "0")
    try:
        async with httpx.AsyncClient(base_url=url) as c:
            with trio.fail_after(60):
                while (await c.get("/health")).json()["status"] != "ok":
                    await trio.sleep(0.05)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        body = json.dumps({"messages": USER, "stream": True, "max_tokens": 60000, "ignore_eos": True})
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        await sock.send(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
        with sock:
            async with httpx.AsyncClient(base_url=url) as c:
                with trio.fail_after(60):
                    while (await c.get("/v1/stats")).json()["requests"]["active"] != 1:
                        await trio.sleep(0.02)
            await trio.sleep(1.0)  # its writes are blocked by now (or soon: a later block only helps)
            proc.send_signal(signal.SIGTERM)
            # below the 30 s send timeout (before: still running after 60 s)
            with trio.fail_after(1.0 + DEFAULT_ABORT_TIMEOUT_S + 1.0 + 20):
                assert await proc.wait() == 0
        assert b"exited cleanly" in await _rest(stdout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
