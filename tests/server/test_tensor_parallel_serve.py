"""`ft serve --tensor-parallel-size 2` on the CPU: launched by hand with torchrun's environment
(two processes on loopback, as on two machines), and a rank killed (or stopped: it hangs)
mid-stream, which fails the stream with a server error, turns /health to "error", and makes the
server exit non-zero, its ranks gone (no client left hanging); a rank killed while idle, which
the watchdog notices at once."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from ft.config import EngineConfig
from tests.support.parallel import ROOT, rank_pids, serve_process
from tests.support.server import running_server
from tests.support.tiny_model import save_hf_dir, tiny_config


async def test_torchrun_environment_starts_one_server_and_one_rank(tmp_path: pathlib.Path) -> None:
    """`RANK=0` serves and `RANK=1` follows (`MASTER_ADDR`/`MASTER_PORT`/`WORLD_SIZE`/`RANK`, as
    torchrun sets them on each node); both exit 0 after SIGTERM."""
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config())
    async with torchrun_pair(tmp_path, ["--model", str(model)]) as (proc, rank1, client):
        body = {"prompt": "!#%", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = (await client.post("/v1/completions", json=body)).json()
        assert reply["usage"]["completion_tokens"] == 8
        assert not rank_pids(proc.pid)  # under torchrun nothing is spawned
        proc.terminate()
        with trio.fail_after(30):
            assert await proc.wait() == 0
            assert await rank1.wait() == 0  # rank 0 told it to stop


@asynccontextmanager
async def torchrun_pair(
    tmp_path: pathlib.Path, args: list[str]
) -> AsyncIterator[tuple[trio.Process, trio.Process, httpx.AsyncClient]]:
    """`ft serve --tensor-parallel-size 2 ARGS` as torchrun starts it: rank 1 and rank 0 with
    `MASTER_ADDR`/`MASTER_PORT`/`WORLD_SIZE`/`RANK`; yields both once rank 0 serves, and a
    client on it. Rank 1 is killed on the way out if it is still running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    args = [*args, "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2"]
    with (tmp_path / "rank1.log").open("wb") as out:
        rank1 = await trio.lowlevel.open_process(
            [sys.executable, "-m", "ft.cli_serve", *args], env=env | {"RANK": "1", "LOCAL_RANK": "0"},
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    try:
        async with serve_process(args, tmp_path / "rank0.log", env=env | {"RANK": "0"}) as (proc, url):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                with trio.fail_after(60):
                    while (await client.get("/health")).json()["status"] != "ok":
                        await trio.sleep(0.1)
                yield proc, rank1, client
    finally:
        if rank1.returncode is None:
            rank1.kill()
            await rank1.wait()


@pytest.mark.parametrize("fault", ["KILL", "STOP"], ids=["dies", "hangs"])
async def test_a_rank_that_dies_or_hangs_mid_stream_fails_the_stream_and_exits_non_zero(
    tmp_path: pathlib.Path, fault: str
) -> None:
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config(max_position_embeddings=4096))
    log = tmp_path / "serve.log"
    args = ["--model", str(model), "--dtype", "float32", "--device", "cpu",
            "--tensor-parallel-size", "2", "--step-timeout", "3"]  # fmt: skip
    async with serve_process(args, log) as (proc, url):
        health: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            with trio.fail_after(60):
                while (await client.get("/health")).json()["status"] != "ok":
                    await trio.sleep(0.1)
            (rank,) = rank_pids(proc.pid)

            async def watch_health() -> None:
                async with httpx.AsyncClient(base_url=url, timeout=2) as c:
                    while True:
                        try:
                            health.append((await c.get("/health")).json()["status"])
                        except httpx.HTTPError:
                            return  # the server has stopped
                        await trio.sleep(0.02)

            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_health)
                with trio.fail_after(30):  # bounded: no client is left hanging
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        lines = r.aiter_lines()
                        while not (await lines.__anext__()).startswith("data: {"):
                            pass
                        os.kill(rank, getattr(signal, f"SIG{fault}"))
                        rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert error["type"] == "server_error"
            if fault == "STOP":
                assert "no step completed for 3 s" in error["message"]
            else:  # the next collective fails, or the watchdog sees the process gone: whichever first
                assert "runner failed" in error["message"] or "rank 1" in error["message"], error
        assert "error" in health
        with trio.fail_after(30):
            assert await proc.wait() != 0
        assert f"the engine failed: {error['message']}" in log.read_text()
        assert not rank_pids(proc.pid)


async def test_a_rank_that_dies_while_idle_turns_health_to_error_at_once(tmp_path: pathlib.Path) -> None:
    """No request runs, so no collective can notice: the watchdog sees the spawned rank's
    process exit, and /health and /health/ready say which rank died and how within a second
    (before, they said "ok" until the next request failed)."""
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config())
    config = EngineConfig(model=str(model), dtype="float32", device="cpu", tensor_parallel_size=2)
    async with (
        running_server(config) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=10) as client,
    ):
        (rank,) = rank_pids(os.getpid())
        assert (await client.get("/health")).json()["status"] == "ok"
        os.kill(rank, signal.SIGKILL)
        with trio.fail_after(60):  # the watchdog's period is 0.5 s; before: never
            while (health := (await client.get("/health")).json())["status"] == "ok":
                await trio.sleep(0.01)
        assert health["status"] == "error"
        assert health["error"] == f"tensor-parallel rank 1 (pid {rank}) died: killed by SIGKILL"
        ready = await client.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["error"] == health["error"]
        refused = await client.post("/v1/completions", json={"prompt": "!#%", "max_tokens": 2})
        assert refused.status_code == 503


