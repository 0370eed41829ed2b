"""What a web page, a proxied client or a raw socket can make the server do (issue 8)."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from ft.server import RunningServer, ServerSettings
from tests.support.server import fake_server

USER = [{"role": "user", "content": "hi"}]
STOP = "/v1/admin/prepare-stop"


def settings(**kw: object) -> ServerSettings:
    return ServerSettings(port=0, sse_heartbeat_s=0.2, graceful_timeout_s=0.5, **kw)  # type: ignore[arg-type]


# --- JSON routes take JSON only: a cross-site "simple request" never reaches them -------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
        ("/v1/tokenize", {"prompt": "hi"}),
        (STOP, {}),
    ],
)
async def test_json_routes_refuse_other_content_types_with_415(
    client: httpx.AsyncClient, server: RunningServer, path: str, body: dict[str, object]
) -> None:
    """JSON routes refuse other content types (and none) with a 415."""
    import json

    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {"content-type": content_type} if content_type else {}
        r = await client.post(path, content=json.dumps(body), headers=headers)
        assert r.status_code == 415, (path, content_type, r.text)
        error = r.json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert server.engine.state == "ready"
    if path != STOP:
        headers = {"content-type": "application/json; charset=utf-8"}
        r = await client.post(path, content=json.dumps(body), headers=headers)
        assert r.status_code == 200, r.text


async def test_anthropic_415_has_anthropics_shape(client: httpx.AsyncClient) -> None:
    """A 415 under /v1/messages has Anthropic's error shape."""
    r = await client.post("/v1/messages", content="{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


# --- admin routes ------------------------------------------------------------------------------


async def test_admin_refuses_an_origin_not_in_the_cors_list() -> None:
    """Admin routes refuse a browser Origin even when CORS allows every origin."""
    async with fake_server(settings=settings(cors_origins=("*",))) as s:
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            r = await c.post(STOP, json={}, headers={"Origin": "http://evil.example"})
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
            r = await c.post(STOP, json={}, headers={"Origin": "null"})
            assert r.status_code == 403
            assert s.engine.state == "ready"
    async with fake_server(settings=settings(cors_origins=("http://ops.example",))) as s:
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            r = await c.post(STOP, json={}, headers={"Origin": "http://ops.example"})
            assert r.status_code == 200 and s.engine.state == "stopped"


async def test_admin_through_a_proxy_needs_the_admin_key() -> None:
    """A loopback call carrying proxy headers is treated as remote: admin needs the admin key."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
            r = await c.post(STOP, json={}, headers={header: "203.0.113.9"})
            assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        assert s.engine.state == "ready"


async def test_admin_key_opens_admin_to_remote_callers_and_only_with_the_key() -> None:
    """--admin-key lets remote callers in with that key, and only with it."""
    async with fake_server(settings=settings(api_key="user-key", admin_key="ops-key")) as s:
        client = s.app.test_client()
        remote = {"client": ("10.1.2.3", 40000)}
        for key in (None, "user-key", "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = await client.post(STOP, json={}, headers=headers, scope_base=remote)
            assert r.status_code == 401, key
        assert s.engine.state == "ready"
        r = await client.post(STOP, json={}, headers={"Authorization": "Bearer ops-key"}, scope_base=remote)
        assert r.status_code == 200 and s.engine.state == "stopped"


async def test_admin_needs_the_api_key_when_one_is_set() -> None:
    """With --api-key, admin routes need it too."""
    async with fake_server(settings=settings(api_key="k")) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        assert (await c.post(STOP, json={})).status_code == 401
        assert (await c.post(STOP, json={}, headers={"Authorization": "Bearer k"})).status_code == 200


async def test_a_non_ascii_api_key_matches_its_utf8_bytes() -> None:
    """A non-ASCII API key matches the UTF-8 bytes the client sends."""
    key = "clé-ключ-🔑"
    async with fake_server(settings=settings(api_key=key)) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await c.get("/v1/models", headers={"Authorization": b"Bearer " + key.encode()})
        assert r.status_code == 200, r.text
        r = await c.get("/v1/models", headers={"x-api-key": key.encode()})
        assert r.status_code == 200
        r = await c.get("/v1/models", headers={"x-api-key": b"cl" + "é".encode("latin-1")})
        assert r.status_code == 401


# --- the connection: HTTP/1.x only unless --http2, and no smuggling shapes ----------------------


async def raw_exchange(base_url: str, data: bytes, enough: Callable[[bytes], bool] | None = None) -> bytes:
    """Send `data` on a fresh connection; return what comes back until the server closes it
    (or, with `enough`, once what came is enough). A server that does neither within 60 s fails
    the test: the bound only stops a hang."""
    url = urlsplit(base_url)
    assert url.hostname is not None and url.port is not None
    stream = await trio.open_tcp_stream(url.hostname, url.port)
    out = b""
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(60):
            while not (enough and enough(out)) and (chunk := await stream.receive_some()):
                out += chunk
    return out


def is_whole_response(out: bytes) -> bool:
    """Whether `out` holds a response's head and all the body its Content-Length promises."""
    head, sep, body = out.partition(b"\r\n\r\n")
    lengths = [h.split(b":", 1)[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
    return bool(sep) and bool(lengths) and len(body) >= int(lengths[0])


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame


async def test_cleartext_http2_is_refused_by_default(server: RunningServer) -> None:
    """Cleartext HTTP/2 is refused at once unless --http2 is set."""
    out = await raw_exchange(server.base_url, H2_PREFACE + H2_SETTINGS)  # until the server closes it
    assert out.startswith(b"HTTP/1.1 505 ")
    upgrade = (
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nConnection: close\r\n\r\n"
    )
    out = await raw_exchange(server.base_url, upgrade, enough=is_whole_response)
    assert out.startswith(b"HTTP/1.1 200 ") and b"101" not in out.split(b"\r\n")[0]


async def test_http2_is_served_with_the_flag() -> None:
    """With --http2, cleartext HTTP/2 is served."""
    async with fake_server(settings=settings(http2=True)) as s:
        # until a frame's header has come
        out = await raw_exchange(s.base_url, H2_PREFACE + H2_SETTINGS, enough=lambda out: len(out) >= 9)
    assert out[3:4] == b"\x04"  # the server's first frame is its SETTINGS


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", b"505"),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", b"505"),
        (
            b"POST /v1/tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"400",
        ),
    ],
)
async def test_odd_versions_and_content_length_with_transfer_encoding_are_refused(
    server: RunningServer, request_head: bytes, status: bytes
) -> None:
    """Unknown HTTP versions and Content-Length with Transfer-Encoding are refused with the right status."""
    out = await raw_exchange(server.base_url, request_head)  # until the server closes it
    assert out.startswith(b"HTTP/1.1 " + status + b" "), out[:100]


