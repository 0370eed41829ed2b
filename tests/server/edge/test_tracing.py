"""Request ids on every response, one log line per request, JSON logs that carry the id."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import httpx
import pytest

from ft.engine.fake import FakeRunner, text_script
from ft.logs import JsonFormatter, RequestIdFilter, TextFormatter
from ft.server.edge.tracing import MAX_REQUEST_ID_LEN, valid_request_id
from tests.support.server import TEST_SETTINGS, fake_server, parse_sse, wait_idle

USER = [{"role": "user", "content": "the secret prompt"}]
CHAT = "/v1/chat/completions"


@contextmanager
def captured_logs(formatter: logging.Formatter, level: int = logging.DEBUG) -> Iterator[io.StringIO]:
    """Every `ft` log record, formatted by `formatter` into a string buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger("ft")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def json_lines(out: io.StringIO) -> list[dict[str, object]]:
    """Each line of `out` parsed as one JSON object."""
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_valid_request_ids_are_short_printable_ascii() -> None:
    assert valid_request_id("abc-123_XYZ:/.=")
    assert valid_request_id("x" * MAX_REQUEST_ID_LEN)
    for bad in ("", "x" * (MAX_REQUEST_ID_LEN + 1), "has space", "tab\t", "naïve", "new\nline"):
        assert not valid_request_id(bad)


async def test_an_incoming_request_id_round_trips_on_success_error_and_stream(
    client: httpx.AsyncClient,
) -> None:
    """The client's X-Request-Id comes back on a 200, on 4xx errors and on a stream."""
    ok = await client.post(CHAT, json={"messages": USER, "max_tokens": 2}, headers={"X-Request-Id": "ok-1"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "ok-1"
    bad = await client.post(CHAT, json={"messages": 3}, headers={"X-Request-Id": "bad-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
    missing = await client.get("/v1/nothing", headers={"X-Request-Id": "404-1"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "404-1"
    body = {"messages": USER, "max_tokens": 3, "stream": True}
    async with client.stream("POST", CHAT, json=body, headers={"X-Request-Id": "stream-1"}) as r:
        assert r.headers["x-request-id"] == "stream-1"
        assert parse_sse((await r.aread()).decode())[-1] == "[DONE]"
    health = await client.get("/health/live", headers={"X-Request-Id": "probe-1"})
    assert health.headers["x-request-id"] == "probe-1"


async def test_a_missing_or_invalid_request_id_is_replaced_by_a_new_one(client: httpx.AsyncClient) -> None:
    """Absent, too long or not printable ASCII: the server makes a fresh id for each request."""
    ids = set()
    for headers in ({}, {"X-Request-Id": "x" * 500}, {"X-Request-Id": "with space"}):
        r = await client.get("/health", headers=headers)
        rid = r.headers["x-request-id"]
        assert valid_request_id(rid) and rid.startswith("req-")
        ids.add(rid)
    assert len(ids) == 3


async def test_the_request_id_reaches_the_engines_request_and_the_actors_debug_lines(
    client: httpx.AsyncClient,
) -> None:
    """The id names the engine request: every actor's DEBUG line about it carries it."""
    with captured_logs(TextFormatter()) as out:
        r = await client.post(
            CHAT, json={"messages": USER, "max_tokens": 2}, headers={"X-Request-Id": "trace-me"}
        )
        assert r.status_code == 200
        await wait_idle(client)
    mine = [line for line in out.getvalue().splitlines() if "[trace-me]" in line]
    loggers = {line.split()[3] for line in mine}
    assert {"ft.engine", "ft.tokenizer", "ft.scheduler", "ft.detokenizer", "ft.request"} <= loggers
    assert any("scheduled after" in line for line in mine)


async def test_json_logs_parse_and_carry_the_request_id(client: httpx.AsyncClient) -> None:
    """JSON format: one object per line; the request's end line has its id and measurements."""
    with captured_logs(JsonFormatter()) as out:
        headers = {"X-Request-Id": "json-1"}
        r = await client.post(CHAT, json={"messages": USER, "max_tokens": 3}, headers=headers)
        assert r.status_code == 200
        await wait_idle(client)
    lines = json_lines(out)
    end = [x for x in lines if x["logger"] == "ft.request" and x.get("request_id") == "json-1"]
    assert len(end) == 1
    line = end[0]
    assert line["level"] == "info" and line["status"] == 200 and line["path"] == CHAT
    assert line["prompt_tokens"] and line["output_tokens"] == 3 and line["finish_reason"] == "length"
    assert isinstance(line["ttft_s"], float) and isinstance(line["duration_s"], float)
    assert line["client_left"] is False and line["stream"] is False
    assert all(x.get("request_id") == "json-1" for x in lines if x["logger"] != "ft.request")
    assert "secret" not in out.getvalue()  # no prompt or output text without --log-prompts


async def test_log_prompts_adds_the_prompt_and_output_to_the_end_line() -> None:
    """--log-prompts: the end-of-request line carries the messages and the output text."""
    runner = FakeRunner(script=text_script("hello there"))
    settings = replace(TEST_SETTINGS, log_prompts=True)
    async with fake_server(runner, settings=settings) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        with captured_logs(JsonFormatter(), logging.INFO) as out:
            for stream in (False, True):
                r = await c.post(CHAT, json={"messages": USER, "max_tokens": 2, "stream": stream})
                assert r.status_code == 200
            await wait_idle(c)
    ends = [x for x in json_lines(out) if x["logger"] == "ft.request"]
    assert [x["stream"] for x in ends] == [False, True]
    for end in ends:
        assert end["prompt"] == [USER] and end["output"] == ["he"]


async def test_a_client_that_leaves_a_stream_is_logged_as_gone() -> None:
    """The end line of a stream whose client left says so, with what it had produced."""
    runner = FakeRunner(script=text_script("lorem ipsum " * 50), step_s=0.01)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        with captured_logs(JsonFormatter(), logging.INFO) as out:
            body = {"messages": USER, "stream": True, "max_tokens": 400}
            async with c.stream("POST", CHAT, json=body, headers={"X-Request-Id": "gone"}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break
            await wait_idle(c)
    (end,) = [x for x in json_lines(out) if x.get("request_id") == "gone" and x["logger"] == "ft.request"]
    assert end["client_left"] is True and end["finish_reason"] == "abort" and end["status"] == 200


@pytest.mark.parametrize("path", ["/health", "/health/ready", "/metrics"])
async def test_probes_log_at_debug_only(client: httpx.AsyncClient, path: str) -> None:
    """A load balancer's probes and scrapes do not flood the INFO log."""
    with captured_logs(TextFormatter(), logging.INFO) as out:
        assert (await client.get(path)).status_code == 200
    assert out.getvalue() == ""


async def test_a_path_with_control_characters_cannot_forge_a_text_log_line(client: httpx.AsyncClient) -> None:
    """ASGI paths arrive percent-decoded: a `%0A` in the URL must not start a new log line."""
    forged = "2026-01-01 00:00:00,000 INFO ft.request [admin-1] POST /v1/admin/prepare-stop 200"
    with captured_logs(TextFormatter(), logging.INFO) as out:
        r = await client.get("/v1/x%0D%0A" + forged.replace(" ", "%20") + "%1B[2J")
        assert r.status_code == 404
        await wait_idle(client)
    lines = [line for line in out.getvalue().splitlines() if "/v1/stats" not in line]
    assert len(lines) == 1 and lines[0].split(" ", 5)[4].startswith("[req-")
    assert "\r" not in lines[0] and "\x1b" not in lines[0]