async def test_a_rank_that_dies_while_idle_makes_serve_exit_non_zero(tmp_path: pathlib.Path) -> None:
    """`ft serve` with an idle rank killed exits 1 within seconds, saying which rank
    died (before, it served on, "ok", until the next request failed)."""
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config())
    log = tmp_path / "serve.log"
    args = ["--model", str(model), "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2"]
    async with serve_process(args, log) as (proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            with trio.fail_after(60):
                while (await client.get("/health")).json()["status"] != "ok":
                    await trio.sleep(0.1)
        (rank,) = rank_pids(proc.pid)
        os.kill(rank, signal.SIGKILL)
        with trio.fail_after(60):  # ~1-3 s here; before: never
            assert await proc.wait() == 1
    reason = f"tensor-parallel rank 1 (pid {rank}) died: killed by SIGKILL"
    assert f"the engine failed: {reason}" in log.read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_process_group_signal_drains_a_tensor_parallel_server(
    tmp_path: pathlib.Path, signum: signal.Signals
) -> None:
    """A stop signal sent to the whole process group (a process manager, a terminal's Ctrl-C)
    reaches the spawned ranks too: they must keep serving the drain, which ends the in-flight
    stream normally; the server then stops them and exits 0."""
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config(max_position_embeddings=4096))
    log = tmp_path / "serve.log"
    args = ["--model", str(model), "--dtype", "float32", "--device", "cpu",
            "--tensor-parallel-size", "2", "--drain-timeout", "30"]  # fmt: skip
    async with serve_process(args, log, new_session=True) as (proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            with trio.fail_after(60):
                while (await client.get("/health")).json()["status"] != "ok":
                    await trio.sleep(0.1)
            (rank,) = rank_pids(proc.pid)
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            with trio.fail_after(60):
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    while not (await lines.__anext__()).startswith("data: {"):
                        pass
                    os.killpg(proc.pid, signum)
                    rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2].removeprefix("data: "))
        assert "error" not in last and last["choices"][0]["finish_reason"] == "length", rest[-2]
        with trio.fail_after(30):
            assert await proc.wait() == 0, log.read_text()
        assert not rank_pids(proc.pid)
        with pytest.raises(ProcessLookupError):
            os.kill(rank, 0)


async def test_spawned_ranks_exit_when_the_server_is_killed(tmp_path: pathlib.Path) -> None:
    """Ranks in a session of their own are no orphans: a server killed outright (SIGKILL, no
    "stop") breaks the group, and they exit on their own; they log in the server's format."""
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config())
    args = ["--model", str(model), "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2",
            "--log-format", "json"]  # fmt: skip
    log = tmp_path / "serve.log"
    async with serve_process(args, log, new_session=True) as (proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            with trio.fail_after(60):
                while (await client.get("/health")).json()["status"] != "ok":
                    await trio.sleep(0.1)
        (rank,) = rank_pids(proc.pid)
        proc.kill()
        await proc.wait()
    try:
        with trio.fail_after(30):
            while pathlib.Path(f"/proc/{rank}").exists() and "Z" not in _state(rank):
                await trio.sleep(0.1)
    finally:
        if pathlib.Path(f"/proc/{rank}").exists() and "Z" not in _state(rank):
            os.kill(rank, signal.SIGKILL)
    lines = log.read_text().splitlines()
    assert any('"logger": "ft.ranks"' in line for line in lines)  # the rank said why it left
    for line in lines:
        json.loads(line)


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


async def test_under_torchrun_a_sigterm_to_every_rank_drains(tmp_path: pathlib.Path) -> None:
    """torchrun stops a job by sending SIGTERM to each of its ranks at once: rank 1 must keep
    serving rank 0's drain (the in-flight stream ends normally), then stop when told."""
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config(max_position_embeddings=4096))
    async with torchrun_pair(tmp_path, ["--model", str(model), "--drain-timeout", "30"]) as (
        proc,
        rank1,
        client,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with trio.fail_after(60):
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                rank1.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGTERM)
                rest = [line async for line in lines if line.startswith("data: ")]
        last = json.loads(rest[-2].removeprefix("data: "))
        assert "error" not in last and last["choices"][0]["finish_reason"] == "length", rest[-2]
        with trio.fail_after(30):
            assert await proc.wait() == 0
            assert await rank1.wait() == 0


async def test_a_rank_whose_server_is_killed_during_start_up_exits(tmp_path: pathlib.Path) -> None:
    """Killed before the group forms, the server leaves a rank that would wait for it for days:
    the rank notices its parent is gone and exits."""
    model = tmp_path / "tiny"
    save_hf_dir(model, tiny_config())
    args = ["--model", str(model), "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2"]
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "ft.cli_serve", "--port", "0", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    with trio.fail_after(30):
        while not (ranks := rank_pids(proc.pid)):
            await trio.sleep(0.01)
    proc.kill()
    await proc.wait()
    (rank,) = ranks
    try:
        with trio.fail_after(20):
            while pathlib.Path(f"/proc/{rank}").exists() and "Z" not in _state(rank):
                await trio.sleep(0.1)
    finally:
        if pathlib.Path(f"/proc/{rank}").exists() and "Z" not in _state(rank):
            os.kill(rank, signal.SIGKILL)