# --- tokenize and count_tokens are admitted like requests ---------------------------------------


async def test_tokenize_calls_beyond_the_workers_are_503_and_cannot_starve_generation() -> None:
    """Tokenize calls past the tokenizer workers are 503s, and generation still gets served."""
    from ft.config import EngineConfig
    from ft.engine.fake import delayed_inline
    from tests.support.engine import fake_hooks
    from tests.support.server import running_server

    hooks = fake_hooks(executor=delayed_inline(0.5))
    cfg = EngineConfig(num_pages=64, tokenizer_workers=1)
    async with running_server(cfg, hooks=hooks) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        statuses: list[int] = []

        async def call(path: str, body: dict[str, object]) -> None:
            statuses.append((await c.post(path, json=body)).status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(call, "/v1/tokenize", {"prompt": "x" * 1000})
            for _ in range(2):
                nursery.start_soon(call, "/v1/messages/count_tokens", {"model": "fake", "messages": USER})
        assert sorted(statuses) == [200, 503, 503, 503, 503], statuses
        r = await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
        assert r.status_code == 200
        await s.engine.prepare_stop(drain_timeout_s=1.0)
        r = await c.post("/v1/tokenize", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


# --- the smaller holes ------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)
async def test_chat_refuses_tools_it_cannot_honour(
    client: httpx.AsyncClient, extra: dict[str, object], param: str
) -> None:
    """Chat refuses tools it cannot honour (no function, a tool_choice naming no given tool) with a 400."""
    r = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1} | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_chat_serves_a_tool_choice_naming_a_given_tool(client: httpx.AsyncClient) -> None:
    """Chat serves every tool_choice form that names a given tool."""
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "f"}}):
        body = {"messages": USER, "max_tokens": 1, "tools": [TOOL], "tool_choice": choice}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"input": 5}, "input"),
        ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": 5}]}, "input[0].content"),
        ("/v1/messages", {"model": "fake", "max_tokens": 1, "messages": USER, "system": 5}, "system"),
        (
            "/v1/messages",
            {"model": "fake", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
    ],
)
async def test_union_fields_name_the_field_not_the_union_member(
    server: RunningServer, path: str, body: dict[str, object], param: str
) -> None:
    """An invalid union field's error names the field, not the union member."""
    client = server.app.test_client()
    r = await client.post(path, json=body)
    assert r.status_code == 400
    payload = await r.get_json()
    error = payload["error"]
    if "param" in error:
        assert error["param"] == param, error
    else:  # Anthropic's shape has no param: the message names it
        assert f"'{param}'" in error["message"], error


