"""The chat page in a real browser (headless Chromium over WebDriver) against `ft serve` with the
default model and `--api-key`: it asks for the key, streams an answer, stops it mid-stream (the
server's active count returns to 0), chats on, starts a new chat; and its Markdown renderer,
run in the page, turns hostile text into no element, script or handler. Skips without Debian's
`chromium` and `chromium-driver`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.clients import FtServe
from tests.support.webdriver import Browser, browser, chromium_paths

pytestmark = pytest.mark.slow

KEY = "page-test-key-é"  # not ASCII: the page must send it as the server compares it
LONG_PROMPT = "Write a very long story about a dragon who learns to bake bread, with many chapters."
ALLOWED_ATTRIBUTES = {"href", "rel", "target", "class", "start"}
ALLOWED_TAGS = {"a", "br", "code", "em", "h3", "h4", "h5", "hr", "li", "ol", "p", "pre", "strong", "ul"}

ASSISTANT_TEXT = """
const bodies = document.querySelectorAll('.message.assistant .body');
return bodies.length ? bodies[bodies.length - 1].textContent : '';
"""
LAST_ANSWER = """
const answers = document.querySelectorAll('.message.assistant');
const last = answers[answers.length - 1];
return last ? {state: last.dataset.state || '', meta: last.querySelector('.meta').textContent} : null;
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FtServe]:
    """`ft serve --api-key KEY` with the default model (only where Chromium can drive it)."""
    if chromium_paths() is None:
        pytest.skip("chromium and chromium-driver are not installed (Debian's packages of those names)")
    server = FtServe(tmp_path_factory.mktemp("web") / "ft.log", api_key=KEY)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def page(served: FtServe) -> Iterator[Browser]:
    """A browser on the chat page, past the key prompt."""
    with browser() as b:
        assert b is not None
        b.get(served.base_url + "/")
        b.wait_for(lambda: b.run("return !document.getElementById('key-panel').hidden"), 30, "the key prompt")
        b.type("#api-key", KEY)
        b.click("#save-key")
        b.wait_for(lambda: b.run("return !document.getElementById('send').disabled"), 30, "the page")
        yield b


def stats(served: FtServe) -> dict[str, Any]:
    r = httpx.get(served.base_url + "/v1/stats", headers=served.headers, timeout=10)
    r.raise_for_status()
    return dict(r.json()["requests"])


def finished_answer(page: Browser, timeout_s: float) -> dict[str, str]:
    """The last answer once it has ended (done, stopped or error): its state and facts."""

    def ended() -> dict[str, str] | None:
        answer = page.run(LAST_ANSWER)
        return answer if answer and answer["state"] not in ("", "streaming") else None

    return page.wait_for(ended, timeout_s, "the answer to end")


def set_field(page: Browser, element_id: str, value: str) -> None:
    page.run("document.getElementById(arguments[0]).value = arguments[1];", element_id, value)


def test_the_key_is_kept_for_the_session_and_the_models_are_listed(page: Browser, served: FtServe) -> None:
    assert page.run("return sessionStorage.getItem('ft.apiKey')") == KEY
    assert page.run("return localStorage.getItem('ft.apiKey')") is None
    options = page.run("return [...document.querySelectorAll('#model option')].map(o => o.value)")
    assert served.model in options
    assert page.run("return document.getElementById('model').value") == served.model


def test_an_answer_streams_and_stop_frees_the_request(page: Browser, served: FtServe) -> None:
    before = stats(served)
    set_field(page, "max-tokens", "4000")
    set_field(page, "temperature", "0")  # greedy: a long story, not a lucky early end
    set_field(page, "system", "You are a storyteller. Your stories are long.")
    page.type("#prompt", LONG_PROMPT)
    page.click("#send")
    page.wait_for(lambda: len(page.run(ASSISTANT_TEXT)) >= 40, 120, "streamed text")
    assert stats(served)["active"] == 1  # still streaming: 4000 tokens take far longer
    assert page.run("return document.getElementById('send').hidden") is True
    page.click("#stop")
    after = page.wait_for(lambda: (s := stats(served))["active"] == 0 and s, 30, "the server to free it")
    assert after["aborted"] == before["aborted"] + 1
    answer = finished_answer(page, 10)
    assert answer["state"] == "stopped" and "stopped" in answer["meta"] and "TTFT" in answer["meta"], answer
    assert page.run("return document.getElementById('stop').hidden") is True
    assert page.run("return document.getElementById('send').disabled") is False


def test_the_chat_goes_on_with_timings_then_a_new_chat_clears_it(page: Browser, served: FtServe) -> None:
    before = stats(served)
    set_field(page, "max-tokens", "12")
    page.type("#prompt", "Now count from one to twenty in words.\ue007")  # Enter sends
    answer = finished_answer(page, 120)
    assert answer["state"] == "done", answer
    for fact in ("TTFT", "tokens/s", "tokens ·", "finish: "):
        assert fact in answer["meta"], answer
    assert stats(served)["completed"] == before["completed"] + 1
    assert page.run("return document.querySelectorAll('.message').length") == 4
    page.click("#new-chat")
    assert page.run("return document.querySelectorAll('.message').length") == 0


