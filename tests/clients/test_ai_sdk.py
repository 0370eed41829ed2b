"""The Vercel AI SDK (`ai` with `@ai-sdk/openai-compatible`, from npm) on ft, from a small node
script: `generateText`, `streamText`, a forced tool call it executes, `generateObject` and
`generateText` with `Output.object`. Skips where npm or the install is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.clients import FtServe, assert_clean, install_npm

PACKAGES = ("ai@7.0.173", "@ai-sdk/openai-compatible@3.0.92")
SCRIPT = Path(__file__).with_name("ai_sdk_check.mjs")


@pytest.fixture(scope="module")
def ai_sdk() -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    folder = install_npm("ai-sdk", *PACKAGES)
    if folder is None:
        pytest.skip(f"npm install {' '.join(PACKAGES)} failed or npm is missing (see stderr)")
    script = folder / "ft-check.mjs"  # beside its node_modules, where its imports resolve
    shutil.copyfile(SCRIPT, script)
    return script


def _run(script: Path, server: FtServe, env: dict[str, str], task: str) -> dict[str, Any]:
    done = subprocess.run(["node", str(script), server.api_base, server.model, task],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("task", ["text", "stream"])
def test_ai_sdk_generates_text(ft_serve: FtServe, env: dict[str, str], ai_sdk: Path, task: str) -> None:
    """`generateText` and `streamText` finish with a reason the SDK knows."""
    mark = ft_serve.mark()
    result = _run(ai_sdk, ft_serve, env, task)
    assert result["finishReason"] in ("stop", "length")
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")


def test_ai_sdk_executes_a_forced_tool(ft_serve: FtServe, env: dict[str, str], ai_sdk: Path) -> None:
    """`toolChoice: {type: 'tool'}`: the SDK parses at least one call of the tool and runs it."""
    mark = ft_serve.mark()
    result = _run(ai_sdk, ft_serve, env, "tool")
    assert result["toolCalls"] and set(result["toolCalls"]) == {"get_weather"}
    assert result["executed"] == len(result["toolCalls"]) and result["finishReason"] == "tool-calls"
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")


@pytest.mark.parametrize("task", ["object", "output"])
def test_ai_sdk_generates_an_object(ft_serve: FtServe, env: dict[str, str], ai_sdk: Path, task: str) -> None:
    """`generateObject` and `Output.object` (a JSON schema response format) return the object."""
    mark = ft_serve.mark()
    result = _run(ai_sdk, ft_serve, env, task)
    assert set(result["object"]) == {"name", "country"}
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")
