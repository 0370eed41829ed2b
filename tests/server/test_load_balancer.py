"""Two replicas behind HAProxy (the real binary, on loopback): one drained mid-load, no client
error. The configuration is read from docs/deploy.md. Skipped when `haproxy` is not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

ROOT = Path(__file__).parents[2]  # `python -m tests.support.serve_fake` runs from here
USER = [{"role": "user", "content": "hi"}]
HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")

DEPLOY_DOC = ROOT / "docs" / "deploy.md"


def haproxy_config(port: int, replicas: list[str]) -> str:
    """docs/deploy.md's HAProxy configuration, bound to `port` on loopback, with `replicas`
    (`host:port`) as its servers and a 200 ms check interval."""
    doc = DEPLOY_DOC.read_text()
    config = doc.split("```haproxy\n", 1)[1].split("```", 1)[0]
    lines = [line for line in config.splitlines() if not line.strip().startswith("server ")]
    lines += [f"    server r{i} {addr}" for i, addr in enumerate(replicas)]
    config = "\n".join(lines) + "\n"
    assert "bind :8000" in config and "inter 1s" in config
    return config.replace("bind :8000", f"bind 127.0.0.1:{port}").replace("inter 1s", "inter 200ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_replica(log_path: Path) -> tuple[trio.Process, str]:
    """`serve_fake` with tokenizer worker processes and JSON logs, in its own process group."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.support.serve_fake", "10", "--workers", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=log_path.open("wb"),
        cwd=ROOT,
        start_new_session=True,  # SIGTERM goes to the group, as a process manager may send it
    )
    assert proc.stdout is not None
    buf = b""
    with trio.fail_after(30):
        while b"\n" not in buf:
            chunk = await proc.stdout.receive_some()
            assert chunk, "the replica exited before printing its URL"
            buf += chunk
    return proc, buf.split(b"\n")[0].decode()


async def stop(proc: trio.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


@pytest.mark.slow
async def test_a_replica_drained_mid_load_behind_haproxy_costs_no_client_error(tmp_path: Path) -> None:
    """SIGTERM one of two replicas under load: its in-flight streams finish, HAProxy stops
    sending it traffic (readiness 503, retries on the other), every client request succeeds,
    and the replica exits 0 with a clean JSON log."""
    assert HAPROXY is not None
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a, a_url = await start_replica(a_log)
    b, b_url = await start_replica(b_log)
    lb_port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(lb_port, [url.removeprefix("http://") for url in (a_url, b_url)]))
    lb = await trio.lowlevel.open_process([HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL)
    errors: list[str] = []
    done = {"stream": 0, "plain": 0}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{lb_port}", timeout=30) as c:
            with trio.fail_after(20):  # both replicas up behind the balancer
                while True:
                    try:
                        if (await c.get("/health/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
                await trio.sleep(0.5)  # rise 2 at 200 ms: both replicas checked up
            # HAProxy's own id reaches the replica (a valid id: not replaced by a `req-` one).
            made = (await c.get("/health/live")).headers["x-request-id"]
            assert not made.startswith("req-")
            assert (await c.get("/health/live", headers={"X-Request-Id": "mine"})).headers[
                "x-request-id"
            ] == "mine"

            async def client(k: int, stop_at: float) -> None:
                while trio.current_time() < stop_at:
                    stream = k % 2 == 0
                    body = {"messages": USER, "max_tokens": 30, "stream": stream}
                    try:
                        r = await c.post("/v1/chat/completions", json=body)
                    except httpx.HTTPError as e:
                        errors.append(f"{type(e).__name__}: {e}")
                        continue
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {r.text[:200]}")
                    elif stream and not (r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text):
                        errors.append(f"stream ended badly: {r.text[-200:]}")
                    else:
                        done["stream" if stream else "plain"] += 1

            async with trio.open_nursery() as nursery, httpx.AsyncClient() as direct:
                stop_at = trio.current_time() + 4.0
                for k in range(6):
                    nursery.start_soon(client, k, stop_at)
                await trio.sleep(1.0)
                a_stats = (await direct.get(f"{a_url}/v1/stats")).json()
                os.killpg(a.pid, signal.SIGTERM)  # mid-load: A has requests in flight
            with trio.fail_after(15):
                assert await a.wait() == 0
            assert (await c.get("/health/ready")).status_code == 200  # B serves on
        assert a_stats["requests"]["active"] > 0, "A had nothing in flight when it was signalled"
        assert errors == [], errors[:5]
        assert done["stream"] > 6 and done["plain"] > 6
        # A's log: JSON lines, no warning or error; requests in flight at the signal ended 200.
        a_lines = [json.loads(line) for line in a_log.read_text().splitlines()]
        assert not [x for x in a_lines if x["level"] in ("warning", "error", "critical")]
        signalled = next(i for i, x in enumerate(a_lines) if x["msg"].startswith("received SIGTERM"))
        after = [x for x in a_lines[signalled:] if x["logger"] == "ft.request"]
        assert any(x["status"] == 200 and x.get("finish_reason") == "length" for x in after)
        assert {x["status"] for x in after} <= {200, 503}  # 503s were retried on B by HAProxy
        assert any(x["msg"].startswith("drained") for x in a_lines)
    finally:
        lb.terminate()
        with trio.move_on_after(5):
            await lb.wait()
        for proc in (lb, a, b):
            await stop(proc)
