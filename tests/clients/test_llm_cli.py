"""Simon Willison's `llm` CLI on ft, through an `extra-openai-models.yaml` entry that points at
it: a streamed reply, a `--schema` answer (JSON), and a run with a tool offered (`-T llm_time`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.clients import FtServe, assert_clean

pytest.importorskip("llm")


def _llm(server: FtServe, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`llm -m ft ARGS` with the model registered under `LLM_USER_PATH` (2 minutes at most)."""
    user = Path(env["LLM_USER_PATH"])
    user.mkdir(parents=True, exist_ok=True)
    (user / "extra-openai-models.yaml").write_text(
        f"- model_id: ft\n  model_name: {server.model}\n  api_base: {server.api_base}\n"
        "  supports_tools: true\n  supports_schema: true\n"
    )
    options = ["-o", "temperature", "0", "-o", "max_tokens", "64"]
    command = [sys.executable, "-m", "llm", "-m", "ft", *options, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_llm_streams_a_reply(ft_serve: FtServe, env: dict[str, str]) -> None:
    """`llm -m ft PROMPT` streams a reply and exits 0."""
    mark = ft_serve.mark()
    done = _llm(ft_serve, env, "Say hello.")
    assert done.returncode == 0, done.stderr
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")


def test_llm_answers_a_schema_with_json(ft_serve: FtServe, env: dict[str, str]) -> None:
    """`--schema 'name, country'` prints a JSON object with those keys."""
    mark = ft_serve.mark()
    done = _llm(ft_serve, env, "--schema", "name, country", "Name a city.")
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) == {"name", "country"}
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")


def test_llm_runs_with_a_tool_offered(ft_serve: FtServe, env: dict[str, str]) -> None:
    """`-T llm_time` sends a tool; whatever the model does with it, the run completes (llm has
    no tool_choice option to force the call) and each tool round trip is answered."""
    mark = ft_serve.mark()
    done = _llm(ft_serve, env, "-T", "llm_time", "--td", "What time is it? Use the tool.")
    assert done.returncode == 0, done.stderr
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")