def test_a_refused_request_shows_the_servers_message_and_the_page_goes_on(page: Browser) -> None:
    """A prompt longer than the context is a 400 before the stream: the answer shows the
    server's message, the failed turn leaves the history, and the next message is answered."""
    set_field(page, "max-tokens", "4")
    set_field(page, "prompt", "word " * 10_000)
    page.click("#send")
    answer = finished_answer(page, 60)
    assert answer["state"] == "error" and "error: " in answer["meta"] and "context" in answer["meta"], answer
    assert page.run("return document.getElementById('send').disabled") is False
    page.type("#prompt", "Hi!\ue007")
    assert finished_answer(page, 120)["state"] == "done"


def test_the_page_runs_under_its_policy_without_violations(page: Browser) -> None:
    """Everything the page does is allowed by its CSP (a violation logs a console error), and
    the policy is in force: Trusted Types refuse a string assigned to innerHTML."""

    # "network" entries are the 401 and 400 the tests above asked for; a CSP violation or a
    # script error is logged under another source.
    problems = [e for e in page.logs() if e.get("level") == "SEVERE" and e.get("source") != "network"]
    assert problems == [], problems
    refused = page.run(
        "try { document.createElement('div').innerHTML = '<b>x</b>'; return 'assigned'; }"
        " catch (e) { return e.name; }"
    )
    assert refused == "TypeError"


HOSTILE = [
    "<script>window.__ftPwned = 1</script>",
    '<img src=x onerror="window.__ftPwned = 1">',
    '<svg onload="window.__ftPwned = 1"></svg><iframe srcdoc="<script>parent.__ftPwned=1</script>">',
    "[click](javascript:window.__ftPwned=1) [c2](JAVASCRIPT:window.__ftPwned=1) [c3]( javascript:x )",
    "[d](data:text/html,<script>alert(1)</script>) [v](vbscript:x) [r](/v1/admin/prepare-stop)",
    '```\n</code></pre><img src=x onerror="window.__ftPwned = 1">\n```',
    '```" onmouseover="window.__ftPwned=1\nx\n```',
    "`` a `<img src=x onerror=window.__ftPwned=1>` b `` and ``` ` ```",
    '**<b onclick="window.__ftPwned=1">bold</b>** _<i>x</i>_',
    '[ok](https://example.com/"onmouseover="window.__ftPwned=1) &lt;script&gt;',
    "- <style>*{display:none}</style>\n- <link rel=stylesheet href=https://evil.example/x.css>",
]

RENDER_IN_PAGE = """
const [texts, done] = arguments;
import('/web/markdown.js').then(({ renderMarkdown }) => {
  window.__ftPwned = 0;
  const host = document.createElement('div');
  document.body.append(host);
  const results = texts.map((text) => {
    host.replaceChildren(renderMarkdown(text));
    for (const a of host.querySelectorAll('a')) a.dispatchEvent(new MouseEvent('mouseover'));
    const all = [...host.querySelectorAll('*')];
    return {
      tags: all.map((e) => e.tagName.toLowerCase()),
      attributes: all.flatMap((e) => [...e.attributes].map((a) => a.name)),
      hrefs: [...host.querySelectorAll('a')].map((a) => a.href),
      text: host.textContent,
    };
  });
  host.remove();
  setTimeout(() => done({
    results,
    pwned: window.__ftPwned,
    scripts: document.scripts.length,
    embedded: document.querySelectorAll('img, svg, iframe, object, embed, style, link[href*=evil]').length,
  }), 300);
}, (e) => done({ error: String(e) }));
"""


def test_the_renderer_in_the_page_turns_hostile_text_into_no_element_or_script(page: Browser) -> None:
    outcome = page.run_async(RENDER_IN_PAGE, HOSTILE)
    assert "error" not in outcome, outcome
    assert outcome["pwned"] == 0
    assert outcome["scripts"] == 1  # app.js only
    assert outcome["embedded"] == 0
    for text, result in zip(HOSTILE, outcome["results"], strict=True):
        assert set(result["tags"]) <= ALLOWED_TAGS, (text, result)
        assert set(result["attributes"]) <= ALLOWED_ATTRIBUTES, (text, result)
        assert all(h.startswith("https://") for h in result["hrefs"]), (text, result)
    # The markup is shown as the text it is.
    assert outcome["results"][0]["text"] == HOSTILE[0]
    assert "<img src=x onerror" in outcome["results"][1]["text"]
    assert "javascript:window.__ftPwned=1" in outcome["results"][3]["text"]
