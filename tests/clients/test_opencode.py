"""opencode (`opencode-ai` from npm) on ft: `opencode run` with ft as an OpenAI-compatible
provider in the project's `opencode.json`. Skips where npm or the install is missing.

opencode's own build agent sends its system prompt and a dozen tool schemas: 7,761 prompt
tokens with 1.18.33 (measured in ft's log), which fits the default model's 8,192-token context
only with an output limit under 431 and took over 150 s to prefill on the shared 2-core test
machine (a larger prompt is an honest 400 naming the counts). These runs use an agent of the
config's own with a one-line prompt and only the tools the task needs, as a user of a small
local model would."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.clients import DUMMY_KEY, FtServe, assert_clean, install_npm

PACKAGE = "opencode-ai@1.18.33"


@pytest.fixture(scope="module")
def opencode() -> Path:
    folder = install_npm("opencode", PACKAGE)
    if folder is None:
        pytest.skip(f"npm install {PACKAGE} failed or npm is missing (see stderr)")
    return folder / "node_modules" / ".bin" / "opencode"


def _project(server: FtServe, folder: Path, tools: dict[str, bool]) -> Path:
    """A scratch project whose `opencode.json` points at ft, with an agent `ft` using `tools`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "ft": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "ft",
                "options": {"baseURL": server.api_base, "apiKey": DUMMY_KEY},
                "models": {
                    server.model: {
                        "name": server.model,
                        "tool_call": True,
                        "limit": {"context": 8192, "output": 96},
                    }
                },  # fmt: skip
            }
        },
        "model": f"ft/{server.model}",
        "small_model": f"ft/{server.model}",
        "agent": {"ft": {"mode": "primary", "prompt": "Be brief.", "tools": {"*": False, **tools}}},
    }
    (folder / "opencode.json").write_text(json.dumps(config))
    return folder


def _run(opencode: Path, project: Path, env: dict[str, str], prompt: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(opencode), "run", "--agent", "ft", prompt], cwd=project, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip


def test_opencode_run_says_hello(
    ft_serve: FtServe, env: dict[str, str], opencode: Path, tmp_path: Path
) -> None:
    """`opencode run PROMPT` streams a reply from ft and exits 0."""
    mark = ft_serve.mark()
    done = _run(opencode, _project(ft_serve, tmp_path / "project", {}), env, "Say hello.")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")


def test_opencode_run_with_the_write_tool(
    ft_serve: FtServe, env: dict[str, str], opencode: Path, tmp_path: Path
) -> None:
    """With its `write` tool on, a run in a scratch project completes and each tool round trip
    is answered (opencode has no option to force the call: whether the file appears is the
    model's choice)."""
    mark = ft_serve.mark()
    project = _project(ft_serve, tmp_path / "project", {"write": True})
    done = _run(opencode, project, env, "Write the word hello into a file named hello.txt.")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert_clean(ft_serve.requests_since(mark), "/v1/chat/completions")
