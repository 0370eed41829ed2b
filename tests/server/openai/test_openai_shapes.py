"""Chat and completions on the fake model: every field of issue 3, in OpenAI's shapes."""

from __future__ import annotations

import httpx
import pytest

from tests.support.server import parse_sse, wait_idle

USER = [{"role": "user", "content": "hi"}]
SCRIPT_TEXT = "Hello from the fake model."


async def chat(client: httpx.AsyncClient, **body: object) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"messages": USER} | body)


async def test_chat_shape(client: httpx.AsyncClient) -> None:
    """A chat completion has OpenAI's fields: id, object, created, model, choices, usage."""
    r = await chat(client, model="fake", max_tokens=5)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake"
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hello"},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


async def test_chat_runs_to_eos_with_finish_reason_stop(client: httpx.AsyncClient) -> None:
    """Without max_tokens, a chat runs to the end-of-sequence token and finishes with "stop"."""
    r = await chat(client)
    assert r.json()["choices"][0]["message"]["content"] == SCRIPT_TEXT
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_missing_model_means_the_served_one(client: httpx.AsyncClient) -> None:
    """A request without `model` is served by the served model."""
    assert (await chat(client, max_tokens=1)).status_code == 200


@pytest.mark.parametrize("stop", ["fake", ["xyz", "fake"]])
async def test_stop_as_string_or_list(client: httpx.AsyncClient, stop: object) -> None:
    """`stop` works as a string or a list; the text ends before the stop string."""
    r = await chat(client, stop=stop)
    assert r.json()["choices"][0]["message"]["content"] == "Hello from the "
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_max_completion_tokens_wins_over_max_tokens(client: httpx.AsyncClient) -> None:
    """`max_completion_tokens` takes precedence over `max_tokens`."""
    r = await chat(client, max_tokens=10, max_completion_tokens=3)
    assert r.json()["choices"][0]["message"]["content"] == "Hel"


async def test_n_choices(client: httpx.AsyncClient) -> None:
    """`n` choices come back indexed, and usage counts every choice's tokens."""
    r = await chat(client, n=3, max_tokens=2)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == 6


async def test_chat_logprobs_shape(client: httpx.AsyncClient) -> None:
    """Chat logprobs list each token with its logprob, bytes and top alternatives."""
    r = await chat(client, max_tokens=2, logprobs=True, top_logprobs=1)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == [72]
    assert content[0]["top_logprobs"] == [{"token": "H", "logprob": -0.5, "bytes": [72]}]


