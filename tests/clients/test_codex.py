"""The real Codex CLI (`codex exec`, from npm) against ft's `/v1/responses`: the protocol only.

Codex is installed at test time into `~/.cache/ft-clients/codex` (skipped, with the reason,
where npm is missing or the install fails: best effort, like HAProxy in `.ci/run`). It runs
with a custom provider (`wire_api = "responses"`, base URL on 127.0.0.1), its home in a temp
directory, telemetry, update checks and the network off. Asserted: exit status 0, no 4xx/5xx in
ft's request log, and on the tool round trip a tool's output item back in the second request;
never the model's wording.

Codex's first request is ~40 KB of instructions and tool definitions (40,000 bytes, about
10,000 SmolLM2 tokens): over the default model's 8,192-token context, which `--max-model-len`
cannot raise past the model's own. So both runs use the fake model (byte tokenizer, a
131,072-token context), scripted to say hello, or to call Codex's `exec_command` tool once and
answer after its output came back: the protocol is what is under test, not the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner, text_script
from ft.server import RunningServer
from tests.support.clients import CLIENTS_CACHE
from tests.support.server import TEST_SETTINGS, fake_server

pytestmark = pytest.mark.slow

CACHE = CLIENTS_CACHE / "codex"
INSTALL_TIMEOUT_S = 300
RUN_TIMEOUT_S = 240
SCRATCH_FILE = "ft_codex_probe.txt"
CALL = (
    '<tool_call>{"name": "exec_command", "arguments": '
    f'{{"cmd": "echo written-by-codex > {SCRATCH_FILE}"}}}}</tool_call>'
)


def codex_binary() -> Path:
    """The Codex CLI, installed from npm on first use; skips where that cannot be done."""
    binary = CACHE / "node_modules" / ".bin" / "codex"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the Codex CLI test needs it (npm install @openai/codex)")
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            [npm, "install", "--prefix", str(CACHE), "--no-audit", "--no-fund", "@openai/codex"],
            check=True,
            capture_output=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"could not install @openai/codex from npm: {e}")
    if not binary.exists():
        pytest.skip("npm installed @openai/codex without a codex binary")
    return binary


def codex_home(tmp: Path, base_url: str, model: str) -> Path:
    """A CODEX_HOME with ft as the only provider, telemetry and updates off."""
    home = tmp / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "ft"\n'
        'approval_policy = "never"\n'
        'sandbox_mode = "workspace-write"\n'
        "check_for_update_on_startup = false\n"
        "[analytics]\nenabled = false\n"
        "[feedback]\nenabled = false\n"
        '[otel]\nexporter = "none"\n'
        "[model_providers.ft]\n"
        'name = "ft"\n'
        f'base_url = "{base_url}/v1"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    return home


Done = subprocess.CompletedProcess[bytes]


async def run_codex(tmp: Path, server: RunningServer, model: str, task: str) -> Done:
    """`codex exec TASK` in a scratch directory under `tmp`, against `server`."""
    binary = codex_binary()
    work = tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp),
        "CODEX_HOME": str(codex_home(tmp, server.base_url, model)),
        "NO_PROXY": "127.0.0.1,localhost",
        "RUST_LOG": "error",
    }
    command = [str(binary), "exec", "--skip-git-repo-check", "--cd", str(work), task]
    with trio.fail_after(RUN_TIMEOUT_S):
        return await trio.run_process(
            command, env=env, stdin=b"", capture_stdout=True, capture_stderr=True, check=False
        )


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The fields of every line ft's request log wrote."""
    return [r.fields for r in caplog.records if r.name == "ft.request" and hasattr(r, "fields")]


def tool_then_answer() -> Any:
    """Call `exec_command` while no tool result is in the prompt; then answer."""
    call, answer = text_script(CALL), text_script("Done.")
    first: list[int] = []

    def script(work: SeqWork) -> int:
        if not first:
            first.append(work.num_prompt_tokens)
        return call(work) if work.num_prompt_tokens <= first[0] else answer(work)

    return script


LOGGED = dataclasses.replace(TEST_SETTINGS, log_prompts=True)


def assert_no_http_errors(lines: list[dict[str, Any]], output: bytes) -> None:
    """Codex sent at least one `/v1/responses` request, and ft answered none with a 4xx/5xx."""
    paths = [line.get("path") for line in lines]
    assert "/v1/responses" in paths, f"codex sent no /v1/responses request: {output[-2000:]!r}"
    errors = [(line.get("path"), line.get("status")) for line in lines if line.get("status", 0) >= 400]
    assert not errors, (errors, output[-2000:])


async def test_codex_exec_says_hello(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`codex exec` on a hello task exits 0 and every request it sent was answered 200."""
    caplog.set_level(logging.INFO, logger="ft.request")
    runner = FakeRunner(script=text_script("Hello!"))
    async with fake_server(runner, settings=LOGGED, context_length=131072, num_pages=4096) as s:
        done = await run_codex(tmp_path, s, "fake", "Say hello.")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert_no_http_errors(request_lines(caplog), output)


async def test_codex_exec_tool_round_trip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Codex runs the model's `exec_command` call and sends its output back as a
    `function_call_output` (a `tool` message in ft's prompt); it writes the scratch file."""
    caplog.set_level(logging.INFO, logger="ft.request")
    runner = FakeRunner(script=tool_then_answer())
    async with fake_server(runner, settings=LOGGED, context_length=131072, num_pages=4096) as s:
        done = await run_codex(tmp_path, s, "fake", f"Write the word hi into {SCRATCH_FILE}.")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    lines = request_lines(caplog)
    assert_no_http_errors(lines, output)
    prompts = [json.dumps(line.get("prompt")) for line in lines if line.get("path") == "/v1/responses"]
    assert len(prompts) >= 2, output[-4000:]
    assert any('"role": "tool"' in p for p in prompts[1:]), "no tool output came back"


async def test_codex_reads_an_answer_cut_by_the_context(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer cut by the context's end is a 200 ending in `response.incomplete`; Codex reads
    its reason (`max_output_tokens`), not a broken stream. (A first run measures Codex's
    prompt; the second server's context leaves 64 tokens after it.)"""
    caplog.set_level(logging.INFO, logger="ft.request")
    async with fake_server(context_length=131072, num_pages=4096) as s:
        await run_codex(tmp_path / "measure", s, "fake", "Say hello.")
    (num_prompt_tokens,) = {line["prompt_tokens"] for line in request_lines(caplog)}
    caplog.clear()
    runner = FakeRunner(script=text_script("x" * 3000))
    context = num_prompt_tokens + 64
    async with fake_server(runner, settings=LOGGED, context_length=context, num_pages=4096) as s:
        done = await run_codex(tmp_path / "cut", s, "fake", "Say hello.")
    output = done.stdout + done.stderr
    assert_no_http_errors(request_lines(caplog), output)
    assert b"max_output_tokens" in output, output[-4000:]
    assert b"stream disconnected" not in output and b"stream closed" not in output, output[-4000:]