async def test_doubled_slashes_are_a_json_404_not_an_html_redirect(server: RunningServer) -> None:
    """`//v1//stats` is a JSON 404, not an HTML redirect."""
    out = await raw_exchange(
        server.base_url,
        b"GET //v1//stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        enough=is_whole_response,
    )
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ") and b"content-type: application/json" in head.lower()
    assert body.startswith(b'{"error":')


async def test_a_drain_abort_is_counted_aborted_and_is_no_overload() -> None:
    """A stream aborted by the drain ends with an api_error (not overloaded) and counts as aborted."""
    import json

    from ft.engine.fake import FakeRunner, text_script

    runner = FakeRunner(script=text_script("lorem " * 300), step_s=0.02)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        body = {"model": "fake", "max_tokens": 1000, "messages": USER, "stream": True}
        async with c.stream("POST", "/v1/messages", json=body) as r:
            lines = r.aiter_lines()
            while not (await lines.__anext__()).startswith("event: content_block_delta"):
                pass
            stop = await c.post(STOP, json={"drain_timeout_s": 0.1})
            rest = [line async for line in lines]
        (error,) = [json.loads(line[6:]) for line in rest if line.startswith("data: ") and '"error"' in line]
        assert error["error"]["type"] == "api_error" and "stopping" in error["error"]["message"]
        totals = stop.json()["requests"]
        assert totals["aborted"] == 1 and totals["failed"] == 0


async def test_models_and_token_ids_are_503_while_the_model_loads() -> None:
    """While the model loads, /v1/models and token-id checks answer 503."""
    import threading

    from ft.config import EngineConfig
    from ft.engine.fake import FakeRunner
    from tests.support.engine import fake_hooks, fake_parts
    from tests.support.server import running_server

    release = threading.Event()
    load = fake_parts(FakeRunner())

    def slow_load(config: EngineConfig):  # type: ignore[no-untyped-def]
        release.wait(10)
        return load(config)

    hooks = fake_hooks(load_model=slow_load)
    async with (
        running_server(EngineConfig(num_pages=64), hooks=hooks, wait_ready=False) as s,
        httpx.AsyncClient(base_url=s.base_url) as c,
    ):
        try:
            r = await c.get("/v1/models")
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
            for body in (
                {"messages": USER, "logit_bias": {"5": 1}},
                {"messages": USER, "stop_token_ids": [5]},
            ):
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
            r = await c.post("/v1/completions", json={"prompt": [5, 6]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        finally:
            release.set()
        await s.engine.wait_ready()
        assert (await c.get("/v1/models")).status_code == 200
        await s.engine.prepare_stop()
        assert (await c.get("/v1/models")).status_code == 503
