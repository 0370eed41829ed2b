"""The chat page in headless Chromium against a scripted server: the real page files (with their
headers) and API answers no healthy `ft serve` gives on cue. `/v1/models` failing (a proxy's
502, an engine that failed), a stream cut before `[DONE]`, an error event mid-stream, reasoning
opened while it streams. No model is loaded; skips without Debian's `chromium` and
`chromium-driver`."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ft.server.web import ASSETS, SECURITY_HEADERS, read_static
from tests.support.webdriver import Browser, browser, chromium_paths

MODELS_OK = (200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
Write = Callable[[bytes], None]

LAST_ANSWER = """
const answers = document.querySelectorAll('.message.assistant');
const last = answers[answers.length - 1];
return last ? {state: last.dataset.state || '', meta: last.querySelector('.meta').textContent,
               text: last.querySelector('.body').textContent} : null;
"""


def sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def delta(**fields: str) -> bytes:
    return sse(
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": fields, "finish_reason": None}]}
    )


def finish(reason: str = "stop") -> bytes:
    return sse(
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    )


@dataclass
class Script:
    """What the scripted server answers: `/v1/models` in turn (the last one repeats), and a chat
    stream written by `chat(write)` (the connection closes when it returns)."""

    models: list[tuple[int, Any]] = field(default_factory=lambda: [MODELS_OK])
    chat: Callable[[Write], None] = lambda write: None
    models_calls: int = 0
    chat_bodies: list[Any] = field(default_factory=list)
    key: str | None = None  # when set, /v1/models answers 401 to any other key


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True
    script = Script()


class Handler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        script = self.server.script
        name = self.path.removeprefix("/web/")
        if self.path == "/":
            self._send(200, read_static("index.html"), "text/html; charset=utf-8", SECURITY_HEADERS)
        elif name in ASSETS:
            self._send(200, read_static(name), ASSETS[name], SECURITY_HEADERS)
        elif (
            self.path == "/v1/models"
            and script.key
            and self.headers.get("Authorization") != f"Bearer {script.key}"
        ):
            self._send(
                401,
                b'{"error": {"message": "invalid API key", "code": "invalid_api_key"}}',
                "application/json",
            )
        elif self.path == "/v1/models":
            status, body = script.models[min(script.models_calls, len(script.models) - 1)]
            script.models_calls += 1
            if isinstance(body, str):
                self._send(status, body.encode(), "text/html")
            else:
                self._send(status, json.dumps(body).encode(), "application/json")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self) -> None:
        self.server.script.chat_bodies.append(
            json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def write(data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        self.server.script.chat(write)


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    if chromium_paths() is None:
        pytest.skip("chromium and chromium-driver are not installed (Debian's packages of those names)")
    httpd = ScriptedServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def chromium(server: ScriptedServer) -> Iterator[Browser]:
    with browser() as b:
        assert b is not None
        yield b


def open_page(b: Browser, server: ScriptedServer, script: Script) -> None:
    server.script = script
    b.get(f"http://127.0.0.1:{server.server_address[1]}/")


def status(b: Browser) -> str:
    return str(b.run("return document.getElementById('status').textContent"))


def ready(b: Browser) -> bool:
    return bool(b.run("return !document.getElementById('send').disabled"))


def ask(b: Browser, text: str) -> dict[str, str]:
    """Send `text` once the page is ready; the answer once it has ended."""
    b.wait_for(lambda: ready(b), 20, "the page to be ready")
    b.type("#prompt", text + "\ue007")

    def ended() -> dict[str, str] | None:
        answer = b.run(LAST_ANSWER)
        return answer if answer and answer["state"] not in ("", "streaming") else None

    return b.wait_for(ended, 20, "the answer to end")


def test_a_failed_models_call_is_retried_until_the_server_answers(
    chromium: Browser, server: ScriptedServer
) -> None:
    """A proxy's 502 (its own HTML page) while ft restarts: the page asks again."""
    script = Script(models=[(502, "<html>Bad Gateway</html>"), MODELS_OK])
    open_page(chromium, server, script)
    chromium.wait_for(lambda: ready(chromium), 20, "the page to retry /v1/models")
    assert script.models_calls >= 2
    assert status(chromium) == "ready"


def test_a_failed_engine_shows_the_servers_message_not_loading(
    chromium: Browser, server: ScriptedServer
) -> None:
    """A 503 is not always a model still loading: the engine's failure is what the page shows."""
    failed = {
        "error": {
            "message": "the engine failed: out of memory",
            "type": "server_error",
            "code": "engine_error",
        }
    }
    open_page(chromium, server, Script(models=[(503, failed)]))
    chromium.wait_for(
        lambda: "the engine failed: out of memory" in status(chromium), 10, "the engine's message"
    )
    assert not ready(chromium)


def test_a_model_still_loading_is_waited_for(chromium: Browser, server: ScriptedServer) -> None:
    loading = {"error": {"message": "the model is still loading; retry shortly", "code": "model_loading"}}
    script = Script(models=[(503, loading), (503, loading), MODELS_OK])
    open_page(chromium, server, script)
    chromium.wait_for(lambda: ready(chromium), 20, "the page once loaded")
    assert script.models_calls >= 3


