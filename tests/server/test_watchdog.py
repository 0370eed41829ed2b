"""A step that never returns, through the server: /health and /health/ready say why, the stream
ends with a server error; in a real `serve` process (the step hung in its thread, which cannot
be interrupted) the process exits 1 for its supervisor, saying why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from ft.engine.fake import FakeRunner, text_script
from tests.support.server import fake_server

ROOT = Path(__file__).parents[2]  # `python -m tests.support.serve_fake` runs from here
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}


async def test_a_hung_step_fails_the_stream_and_health_says_why() -> None:
    runner = FakeRunner(text_script("lorem ipsum " * 50), step_s=0.01)
    async with (
        fake_server(runner, step_timeout_s=1) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as client,
    ):
        with trio.fail_after(30):
            async with client.stream("POST", "/v1/chat/completions", json=BODY) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                runner.hangs = True
                assert (await client.get("/health")).json()["status"] == "ok"  # not yet: 1 s
                rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and "no step completed for 1 s" in error["message"]
        health = (await client.get("/health")).json()
        assert health["status"] == "error" and "no step completed for 1 s" in health["error"]
        assert "a step has run for" in health["error"]
        ready = await client.get("/health/ready")
        assert ready.status_code == 503
        assert ready.json() == {"status": "unavailable", "state": "error", "error": health["error"]}
        refused = await client.post("/v1/chat/completions", json=BODY | {"stream": False})
        assert refused.status_code == 503


async def test_a_step_hung_in_its_thread_makes_serve_exit_non_zero() -> None:
    """One process, the step blocked forever in the runner's thread: the watchdog fails the
    stream after `--step-timeout`, and the process exits 1 with the reason (the thread is
    abandoned, not waited for)."""
    args = ["10", "--step-timeout", "2", "--hang-at-step", "5"]
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.support.serve_fake", *args], stdout=subprocess.PIPE, cwd=ROOT
    )
    assert proc.stdout is not None
    try:
        out = b""
        with trio.fail_after(120):  # a fresh interpreter imports torch: tens of seconds on a loaded machine
            while b"\n" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the server exited before printing its URL"
                out += chunk
        url = out.split(b"\n")[0].decode()
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            with trio.fail_after(60):  # before: the server served on, failing nothing
                async with client.stream("POST", "/v1/chat/completions", json=BODY) as r:
                    assert r.status_code == 200
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                code = await proc.wait()
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and "no step completed for 2 s" in error["message"]
        assert code == 1
        while chunk := await proc.stdout.receive_some():
            out += chunk
        assert b"the engine failed: no step completed for 2 s" in out
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
