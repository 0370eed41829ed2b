"""The real clients against a real `ft serve`: the server process, what it logged, and where
the clients are installed.

`FtServe` is `ft serve` (the default model) as a child process logging JSON to a file; the
end-of-request lines (`ft.request`) are the protocol record a client test checks: every request
a client sent got a 2xx/3xx. `client_env` is the environment a client runs in: its home and XDG
folders in a scratch directory, telemetry and update checks off, a dummy key, and the server's
address as the only endpoint. Clients that do not install beside the test extra (npm packages,
Python packages whose pins conflict with it) are installed once into `CLIENTS_CACHE` and reused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).parents[2]
CLIENTS_CACHE = Path(os.environ.get("FT_CLIENTS_CACHE", Path.home() / ".cache" / "ft-clients"))
DUMMY_KEY = "ft-local-test-key"  # a key the clients insist on; ft runs without --api-key
INSTALL_TIMEOUT_S = 240
_LISTENING = re.compile(r"listening on (http://[^\s,\"]+)")


@dataclass(frozen=True)
class Logged:
    """One end-of-request line of ft's log."""

    method: str
    path: str
    status: int
    error: str | None
    finish_reason: str | None


class FtServe:
    """`ft serve --port 0` with the default model, its log in `log_path` (JSON lines); with
    `api_key`, served with `--api-key` and every call of its own sends the key (`headers`)."""

    def __init__(self, log_path: Path, *args: str, api_key: str | None = None) -> None:
        self.log_path = log_path
        self._sentinels = 0
        self._log = log_path.open("wb")
        self.headers = {"Authorization": f"Bearer {api_key}".encode()} if api_key else {}
        key_args = ["--api-key", api_key] if api_key else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ft.cli_serve", "--port", "0", "--log-format", "json", *key_args, *args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        try:
            self.base_url = self._wait_listening(timeout_s=120)
            self.model = self._wait_ready(timeout_s=180)
        except BaseException:
            self.close()  # the caller gets no object to close: do not leave the server running
            raise

    def _wait_listening(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ft serve exited {self.process.returncode}: {self.log_path.read_text()}")
            if match := _LISTENING.search(self.log_path.read_text()):
                return match.group(1)
            time.sleep(0.1)
        raise TimeoutError("ft serve did not listen")

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.base_url, timeout=10, headers=self.headers) as client:
            while time.monotonic() < deadline:
                if client.get("/health/ready").status_code == 200:
                    return str(client.get("/v1/models").json()["data"][0]["id"])
                time.sleep(0.2)
        raise TimeoutError("ft serve did not become ready")

    @property
    def api_base(self) -> str:
        """The OpenAI-style base URL (`…/v1`)."""
        return self.base_url + "/v1"

    def mark(self) -> int:
        """A position in the log: `requests_since(mark)` reads the lines after it."""
        self._settle()
        return self.log_path.stat().st_size

    def requests_since(self, mark: int) -> list[Logged]:
        """Every request that ended after `mark` (waits until each one has logged its line)."""
        self._settle()
        with self.log_path.open("rb") as f:
            f.seek(mark)
            lines = f.read().decode().splitlines()
        out = []
        for line in lines:
            record: dict[str, Any] = json.loads(line) if line.startswith("{") else {}
            is_sentinel = str(record.get("request_id", "")).startswith("sentinel-")
            if record.get("logger") == "ft.request" and not is_sentinel:
                out.append(
                    Logged(record["method"], record["path"], record["status"], record.get("error"),
                           record.get("finish_reason"))
                )  # fmt: skip
        return out

    def _settle(self) -> None:
        """Wait until no request is open, then until a sentinel's line is logged: every request
        that ended before it has logged its own."""
        self._sentinels += 1
        sentinel = f"sentinel-{self._sentinels}"
        with httpx.Client(base_url=self.base_url, timeout=10, headers=self.headers) as client:
            deadline = time.monotonic() + 30
            while client.get("/v1/stats").json()["requests"]["active"] > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("requests still open on ft")
                time.sleep(0.05)
            client.get("/v1/models", headers={"X-Request-Id": sentinel})
        needle = f'"request_id": "{sentinel}"'
        while needle not in self.log_path.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError("ft did not log the sentinel request")
            time.sleep(0.02)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 60 s: a loaded machine's drain is slow)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def assert_clean(logged: list[Logged], path: str) -> list[Logged]:
    """Assert the client reached `path` at least once and ft answered every request 2xx/3xx;
    return the requests on `path`."""
    failed = [r for r in logged if r.status >= 400]
    assert not failed, f"ft answered with errors: {failed}"
    on_path = [r for r in logged if r.path == path]
    assert on_path, f"the client never reached {path}: {logged}"
    return on_path


def client_env(home: Path, server: FtServe) -> dict[str, str]:
    """The environment a client process runs in: home and XDG dirs under `home`, telemetry
    and update checks off, the server as the OpenAI endpoint, no real keys or proxies."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "SYSTEMROOT", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    for sub in ("config", "cache", "data", "state"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env |= {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_STATE_HOME": str(home / "state"),
        "OPENAI_BASE_URL": server.api_base,
        "OPENAI_API_BASE": server.api_base,
        "OPENAI_API_KEY": DUMMY_KEY,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        # Telemetry, tracing exporters and update checks of the clients under test.
        "DO_NOT_TRACK": "1",
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "LANGSMITH_TRACING": "false",
        "LANGCHAIN_TRACING_V2": "false",
        "NPM_CONFIG_UPDATE_NOTIFIER": "false",
        "NO_UPDATE_NOTIFIER": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "LLM_USER_PATH": str(home / "llm"),
    }
    return env


def install_npm(name: str, *packages: str) -> Path | None:
    """`npm install PACKAGES` into `CLIENTS_CACHE/name` once (bounded); the folder, or None
    (and why on stderr) where npm is missing or the install fails."""
    npm = shutil.which("npm")
    if npm is None:
        return None
    folder = CLIENTS_CACHE / name
    stamp = folder / ".installed"
    if stamp.exists() and stamp.read_text() == " ".join(packages):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    command = [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", "--no-update-notifier",
               "--loglevel=error", "--fetch-retries=1", "--fetch-timeout=30000", *packages]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"npm install {' '.join(packages)}: timed out", file=sys.stderr)
        return None
    if done.returncode != 0:
        print(f"npm install {' '.join(packages)} failed: {done.stderr[-2000:]}", file=sys.stderr)
        return None
    stamp.write_text(" ".join(packages))
    return folder


def install_venv(name: str, *requirements: str) -> Path | None:
    """A virtual environment `CLIENTS_CACHE/name` (over this interpreter's packages) with
    `requirements` installed once (bounded): its python, or None where the install fails."""
    folder = CLIENTS_CACHE / name
    python = folder / "bin" / "python"
    stamp = folder / ".installed"
    if stamp.exists() and stamp.read_text() == " ".join(requirements):
        return python
    shutil.rmtree(folder, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(folder)], check=True,
                       capture_output=True, timeout=60)  # fmt: skip
        pip = [str(python), "-m", "pip", "install", "-q", "--timeout", "30", "--retries", "1"]
        install = [*pip, *requirements]
        done = subprocess.run(install, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        print(f"venv {name}: {e}", file=sys.stderr)
        return None
    if done.returncode != 0:
        print(f"pip install {' '.join(requirements)} failed: {done.stderr[-2000:]}", file=sys.stderr)
        return None
    stamp.write_text(" ".join(requirements))
    return python