async def test_top_logprobs_requires_logprobs(client: httpx.AsyncClient) -> None:
    """`top_logprobs` without `logprobs: true` is a 400 naming the field."""
    r = await chat(client, top_logprobs=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


async def test_every_role_and_text_parts(client: httpx.AsyncClient) -> None:
    """Every role, and content as a list of text parts, reaches the template."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "really"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": 2,
            "seed": 7,
            "chat_template_kwargs": {"x": 1},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    ],
)
async def test_media_parts_are_refused(client: httpx.AsyncClient, part: object) -> None:
    """Image, audio and file parts are a 400: the model takes text only."""
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400
    assert "text only" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content"


async def test_response_format_kinds(client: httpx.AsyncClient) -> None:
    """`text`, `json_object` and `json_schema` are served; a schema-less `json_schema` is a 400."""
    schema = {"name": "x", "schema": {"type": "object"}}
    for fmt in [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": schema}]:
        assert (await chat(client, response_format=fmt, max_tokens=1)).status_code == 200, fmt
    r = await chat(client, response_format={"type": "json_schema"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


async def test_unknown_top_level_fields_are_ignored(client: httpx.AsyncClient) -> None:
    """Unknown top-level fields are ignored, as OpenAI does."""
    r = await chat(client, max_tokens=1, metadata={"a": 1}, store=False, frobnicate=[1, 2])
    assert r.status_code == 200


async def test_chat_stream_shape(client: httpx.AsyncClient) -> None:
    """A chat stream: role chunk, content chunks, finish per choice, a usage chunk, `[DONE]`."""
    r = await chat(client, stream=True, n=2, max_tokens=3, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    assert r.text.startswith(": connected\n\n")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert {c["id"] for c in chunks} | {usage["id"]} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in m["delta"] for m in mine[1:])
        assert "".join(m["delta"].get("content", "") for m in mine) == "Hel"
        assert [m["finish_reason"] for m in mine][-1] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


async def test_stream_without_include_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    """Without `stream_options.include_usage` no chunk carries usage."""
    events = parse_sse((await chat(client, stream=True, max_tokens=2)).text)
    assert all("usage" not in e for e in events[:-1])


async def test_stream_logprobs(client: httpx.AsyncClient) -> None:
    """Streamed chunks carry the logprobs of their tokens."""
    events = parse_sse((await chat(client, stream=True, max_tokens=2, logprobs=True)).text)
    tokens = [
        t["token"]
        for e in events[:-1]
        for c in e["choices"]
        if c["logprobs"]
        for t in c["logprobs"]["content"]
    ]
    assert tokens == ["H", "e"]


LONG_USER = [{"role": "user", "content": "x" * 2100}]  # the fake model's context is 2048 bytes


async def test_context_length_exceeded(client: httpx.AsyncClient) -> None:
    """A prompt past the context is a 400 `context_length_exceeded` with the token counts."""
    r = await chat(client, messages=LONG_USER, max_tokens=5)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "2048 tokens" in r.json()["error"]["message"]


async def test_streamed_context_length_exceeded_is_a_400_before_the_stream(client: httpx.AsyncClient) -> None:
    """A prompt that can never fit is refused before any 200 (in-stream errors: test_faults)."""
    r = await chat(client, messages=LONG_USER, max_tokens=5, stream=True)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    await wait_idle(client)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_max_tokens_past_the_context_is_a_ceiling(client: httpx.AsyncClient, route: str) -> None:
    """max_tokens past what the context leaves after the prompt (agents send their own ceiling)
    is a 200 that runs up to the context's end and finishes with `length`, as on /v1/messages."""
    prompt = {"messages": [{"role": "user", "content": "x" * 2000}]}
    if route == "/v1/completions":
        prompt = {"prompt": "x" * 2000}
    r = await client.post(route, json=prompt | {"max_tokens": 32000, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 2048
    assert r.json()["choices"][0]["finish_reason"] == "length"


# --- completions ---------------------------------------------------------------------------


async def complete(client: httpx.AsyncClient, **body: object) -> httpx.Response:
    return await client.post("/v1/completions", json=body)


async def test_completion_shape(client: httpx.AsyncClient) -> None:
    """A text completion has OpenAI's fields, and usage counts prompt and completion."""
    r = await complete(client, prompt="abc", max_tokens=3)
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_default_max_tokens_is_16(client: httpx.AsyncClient) -> None:
    """A completion without max_tokens generates 16 tokens, as OpenAI's default."""
    r = await complete(client, prompt="abc")
    assert r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("prompt", "count"),
    [("abc", 1), (["a", "b", "c"], 3), ([100, 101], 1), ([[100], [101, 102]], 2)],
)
async def test_prompt_forms(client: httpx.AsyncClient, prompt: object, count: int) -> None:
    """Each prompt form (string, strings, token ids, lists of ids) gets `n` choices, indexed in order."""
    r = await complete(client, prompt=prompt, max_tokens=2, n=2)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(2 * count))
    assert all(c["text"] == "He" for c in r.json()["choices"])


async def test_echo_and_logprobs(client: httpx.AsyncClient) -> None:
    """`echo` prepends the prompt; logprobs list its tokens (the first with a null logprob, the
    others scored: the fake model scores -1), then the output's."""
    r = await complete(client, prompt="ab", max_tokens=2, echo=True, logprobs=1)
    choice = r.json()["choices"][0]
    assert choice["text"] == "abHe"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "H", "e"]
    assert lp["token_logprobs"] == [None, -1.0, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][2] == {"H": -0.5}


async def test_suffix_is_refused(client: httpx.AsyncClient) -> None:
    """`suffix` is a 400 naming the field."""
    r = await complete(client, prompt="a", suffix="b")
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


async def test_completion_stream(client: httpx.AsyncClient) -> None:
    """A multi-prompt completions stream interleaves every prompt's choices, then usage and `[DONE]`."""
    r = await complete(
        client,
        prompt=["a", "b"],
        max_tokens=2,
        stream=True,
        echo=True,
        stream_options={"include_usage": True},
    )
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    chunks = events[:-2]
    assert len({c["id"] for c in chunks}) == 1
    for index, prompt in ((0, "a"), (1, "b")):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(m["text"] for m in mine) == prompt + "He"
        assert mine[-1]["finish_reason"] == "length"