def test_a_stream_cut_before_its_end_is_an_error_not_an_answer(
    chromium: Browser, server: ScriptedServer
) -> None:
    """The connection closes cleanly after a few words (no finish, no `[DONE]`): the answer is
    marked cut, and the next request does not carry it as the assistant's turn."""

    def cut(write: Write) -> None:
        write(delta(role="assistant", content="The beginning of"))

    open_page(chromium, server, Script(chat=cut))
    answer = ask(chromium, "Tell me a story")
    assert answer["state"] == "error" and "error: " in answer["meta"], answer
    assert "The beginning of" in answer["text"]  # what came stays shown

    def answered(write: Write) -> None:
        write(delta(content="Hello"))
        write(finish())
        write(sse("[DONE]"))

    server.script.chat = answered
    assert ask(chromium, "Hi")["state"] == "done"
    assert server.script.chat_bodies[-1]["messages"] == [{"role": "user", "content": "Hi"}]


def test_an_error_event_mid_stream_is_shown_with_what_came(chromium: Browser, server: ScriptedServer) -> None:
    def failing(write: Write) -> None:
        write(delta(content="Partial"))
        write(sse({"error": {"message": "the engine failed: boom", "type": "server_error"}}))
        write(sse("[DONE]"))

    open_page(chromium, server, Script(chat=failing))
    answer = ask(chromium, "Hi")
    assert answer["state"] == "error" and "the engine failed: boom" in answer["meta"], answer
    assert "Partial" in answer["text"]


def test_reasoning_opened_while_it_streams_stays_open(chromium: Browser, server: ScriptedServer) -> None:
    """Each chunk re-renders the answer: the reasoning the reader opened must not fold shut."""
    opened = threading.Event()

    def thinking(write: Write) -> None:
        write(delta(reasoning_content="Let me think. "))
        assert opened.wait(20)
        for _ in range(5):
            write(delta(reasoning_content="More thought. "))
        write(delta(content="The answer."))
        write(finish())
        write(sse("[DONE]"))

    open_page(chromium, server, Script(chat=thinking))
    chromium.wait_for(lambda: ready(chromium), 20, "the page to be ready")
    chromium.type("#prompt", "Why?\ue007")
    chromium.wait_for(
        lambda: chromium.run("return !!document.querySelector('.assistant details')"), 20, "reasoning"
    )
    chromium.click(".assistant details summary")
    assert chromium.run("return document.querySelector('.assistant details').open") is True
    opened.set()
    chromium.wait_for(lambda: (a := chromium.run(LAST_ANSWER)) and a["state"] == "done", 20, "the answer")
    details = chromium.run(
        "const d = document.querySelector('.assistant details'); return {open: d.open, text: d.textContent};"
    )
    assert details["open"] is True and "More thought." in details["text"], details


def test_a_reader_scrolled_up_in_a_long_answer_is_not_pulled_down(
    chromium: Browser, server: ScriptedServer
) -> None:
    """Each chunk scrolls to the end only for a reader who is at the end: one who scrolled up
    to read the start of a long answer stays there."""
    scrolled = threading.Event()

    def long_answer(write: Write) -> None:
        write(delta(content="".join(f"Line {n}.\n\n" for n in range(200))))
        assert scrolled.wait(20)
        for n in range(5):
            write(delta(content=f"More {n}.\n\n"))
        write(finish())
        write(sse("[DONE]"))

    open_page(chromium, server, Script(chat=long_answer))
    chromium.wait_for(lambda: ready(chromium), 20, "the page to be ready")
    chromium.type("#prompt", "A long one\ue007")
    at_end = "const m = document.getElementById('messages');"
    at_end += " return m.scrollHeight - m.scrollTop - m.clientHeight < 2;"
    chromium.wait_for(lambda: "Line 199." in chromium.run(LAST_ANSWER)["text"], 20, "the first lines")
    assert chromium.run(at_end) is True  # followed to the end
    chromium.run("document.getElementById('messages').scrollTop = 0;")
    scrolled.set()
    chromium.wait_for(lambda: (a := chromium.run(LAST_ANSWER)) and a["state"] == "done", 20, "the answer")
    assert "More 4." in chromium.run(LAST_ANSWER)["text"]
    assert chromium.run("return document.getElementById('messages').scrollTop") == 0


def test_a_wrong_key_is_refused_and_a_right_one_replaces_it(
    chromium: Browser, server: ScriptedServer
) -> None:
    open_page(chromium, server, Script(key="right"))
    chromium.run("sessionStorage.setItem('ft.apiKey', 'wrong');")
    chromium.get(f"http://127.0.0.1:{server.server_address[1]}/")
    panel = "return !document.getElementById('key-panel').hidden"
    panel += " && document.getElementById('key-reason').textContent"
    assert "refused" in chromium.wait_for(lambda: chromium.run(panel), 20, "the key prompt")
    chromium.type("#api-key", "right")
    chromium.click("#save-key")
    chromium.wait_for(lambda: ready(chromium), 20, "the page with the right key")
    assert chromium.run("return sessionStorage.getItem('ft.apiKey')") == "right"


def test_the_page_logs_no_script_error_or_policy_violation(chromium: Browser, server: ScriptedServer) -> None:
    """All of the above ran under the page's CSP: the console holds no script error and no
    violation (the "network" entries are the failures the tests scripted). A foreign image,
    added last, shows the check sees violations."""
    open_page(chromium, server, Script())
    chromium.wait_for(lambda: ready(chromium), 20, "the page")
    chromium.run(
        "const i = document.createElement('img'); i.src = 'https://evil.example/x.png';"
        " document.body.append(i);"
    )
    entries: list[dict[str, Any]] = []

    def violation_seen() -> bool:
        entries.extend(chromium.logs())
        return any("evil.example" in str(e.get("message")) and e.get("source") == "security" for e in entries)

    chromium.wait_for(violation_seen, 10, "the foreign image's violation in the console")
    problems = [e for e in entries if e.get("level") == "SEVERE" and e.get("source") != "network"]
    assert [e for e in problems if "evil.example" not in str(e.get("message"))] == [], problems
