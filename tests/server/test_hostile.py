"""Hostile input gets a 4xx JSON error naming the field, and leaks nothing (issue 4, HTTP edge)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from ft.server import ServerSettings
from ft.server.openai.format import MAX_ECHO_TOKENS
from tests.support.server import fake_server, health_watch, loop_load, wait_idle

USER = [{"role": "user", "content": "hi"}]
CHAT = {"messages": USER, "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
JSON = {"content-type": "application/json"}

# (route, body as raw JSON text or a dict, expected status, a substring of `param`)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    # the unpackable shapes
    ("ctk_int_2_64", "chat", CHAT | {"chat_template_kwargs": {"x": 2**64}}, 400, "chat_template_kwargs"),
    (
        "ctk_int_below_int64",
        "chat",
        CHAT | {"chat_template_kwargs": {"x": -(2**63) - 1}},
        400,
        "chat_template_kwargs",
    ),
    (
        "ctk_nested_int",
        "chat",
        CHAT | {"chat_template_kwargs": {"a": [{"b": 2**70}]}},
        400,
        "chat_template_kwargs",
    ),
    ("top_k_2_64", "chat", CHAT | {"top_k": 2**64}, 400, "top_k"),
    ("max_tokens_2_64", "chat", CHAT | {"max_tokens": 2**64}, 400, "max_tokens"),
    ("stop_surrogate", "chat", '{"messages":[{"role":"user","content":"hi"}],"stop":"\\ud800"}', 400, "stop"),
    (
        "stop_list_surrogate",
        "chat",
        '{"messages":[{"role":"user","content":"hi"}],"stop":["a","\\udfff"]}',
        400,
        "stop",
    ),
    (
        "content_surrogate",
        "chat",
        '{"messages":[{"role":"user","content":"a\\ud800b"}]}',
        400,
        "messages[0].content",
    ),
    (
        "key_surrogate",
        "chat",
        '{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"\\ud800":1}}',
        400,
        "chat_template_kwargs",
    ),
    ("completion_max_tokens_2_64", "completion", COMPLETION | {"max_tokens": 2**64}, 400, "max_tokens"),
    ("completion_top_k_2_64", "completion", COMPLETION | {"top_k": 2**64}, 400, "top_k"),
    ("completion_prompt_surrogate", "completion", '{"prompt":"\\ud800"}', 400, "prompt"),
    # non-finite numbers
    ("nan", "chat", '{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', 400, None),
    ("infinity", "chat", '{"messages":[{"role":"user","content":"hi"}],"top_p":-Infinity}', 400, None),
    ("float_overflow", "chat", '{"messages":[{"role":"user","content":"hi"}],"top_p":1e999}', 400, None),
    ("huge_int_literal", "chat", '{"messages":[],"n":' + "9" * 5000 + "}", 400, None),
    # out of range
    ("temperature_negative", "chat", CHAT | {"temperature": -1}, 400, "temperature"),
    ("top_p_zero", "chat", CHAT | {"top_p": 0}, 400, "top_p"),
    ("n_huge", "chat", CHAT | {"n": 10_000}, 400, "n"),
    ("n_zero", "chat", CHAT | {"n": 0}, 400, "n"),
    ("max_tokens_zero", "chat", CHAT | {"max_tokens": 0}, 400, "max_tokens"),
    ("top_logprobs_21", "chat", CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("seed_2_64", "chat", CHAT | {"seed": 2**64}, 400, "seed"),
    ("frequency_penalty", "chat", CHAT | {"frequency_penalty": 3.0}, 400, "frequency_penalty"),
    ("too_many_stops", "chat", CHAT | {"stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("empty_stop", "chat", CHAT | {"stop": [""]}, 400, "stop"),
    # wrong types
    ("stream_string", "chat", CHAT | {"stream": "yes"}, 400, "stream"),
    ("n_string", "chat", CHAT | {"n": "2"}, 400, "n"),
    ("max_tokens_float", "chat", CHAT | {"max_tokens": 1.5}, 400, "max_tokens"),
    ("stop_int", "chat", CHAT | {"stop": 5}, 400, "stop"),
    ("stop_list_of_ints", "chat", CHAT | {"stop": [1]}, 400, "stop"),
    ("temperature_bool", "chat", CHAT | {"temperature": True}, 400, "temperature"),
    ("ctk_not_object", "chat", CHAT | {"chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    (
        "stream_options_wrong",
        "chat",
        CHAT | {"stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
    ),
    # malformed messages
    ("messages_empty", "chat", {"messages": []}, 400, "messages"),
    ("messages_missing", "chat", {"max_tokens": 2}, 400, "messages"),
    ("messages_string", "chat", {"messages": "hi"}, 400, "messages"),
    ("message_not_object", "chat", {"messages": ["hi"]}, 400, "messages[0]"),
    ("role_missing", "chat", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("role_unknown", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("content_number", "chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("content_missing", "chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        "content_part_unknown",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
        400,
        "messages[0].content",
    ),
    (
        "content_part_no_text",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages[0].content",
    ),
    # logit bias and token ids
    ("logit_bias_key_word", "chat", CHAT | {"logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias_key_negative", "chat", CHAT | {"logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("logit_bias_key_out_of_vocab", "chat", CHAT | {"logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("logit_bias_value", "chat", CHAT | {"logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("stop_token_out_of_vocab", "chat", CHAT | {"stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("prompt_token_out_of_vocab", "completion", {"prompt": [999999]}, 400, "prompt"),
    ("prompt_token_negative", "completion", {"prompt": [-1]}, 400, "prompt"),
    ("prompt_token_2_64", "completion", {"prompt": [2**64]}, 400, "prompt"),
    ("prompts_token_out_of_vocab", "completion", {"prompt": [[1], [999999]]}, 400, "prompt[1]"),
    ("prompt_empty_list", "completion", {"prompt": []}, 400, "prompt"),
    ("prompt_empty_token_list", "completion", {"prompt": [[]]}, 400, "prompt"),
    ("prompt_object", "completion", {"prompt": {"a": 1}}, 400, "prompt"),
    ("prompt_missing", "completion", {"max_tokens": 2}, 400, "prompt"),
    ("prompt_empty_string", "completion", {"prompt": ""}, 400, "prompt"),
    ("completion_logprobs_bool", "completion", COMPLETION | {"logprobs": True}, 400, "logprobs"),
    ("completion_best_of", "completion", COMPLETION | {"best_of": 3}, 400, "best_of"),
    # bodies that are not JSON objects
    ("deep_nesting", "chat", '{"messages":' + "[" * 100 + "]" * 100 + "}", 400, None),
    ("very_deep_nesting", "chat", "[" * 200_000 + "]" * 200_000, 400, None),
    (
        "deep_object_nesting",
        "chat",
        '{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":'
        + '{"a":' * 70
        + "1"
        + "}" * 70
        + "}",
        400,
        None,
    ),
    ("not_json", "chat", "hello", 400, None),
    ("truncated_json", "chat", '{"messages": [', 400, None),
    ("json_array", "chat", "[1, 2]", 400, None),
    ("json_null", "chat", "null", 400, None),
    ("empty_body", "chat", "", 400, None),
    (
        "context_too_long",
        "chat",
        {"messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 2},
        400,
        None,
    ),
    (
        "completion_max_tokens_zero_without_echo",
        "completion",
        COMPLETION | {"max_tokens": 0},
        400,
        "max_tokens",
    ),
]

ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def _content(body: Any) -> bytes:
    return body.encode("utf-8") if isinstance(body, str) else json.dumps(body).encode()


def assert_json_error(r: httpx.Response, status: int, name: str = "") -> dict[str, Any]:
    assert r.status_code == status, (name, r.text)
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


async def test_hostile_inputs_get_4xx_json_and_leak_nothing() -> None:
    """Every hostile body is a JSON 4xx naming its field, streamed or not, and leaves nothing registered."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for name, route, body, status, param in CASES:
            for stream in (False, True):
                if stream and (not isinstance(body, dict) or "stream" in body):
                    continue  # the same bytes again
                body_ = body | {"stream": True} if stream else body
                r = await c.post(
                    ROUTES[route], content=_content(body_), headers={"content-type": "application/json"}
                )
                error = assert_json_error(r, status, f"{name} stream={stream}")
                if param is not None:
                    assert error["param"] is not None and param in error["param"], (name, error)
        stats = await wait_idle(c)
        assert stats["requests"]["active"] == 0
        # the same requests with packable values are served
        for body in (CHAT | {"chat_template_kwargs": {"x": 2**63 - 1}, "top_k": 40, "stop": "x"},):
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        assert (await c.post("/v1/completions", json=COMPLETION | {"top_k": 5})).status_code == 200


