"""The chat page at `/`: its files, their content types and security headers, and the rules it
must not weaken (the API key, admin routes, CORS); `--no-web-ui` gives `/` back to the JSON
status."""

from __future__ import annotations

import argparse
import tomllib
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

import httpx

from ft.cli_serve import add_serve_arguments, configs_from_args
from ft.server.web import ASSETS, CONTENT_SECURITY_POLICY, read_static
from tests.support.server import fake_server

ROOT = Path(__file__).parents[3]
STATIC = ROOT / "ft" / "server" / "web" / "static"
KEY = "sekrit-key"
PAGE_TYPES = {"/": "text/html; charset=utf-8"} | {f"/web/{name}": kind for name, kind in ASSETS.items()}


def assert_page_headers(response: httpx.Response) -> None:
    """The headers every file of the page carries."""
    headers = response.headers
    assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert headers["referrer-policy"] == "no-referrer"


def test_the_policy_allows_nothing_inline_nothing_foreign_and_no_framing() -> None:
    """The CSP: own-origin scripts, styles and connections only, no framing, Trusted Types on."""
    directives = dict(d.split(" ", 1) for d in CONTENT_SECURITY_POLICY.split("; "))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == directives["style-src"] == directives["connect-src"] == "'self'"
    assert directives["frame-ancestors"] == directives["base-uri"] == directives["form-action"] == "'none'"
    assert directives["require-trusted-types-for"] == "'script'"
    assert "unsafe" not in CONTENT_SECURITY_POLICY and "http" not in CONTENT_SECURITY_POLICY


async def test_the_page_and_its_files_are_served_with_their_types_and_headers() -> None:
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for path, content_type in PAGE_TYPES.items():
            r = await c.get(path)
            assert r.status_code == 200, path
            assert r.headers["content-type"] == content_type, path
            assert_page_headers(r)
            name = "index.html" if path == "/" else path.removeprefix("/web/")
            assert r.content == (STATIC / name).read_bytes(), path


async def test_head_on_the_root_answers_200_without_a_body() -> None:
    """Clients probe the base URL first (Claude Code: `HEAD /`): the page answers it."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        head = await c.head("/")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"].startswith("text/html")


async def test_other_names_under_web_are_404_in_the_api_shape() -> None:
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for path in ("/web/", "/web/x.js", "/web/..%2Fpyproject.toml", "/web/static/app.js", "/index.html"):
            r = await c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["type"] == "invalid_request_error", path
        assert (await c.post("/", json={})).status_code == 405


async def test_with_an_api_key_the_page_is_served_but_its_api_calls_need_the_key() -> None:
    async with fake_server(api_key=KEY) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for path in PAGE_TYPES:
            assert (await c.get(path)).status_code == 200, path
        assert (await c.head("/")).status_code == 200
        # Only the page's own files are open: nothing else under /web/, no other method on /.
        assert (await c.get("/web/nope.js")).status_code == 401
        assert (await c.post("/", json={})).status_code == 401
        assert (await c.get("/v1/models")).status_code == 401
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert (await c.get("/v1/models", headers=auth)).status_code == 200
        r = await c.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


async def test_no_spelling_of_a_page_path_opens_another_route_without_the_key() -> None:
    """The exemption is the exact decoded path of a page file: case, slashes, encoded dots and
    slashes, NUL or `;` reach nothing else without the key, by GET or HEAD."""
    async with fake_server(api_key=KEY) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for path in (
            "/web/app.js/", "/WEB/app.js", "/web//app.js", "/web/..%2Fapp.js", "/web/%2e%2e/v1/models",
            "/web/app.js%2F..%2F..%2Fv1%2Fmodels", "/web/app.js%00", "/web/app.js;x",
            "/v1/models?/web/app.js",
        ):  # fmt: skip
            for method in ("GET", "HEAD"):
                assert (await c.request(method, s.base_url + path)).status_code == 401, (method, path)
        for path in ("/web/%61pp.js", "/web/app.js?x=1", "/?a=1"):  # the same files, spelled otherwise
            assert (await c.get(path)).status_code == 200, path
        for method in ("PUT", "DELETE", "PATCH"):
            assert (await c.request(method, "/")).status_code == 401, method


async def test_the_pages_origin_opens_no_admin_route() -> None:
    """A fetch from the page carries its own origin, which `--cors-origins` does not list: even
    script running in the page cannot stop the server."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        r = await c.post("/v1/admin/prepare-stop", json={}, headers={"Origin": s.base_url})
        assert r.status_code == 403
        assert (await c.get("/health")).json()["status"] == "ok"


async def test_the_page_sends_no_cors_headers_unless_configured() -> None:
    """The page calls its own origin; serving it allows no other origin to read anything."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for path in ("/", "/web/app.js", "/v1/models"):
            r = await c.get(path, headers={"Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in r.headers, path


async def test_no_web_ui_gives_the_root_back_to_the_json_status() -> None:
    async with fake_server(web_ui=False) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        r = await c.get("/")
        assert r.status_code == 200 and r.json() == {"status": "ok", "model": "fake"}
        assert (await c.get("/web/app.js")).status_code == 404
    async with (
        fake_server(web_ui=False, api_key=KEY) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        assert (await c.get("/")).status_code == 401  # the JSON root needs the key, as before
        assert (await c.get("/web/app.js")).status_code == 401


class PageParser(HTMLParser):
    """Every tag of the page with its attributes, and any text inside a `<script>`."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.script_text = ""
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.script_text += data


def test_the_page_has_no_inline_script_style_or_handler_and_links_only_its_files() -> None:
    page = PageParser()
    page.feed(read_static("index.html").decode())
    assert page.script_text.strip() == ""
    referenced = set()
    for tag, attrs in page.tags:
        assert tag != "style", "inline <style>"
        assert "style" not in attrs and not any(a.startswith("on") for a in attrs), (tag, attrs)
        for attr in ("src", "href"):
            if attrs.get(attr):
                referenced.add(str(attrs[attr]))
    # markdown.js is imported by app.js (a module: its relative import resolves under /web/).
    assert referenced == {f"/web/{name}" for name in ASSETS if name != "markdown.js"}
    assert 'from "./markdown.js";' in read_static("app.js").decode()


def test_the_scripts_build_no_markup_from_strings() -> None:
    """Neither script assigns HTML strings (the CSP's Trusted Types would refuse it anyway)."""
    for name in ("app.js", "markdown.js"):
        source = read_static(name).decode()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function("):
            assert sink not in source, (name, sink)


def test_every_static_file_is_package_data() -> None:
    """pyproject ships each file of the page (a wheel without them would serve a broken page)."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    web = patterns["ft.server.web"]
    for path in STATIC.iterdir():
        assert any(fnmatch(f"static/{path.name}", p) for p in web), path.name
    assert sorted(p.name for p in STATIC.iterdir()) == sorted(["index.html", *ASSETS])


def test_no_web_ui_is_the_cli_flag_for_the_setting() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert configs_from_args(parser.parse_args([]))[1].web_ui is True
    assert configs_from_args(parser.parse_args(["--no-web-ui"]))[1].web_ui is False
