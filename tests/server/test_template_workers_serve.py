"""`ft serve` on a GGUF whose chat template hangs: SIGTERM still stops the server within the
drain and abort grace, and no tokenizer worker outlives the server, even a SIGKILLed one."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
import trio

from ft.config import DEFAULT_ABORT_TIMEOUT_S
from ft.model.gguf_file import GGUFFile
from ft.model.pull import default_model_path
from tests.support.gguf_template import with_chat_template
from tests.support.parallel import ROOT, serve_process

pytestmark = pytest.mark.slow  # the real default model

DRAIN_S, ABORT_S = 0.5, DEFAULT_ABORT_TIMEOUT_S  # `--drain-timeout`, and the abort grace
# An idle `ft serve` takes ~5 s from SIGTERM to exit on a busy test machine (hypercorn's
# graceful timeout, the model's close); a busy worker may add no more than the drain and grace.
# The bound leaves a slower machine room: the bug it guards against never exited.
IDLE_EXIT_S = 60.0
HANG = [{"role": "user", "content": "hang"}]


@pytest.fixture(scope="module")
def hostile_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The default model, its template looping for good on a last message "hang"."""
    source = default_model_path(progress=False)
    template = GGUFFile(source).require("tokenizer.chat_template")
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    hostile = f"{{% if messages[-1]['content'] == 'hang' %}}{loop}{{% endif %}}{template}"
    return with_chat_template(source, tmp_path_factory.mktemp("gguf") / "hostile.gguf", hostile)


def tokenizer_workers(pid: int) -> list[psutil.Process]:
    """The server's trio-parallel workers (not multiprocessing's resource tracker)."""
    children = psutil.Process(pid).children(recursive=True)
    return [p for p in children if "spawn_main" in " ".join(p.cmdline())]


def is_gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # exited; its new parent has not reaped it yet
    except psutil.NoSuchProcess:
        return True


async def wait_gone(workers: list[psutil.Process], timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not all(is_gone(p) for p in workers):
            await trio.sleep(0.05)


def cpu_s(p: psutil.Process) -> float:
    """The CPU time `p` has used (0 once it is gone)."""
    try:
        times = p.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(times.user + times.system)


async def start_hanging_chat(url: str, pid: int, nursery: trio.Nursery) -> list[psutil.Process]:
    """Wait until the model is ready, then post (in `nursery`) a chat that hangs in the template;
    return the server's workers once one of them has spent half a second of CPU rendering it
    (CPU, not a share of it: on a loaded machine a busy worker gets a fraction of a core)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        with trio.fail_after(120):
            while (await client.get("/health")).json().get("status") != "ok":
                await trio.sleep(0.1)

    async def post() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            try:
                await client.post("/v1/chat/completions", json={"messages": HANG, "max_tokens": 4})
            except httpx.TransportError:
                pass  # the server went away, as the test means it to

    before = {p.pid: cpu_s(p) for p in tokenizer_workers(pid)}
    nursery.start_soon(post)
    with trio.fail_after(120):
        while True:
            workers = tokenizer_workers(pid)
            for p in workers:
                before.setdefault(p.pid, cpu_s(p))
            if any(cpu_s(p) - before[p.pid] > 0.5 for p in workers):
                return workers
            await trio.sleep(0.05)


async def test_sigterm_with_a_worker_busy_in_the_template_exits_in_time_and_leaves_no_worker(
    hostile_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """SIGTERM was ignored (and a second one too) while a worker rendered: the server now
    exits 0 within the drain and the abort grace, and kills the busy worker."""
    args = ["--model", str(hostile_gguf), "--template-timeout", "300", "--drain-timeout", str(DRAIN_S)]
    async with serve_process(args, tmp_path / "serve.log") as (proc, url), trio.open_nursery() as nursery:
        workers = await start_hanging_chat(url, proc.pid, nursery)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(DRAIN_S + ABORT_S + IDLE_EXIT_S):
            assert await proc.wait() == 0, (tmp_path / "serve.log").read_text()
        await wait_gone(workers, 30.0)  # before: never
        nursery.cancel_scope.cancel()


async def test_a_sigkilled_server_leaves_no_worker_behind(
    hostile_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """The worker rendering when the server was SIGKILLed lived on as an orphan at full CPU."""
    args = ["--model", str(hostile_gguf), "--template-timeout", "300"]
    async with serve_process(args, tmp_path / "serve.log") as (proc, url), trio.open_nursery() as nursery:
        workers = await start_hanging_chat(url, proc.pid, nursery)
        proc.kill()
        await proc.wait()
        await wait_gone(workers, 30.0)  # before: an orphan for good
        nursery.cancel_scope.cancel()


async def test_a_template_that_cannot_render_makes_ft_serve_exit_1_naming_it(tmp_path: pathlib.Path) -> None:
    source = default_model_path(progress=False)
    broken = with_chat_template(source, tmp_path / "broken.gguf", "{% for message in messages %}")
    with trio.fail_after(120):
        done = await trio.run_process(
            [sys.executable, "-m", "ft.cli_serve", "--port", "0", "--model", str(broken)],
            cwd=ROOT,
            capture_stdout=True,
            stderr=subprocess.STDOUT,
            check=False,
        )
    out = done.stdout.decode()
    assert done.returncode == 1, out
    assert "the engine failed: ValueError: the model's chat template cannot be used" in out
    assert "TemplateSyntaxError" in out
