"""Tensor-parallel runners for tests: rank 0 in this process, the other ranks spawned."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio

from ft.config import EngineConfig
from ft.core.batch import Runner
from ft.engine.loading import load_torch_model
from ft.model.torch_runner import TorchRunner


@contextmanager
def tensor_parallel_runner(
    model: str, world: int, *, num_pages: int, page_size: int, dtype: str = "float32"
) -> Iterator[TorchRunner]:
    """A `world`-rank CPU (gloo) runner for `model`; the ranks are stopped when the block exits."""
    with tensor_parallel_parts(model, world, num_pages=num_pages, page_size=page_size, dtype=dtype) as runner:
        assert isinstance(runner, TorchRunner)
        yield runner


@contextmanager
def tensor_parallel_parts(
    model: str, world: int, *, num_pages: int, page_size: int, dtype: str = "float32", **config: Any
) -> Iterator[Runner]:
    """`tensor_parallel_runner` with more `EngineConfig` fields (a draft model's), whatever
    runner they make."""
    cfg = EngineConfig(
        model=model, dtype=dtype, device="cpu", tensor_parallel_size=world, compute_threads=1, **config
    )
    parts = load_torch_model(cfg)
    assert parts.close is not None
    try:
        yield parts.make_runner(num_pages, page_size)
    finally:
        parts.close(False)


def rank_pids(parent: int) -> list[int]:
    """Pids of the rank processes (`python -m ft.engine.ranks`) that `parent` spawned (Linux)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"ft.engine.ranks" in cmdline:
            pids.append(int(proc.name))
    return pids


ROOT = pathlib.Path(__file__).parents[2]


@asynccontextmanager
async def serve_process(
    args: list[str], log: pathlib.Path, env: dict[str, str] | None = None, *, new_session: bool = False
) -> AsyncIterator[tuple[trio.Process, str]]:
    """`python -m ft.cli_serve --port 0 ARGS` (output to `log`): the process and its URL once
    listening. The process is killed on exit if it still runs. `new_session`: in a process
    group of its own, which a test may signal as a whole."""
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "ft.cli_serve", "--port", "0", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=new_session,
        )
    try:
        with trio.fail_after(120):
            while not (match := re.search(r"listening on (http://[^\s,\"]+)", log.read_text())):
                assert proc.returncode is None, log.read_text()
                await trio.sleep(0.05)
        yield proc, match.group(1)
    finally:
        if proc.returncode is None:
            for pid in rank_pids(proc.pid):  # stopped or orphaned ranks would outlive the test
                os.kill(pid, signal.SIGKILL)
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
