"""Claude Code (`claude -p`, from npm) against ft: a hello run on the default model, and a tool
round trip (its Write tool creates a file in a scratch directory) on the fake model.

Claude Code is installed at test time into a cache directory (`FT_CLIENTS_CACHE`, default
`~/.cache/ft-clients`; the install is bounded) and skipped, saying why, where npm is missing or
the install fails. It runs with telemetry, error reporting, update checks and nonessential
traffic off, `HOME` in a temporary directory, and a dummy key: its only traffic is to ft on
127.0.0.1. The tests assert the protocol (exit status, Claude Code's JSON result, no 4xx/5xx in
ft's request log, the file the tool call wrote), never the model's wording.

Claude Code 2.1's request with all 24 of its tools is ~20,000 tokens of the default model, past
its 8,192-token context: the hello run offers the Write tool only (`--tools Write`, ~1,800
tokens). The round trip runs the fake model (byte tokens, a 256 Ki-token context), so it sends
every tool, and the fake model's scripted answer is a call of Write.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner, text_script
from tests.support.clients import CLIENTS_CACHE
from tests.support.engine import fake_hooks
from tests.support.server import running_server

# Installs Claude Code from npm; the hello run prefills ~1,800 tokens on the real model, which
# took 42 s on a loaded 2-core machine and several minutes on a busier one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PACKAGE = "@anthropic-ai/claude-code"
INSTALL_TIMEOUT_S = 300
RUN_TIMEOUT_S = 720
SERVE_START_S = 120
CUT_AT_MAX_TOKENS = re.compile(r"exceeded the \d+ output token maximum")
FAKE_CONTEXT = 1 << 18


@pytest.fixture(scope="module")
def claude() -> pathlib.Path:
    """The `claude` executable, installed from npm once into the clients cache."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("npm or node is missing: Claude Code cannot be installed")
    prefix = CLIENTS_CACHE / "claude-code"
    exe = prefix / "node_modules" / ".bin" / "claude"
    if not exe.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        command = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", PACKAGE]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {PACKAGE} took over {INSTALL_TIMEOUT_S} s")
        if done.returncode != 0 or not exe.exists():
            pytest.skip(f"npm install {PACKAGE} failed: {done.stderr[-500:]}")
    return exe


class RequestLog(logging.Handler):
    """ft's end-of-request log lines (`ft.request`), kept as (method, path, status)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields: dict[str, Any] = getattr(record, "fields", {})
        self.lines.append((str(fields.get("method")), str(fields.get("path")), int(fields.get("status", 0))))

    def failures(self) -> list[tuple[str, str, int]]:
        """The requests answered 4xx or 5xx."""
        return [line for line in self.lines if line[2] >= 400]


@pytest.fixture
def request_log() -> Iterator[RequestLog]:
    handler = RequestLog()
    logger = logging.getLogger("ft.request")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


async def run_claude(
    claude: pathlib.Path,
    base_url: str,
    model: str,
    home: pathlib.Path,
    cwd: pathlib.Path,
    *args: str,
    max_output_tokens: int | None = None,
) -> dict[str, Any]:
    """`claude -p … --output-format json` against `server`; its result record (asserts exit 0).

    `max_output_tokens` caps each answer (Claude Code asks for 32,000: up to the end of the
    context, minutes of a rambling small model on a busy CPU)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "dummy",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    if max_output_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
    with trio.fail_after(RUN_TIMEOUT_S):
        done = await trio.run_process(
            [str(claude), "-p", *args, "--output-format", "json"],
            env=env,
            cwd=cwd,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    result: dict[str, Any] = json.loads(out) if out.startswith("{") else {}
    print(out[-3000:], err[-3000:])  # shown when the test fails
    assert result.get("type") == "result" and result.get("api_error_status") is None
    # NOTE: an answer cut at `max_output_tokens` is Claude Code's error (exit 1, "…exceeded the
    # 64 output token maximum…"; its `stop_reason` then says `stop_sequence`), not a protocol
    # failure: the small model's length is its own.
    if max_output_tokens is None or not CUT_AT_MAX_TOKENS.search(str(result.get("result"))):
        assert done.returncode == 0 and result["is_error"] is False, result
    return result


REQUEST_LINE = re.compile(r"ft\.request .*?\] (GET|HEAD|POST|PUT|DELETE|OPTIONS) (\S+) (\d{3}) ")


@asynccontextmanager
async def ft_serve(log_path: pathlib.Path) -> AsyncIterator[tuple[str, str]]:
    """`ft serve` (the default model) in its own process, its log in `log_path`; yields its
    base URL and model id once ready."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["ft", "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
                with trio.fail_after(SERVE_START_S):
                    while True:
                        assert proc.poll() is None, log_path.read_text()[-2000:]
                        try:
                            if (await client.get("/health/ready")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.5)
                model = (await client.get("/health")).json()["model"]
            yield base_url, model
        finally:
            proc.terminate()
            proc.wait(30)


async def test_claude_code_says_hello_to_the_default_model(
    claude: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """`claude -p "say hello"` completes against `ft serve`'s default model, every request 2xx."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    log_path = tmp_path / "ft.log"
    async with ft_serve(log_path) as (base_url, model):
        args = ("say hello", "--tools", "Write")
        result = await run_claude(claude, base_url, model, home, work, *args, max_output_tokens=64)
    assert result["num_turns"] >= 1 and result["usage"]["output_tokens"] > 0
    lines = [m.groups() for m in REQUEST_LINE.finditer(log_path.read_text())]
    assert ("POST", "/v1/messages", "200") in lines, lines
    assert [line for line in lines if int(line[2]) >= 400] == []


def write_then_answer(path: pathlib.Path) -> Any:
    """The fake model's script: a call of Claude Code's Write tool on the first prompt, an answer
    on any longer one (the tool result is in it)."""
    arguments = {"file_path": str(path), "content": "hello from ft\n"}
    call = text_script(f'<tool_call>{{"name": "Write", "arguments": {json.dumps(arguments)}}}</tool_call>')
    answer = text_script("Done.")
    first: list[int] = []

    def script(work: SeqWork) -> int:
        if not first:
            first.append(work.num_prompt_tokens)
        return call(work) if work.num_prompt_tokens <= first[0] else answer(work)

    return script


async def test_claude_code_tool_round_trip_writes_a_file(
    claude: pathlib.Path, request_log: RequestLog, tmp_path: pathlib.Path
) -> None:
    """Claude Code sends all its tools; ft streams the model's call of Write as a `tool_use`
    block; Claude Code writes the file and sends the result; ft answers the second turn."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    target = work / "hello.txt"
    runner = FakeRunner(write_then_answer(target))
    hooks = fake_hooks(runner, context_length=FAKE_CONTEXT)
    config = EngineConfig(num_pages=FAKE_CONTEXT // EngineConfig().page_size + 64)
    async with running_server(config, hooks=hooks) as s:
        result = await run_claude(
            claude,
            s.base_url,
            s.engine.model_id,
            home,
            work,
            "Create hello.txt saying hello.",
            "--allowedTools",
            "Write",
            "--permission-mode",
            "acceptEdits",
        )
    assert target.read_text() == "hello from ft\n"
    assert result["num_turns"] >= 2
    generations = [line for line in request_log.lines if line[:2] == ("POST", "/v1/messages")]
    assert len(generations) >= 2 and all(status == 200 for *_, status in generations)
    assert request_log.failures() == []
