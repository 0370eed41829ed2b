"""Headless Chromium driven over the W3C WebDriver protocol, with httpx (no selenium).

Debian's `chromium` and `chromium-driver` packages (`.ci/run` installs them when apt can);
`browser()` yields None where either is missing. The protocol is a handful of JSON requests
(session, navigate, find, click, type, execute script), so speaking it directly costs less than
selenium, whose Selenium Manager also tries to download a driver when it finds none.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
CHROMIUM = ("chromium", "chromium-browser")
T = TypeVar("T")


class WebDriverError(RuntimeError):
    """An error the driver answered (`error`, `message`)."""


class Browser:
    """One WebDriver session on a running chromedriver."""

    def __init__(self, http: httpx.Client, session_id: str) -> None:
        self.http = http
        self.session = f"/session/{session_id}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(method, self.session + path, json=body)
        value = response.json()["value"]
        if response.status_code != 200:
            raise WebDriverError(f"{value.get('error')}: {value.get('message', '')[:500]}")
        return value

    def get(self, url: str) -> None:
        """Navigate to `url` and wait for its load event."""
        self._call("POST", "/url", {"url": url})

    def find(self, css: str) -> str:
        """The id of the first element matching `css` (WebDriverError when none does)."""
        return str(self._call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT])

    def click(self, css: str) -> None:
        self._call("POST", f"/element/{self.find(css)}/click", {})

    def type(self, css: str, text: str) -> None:
        """Type `text` into the element (`\\ue007` is Enter)."""
        self._call("POST", f"/element/{self.find(css)}/value", {"text": text})

    def run(self, script: str, *args: Any) -> Any:
        """Run `script` (a function body; `arguments` holds `args`) in the page; its return value."""
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def run_async(self, script: str, *args: Any) -> Any:
        """Run `script`, whose last argument is a callback it calls with the result."""
        return self._call("POST", "/execute/async", {"script": script, "args": list(args)})

    def wait_for(self, check: Callable[[], T], timeout_s: float, what: str) -> T:
        """Poll `check` until it returns something truthy; that value (TimeoutError past `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s} s for {what}")
            time.sleep(0.05)

    def screenshot(self) -> bytes:
        """The page as a PNG."""
        return base64.b64decode(self._call("GET", "/screenshot"))

    def logs(self) -> list[dict[str, Any]]:
        """The browser console's entries since the last call (Chromium's `goog:loggingPrefs`)."""
        return list(self._call("POST", "/se/log", {"type": "browser"}))


def chromium_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver) where both are installed, else None."""
    binary = next((p for name in CHROMIUM if (p := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def browser() -> Iterator[Browser | None]:
    """A headless Chromium session (None where Chromium or its driver is not installed); the
    driver and the browser are stopped on leaving."""
    paths = chromium_paths()
    if paths is None:
        yield None
        return
    binary, driver = paths
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="ft-chromium-") as profile:
        process = subprocess.Popen(
            [driver, f"--port={port}", "--allowed-ips=127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                _wait_driver(http, process)
                capabilities = {
                    "browserName": "chrome",
                    "goog:loggingPrefs": {"browser": "ALL"},
                    "goog:chromeOptions": {
                        "binary": binary,
                        "args": [
                            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                            f"--user-data-dir={profile}", "--no-first-run", "--disable-extensions",
                            "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", "--no-proxy-server", "--window-size=1200,900",
                        ],
                    },
                }  # fmt: skip
                r = http.post("/session", json={"capabilities": {"alwaysMatch": capabilities}})
                if r.status_code != 200:
                    raise WebDriverError(f"no session: {r.text[:1000]}")
                session = Browser(http, r.json()["value"]["sessionId"])
                try:
                    yield session
                finally:
                    with contextlib.suppress(httpx.HTTPError):
                        http.delete(session.session)
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_driver(http: httpx.Client, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise WebDriverError(f"chromedriver exited {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if http.get("/status").json()["value"]["ready"]:
                return
        time.sleep(0.1)
    raise TimeoutError("chromedriver did not start")
