"""Hypothesis fuzzes the chat and completions schemas over HTTP: no 5xx, no leak."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.engine.fake import FakeRunner
from tests.support.server import fake_server, health_watch, loop_load, parse_sse, wait_idle

CHAT_FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "response_format",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "add_generation_prompt",
    "skip_special_tokens",
    "user",
    "unknown",
]
COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "n",
    "temperature",
    "top_k",
    "logit_bias",
    "stop",
    "echo",
    "suffix",
    "logprobs",
    "best_of",
    "seed",
    "stream",
    "stream_options",
    "unknown",
]

edge_ints = st.sampled_from(
    [0, 1, -1, 2, 16, 17, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30]
)
edge_floats = st.sampled_from(
    [0.0, -0.0, 0.5, 1.0, 2.5, -3.0, 1e308, float("nan"), float("inf"), float("-inf")]
)
nasty_text = st.sampled_from(
    ["", "a", "\ud800", "x\udfffy", "\x00", "é", "🙂", "[DONE]", '"}\n\ndata: x', "<|im_end|>"]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    edge_ints,
    st.floats(),
    edge_floats,
    st.text(max_size=8),
    nasty_text,
)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


json_values = st.one_of(
    st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(st.one_of(st.text(max_size=4), nasty_text), inner, max_size=4),
        ),
        max_leaves=12,
    ),
    st.integers(min_value=60, max_value=300).map(nested),
)
messages = st.one_of(
    json_values,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.one_of(
                    st.sampled_from(["system", "developer", "user", "assistant", "tool", "bad"]), json_values
                )
            },
            optional={
                "content": st.one_of(
                    nasty_text,
                    json_values,
                    st.just([{"type": "text", "text": "hi"}]),
                    st.just([{"type": "image_url"}]),
                )
            },
        ),
        max_size=3,
    ),
)


def bodies(fields: list[str], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    overrides = st.dictionaries(
        st.sampled_from(fields),
        json_values,
        max_size=3,
    )
    extra = {"messages": messages} if "messages" in base else {}
    return st.builds(
        lambda o, e: base | e | o,
        overrides,
        st.fixed_dictionaries({}, optional=extra),  # type: ignore[arg-type]
    )


def check(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    text = json.dumps(body)  # NaN/Infinity literals and \ud800 escapes go out as such
    r = client.post(path, content=text.encode(), headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = parse_sse(r.text)  # every frame valid JSON
        assert events[-1] == "[DONE]"


def fuzz(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as client:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(bodies(CHAT_FIELDS, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        def chat(body: dict[str, Any]) -> None:
            check(client, "/v1/chat/completions", body)

        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
        @given(bodies(COMPLETION_FIELDS, {"prompt": "hi", "max_tokens": 4}))
        def completions(body: dict[str, Any]) -> None:
            check(client, "/v1/completions", body)

        chat()
        completions()


async def test_fuzzed_bodies_never_5xx_and_never_leak() -> None:
    """Fuzzed bodies on every route never get a 5xx and never leave a request behind."""
    async with fake_server(FakeRunner(step_s=0.0), context_length=256) as s:
        await trio.to_thread.run_sync(fuzz, s.base_url)
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            stats = await wait_idle(c)
        assert stats["requests"]["active"] == 0 and stats["kv"]["used_pages"] == 0


# --- hostile shapes: the event loop must stay responsive while they are checked --------------


def _hostile_body(kind: str, size: int, terminated: bool, field: str) -> str:
    """A body of `size`-ish bytes in one of the shapes that once stalled the loop."""
    if kind == "escape_run":  # `\"` repeated: a string-stripping regex rescanned from each quote
        run = '\\"' * (size // 2)
        text = f'{{"messages":[{{"role":"user","content":"{run}'
        return text + ('"}],"max_tokens":1}' if terminated else "")
    if kind == "deep_legal":  # nesting up to the limit, repeated to fill the size
        depth = 1 + size % 64
        one = "[" * depth + "1" + "]" * depth
        items = ",".join([one] * max(1, size // (2 * depth + 2)))
        return f'{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":1,"{field}":[{items}]}}'
    if kind == "huge_string":  # valid and large, in a field that is ignored or refused
        return f'{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":1,"{field}":"{"x" * size}"}}'
    escapes = "\\u00e9\\n\\t" * (size // 14)  # many short escapes in one valid string
    return f'{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":1,"{field}":"{escapes}"}}'


hostile_bodies = st.builds(
    _hostile_body,
    st.sampled_from(["escape_run", "deep_legal", "huge_string", "many_escapes"]),
    st.integers(min_value=1_000, max_value=400_000),
    st.booleans(),
    st.sampled_from(["unknown", "user", "stop", "chat_template_kwargs"]),
)


def fuzz_hostile(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as client:

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(hostile_bodies)
        def chat(text: str) -> None:
            r = client.post(
                "/v1/chat/completions", content=text.encode(), headers={"content-type": "application/json"}
            )
            assert r.status_code in (200, 400, 413), r.text[:300]

        chat()


async def test_fuzzed_hostile_bodies_keep_the_event_loop_responsive() -> None:
    """Fuzzed hostile bodies keep /health answering, and no step on the loop spends half a
    second of CPU on one (CPU: a loaded machine's wait is no stall)."""
    async with fake_server(FakeRunner(step_s=0.0), context_length=256) as s:
        async with health_watch(s.base_url), loop_load() as load:
            await trio.to_thread.run_sync(fuzz_hostile, s.base_url)
        assert load.longest_step_s < 0.5, load
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            stats = await wait_idle(c)
        assert stats["requests"]["active"] == 0