async def test_invalid_utf8_body_is_400() -> None:
    """A body that is not UTF-8 is a 400 invalid_body."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        for raw in (b"\xff\xfe{}", b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}'):
            r = await c.post("/v1/chat/completions", content=raw, headers=JSON)
            assert assert_json_error(r, 400)["code"] == "invalid_body"


async def test_oversized_body_is_413_by_header_and_by_stream() -> None:
    """A body over the limit is a 413, by Content-Length or by the bytes streamed."""
    settings = ServerSettings(port=0, max_body_bytes=64 * 1024, graceful_timeout_s=0.5)
    async with fake_server(settings=settings) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
        r = await c.post("/v1/chat/completions", content=big, headers=JSON)
        assert assert_json_error(r, 413)["code"] == "request_too_large"

        async def chunks():  # no Content-Length: chunked transfer
            for _ in range(10):
                yield b" " * 10_000

        r = await c.post("/v1/chat/completions", content=chunks(), headers=JSON)
        assert_json_error(r, 413)
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        await wait_idle(c)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/nope", 404),
        ("POST", "/v1/nope", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("PUT", "/v1/completions", 405),
    ],
)
async def test_unknown_routes_and_methods_are_json(
    client: httpx.AsyncClient, method: str, path: str, status: int
) -> None:
    """Unknown routes and methods get JSON 404s and 405s."""
    r = await client.request(method, path)
    assert_json_error(r, status)


# --- the event loop stays free: body checks are linear and large ones run off the loop -------

ESCAPE_RUN = '{"a":"' + '\\"' * 40_000  # 80 KB of escaped quotes, never terminated
HOSTILE_BODIES = [
    ("chat", ESCAPE_RUN),
    ("chat", '{"messages":[{"role":"user","content":"' + '\\"' * 40_000 + '"}],"max_tokens":1}'),
    ("responses", None),
    ("chat", '{"messages":' + "[" * 60 + "]" * 60 + "," + '"x":"' + "\\u00e9" * 600_000 + '"}'),
    # a huge valid string, refused only by the last field (tokenizing it is the workers' job)
    ("chat", '{"messages":[{"role":"user","content":"' + "x" * 3_000_000 + '"}],"max_tokens":0}'),
]


def _responses_body() -> str:
    """A valid `/v1/responses` body whose tool-call arguments are an unterminated escape run
    (60 KB: short enough to be re-parsed for the chat template)."""
    args = '{"a":"' + '\\"' * 30_000
    return json.dumps(
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": args},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
            "max_output_tokens": 1,
        }
    )


async def test_hostile_bodies_do_not_block_the_event_loop() -> None:
    """Bodies built to be slow to check keep /health answering: no step on the loop spends half
    a second of CPU on one (CPU: a loaded machine's wait is no stall)."""
    paths = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        for route, body in HOSTILE_BODIES:
            content = (body if body is not None else _responses_body()).encode()
            async with health_watch(s.base_url), loop_load() as load:
                with trio.fail_after(30):
                    r = await c.post(paths[route], content=content, headers=JSON)
                assert r.status_code in (200, 400), r.text
            assert load.longest_step_s < 0.5, (route, len(content), load)
        await wait_idle(c)


async def test_echo_amplification_is_400_naming_the_limit(client: httpx.AsyncClient) -> None:
    """Echo that would return more than the limit is a 400 naming it."""
    prompts = [[65] * 1000 for _ in range(64)]  # ~200 KB asking to echo 1M tokens (~35 MB)
    body = {"prompt": prompts, "n": 16, "echo": True, "logprobs": 5, "max_tokens": 1}
    r = await client.post("/v1/completions", json=body)
    error = assert_json_error(r, 400)
    assert error["param"] == "echo" and str(MAX_ECHO_TOKENS) in error["message"]
    r = await client.post("/v1/completions", json=body | {"stream": True})
    assert assert_json_error(r, 400)["param"] == "echo"


async def test_a_large_echo_is_built_off_the_loop() -> None:
    """A large echo response is built off the event loop: no step on the loop takes a fair part
    of the build, and /health keeps answering."""
    # 16 x 1000 x n 16: just under the limit, 2^18 (no logprobs: a scored echo is tested for the
    # loop in tests/server/openai/test_openai_prompt_logprobs.py)
    prompts = [[65 + i] * 1000 for i in range(16)]
    body = {"prompt": prompts, "n": 16, "echo": True, "max_tokens": 1}
    async with fake_server(num_pages=4096) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        async with health_watch(s.base_url), loop_load() as load:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 256
        assert len(r.json()["choices"][0]["text"]) == 1001
        assert load.longest_step_s < load.off_loop_s / 2, load  # CPU, measured in this run
