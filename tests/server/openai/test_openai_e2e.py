"""Issue 3's acceptance checks over real HTTP on the real default model (SmolLM2-135M)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.server import RunningServer
from tests.support import scenarios
from tests.support.server import parse_sse, running_server

pytestmark = pytest.mark.slow  # the real default model, or a long soak

# SmolLM2's tokenizer splits digits one by one: this is ~3,900 prompt tokens, a prefill of
# seconds on a laptop CPU.
LONG_PROMPT = " ".join(str(i) for i in range(1000))


@asynccontextmanager
async def real_server(**config: object) -> AsyncIterator[RunningServer]:
    async with running_server(EngineConfig(**config)) as server:  # type: ignore[arg-type]
        yield server


async def test_sdk_chat_streamed_equals_unstreamed() -> None:
    """On the default model, the OpenAI SDK's chat and completions agree streamed and not."""
    async with real_server() as s:
        await scenarios.sdk_chat_streamed_equals_unstreamed(s.base_url)
        await scenarios.sdk_completions(s.base_url)
        await scenarios.sdk_bad_parameter(s.base_url)


async def test_stream_speaks_before_a_long_prefill_and_control_plane_stays_up() -> None:
    """On the default model, a long prompt's stream speaks before prefill ends; control answers."""
    async with real_server() as s:
        await scenarios.connected_before_slow_prefill(s.base_url, LONG_PROMPT)
        await scenarios.control_plane_answers_while_streaming(s.base_url)


async def test_two_concurrent_requests_with_one_running_slot() -> None:
    """On the default model, two requests with one running slot both complete."""
    async with real_server(max_running_requests=1) as s:
        await scenarios.two_requests_one_slot(s.base_url)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def test_a_forced_tool_call_cut_by_max_tokens_is_never_text() -> None:
    """On the default model, a forced call cut by max_tokens comes back as no text and no call,
    finish reason `length`, streamed and not."""
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "max_tokens": 6,
        "temperature": 0,
    }
    async with real_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as client:
        with trio.fail_after(120):
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            (choice,) = r.json()["choices"]
            assert choice["finish_reason"] == "length"
            assert not choice["message"]["content"]
            assert not choice["message"].get("tool_calls")
            r = await client.post("/v1/chat/completions", json=body | {"stream": True})
            chunks = parse_sse(r.text)
            deltas = [c["choices"][0] for c in chunks if c != "[DONE]" and c["choices"]]
            assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
            assert not any(d["delta"].get("tool_calls") for d in deltas)
            assert deltas[-1]["finish_reason"] == "length"


async def test_prompt_logprobs_on_the_default_model_score_what_it_generated() -> None:
    """On the default model: lm-eval's request (echo, max_tokens 0, logprobs 1) returns every
    prompt token with its logprob (null first); scoring a prompt that ends in the model's own
    greedy continuation gives those tokens the logprobs they were generated with."""
    async with real_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as client:
        with trio.fail_after(120):
            prompt = await s.engine.tokenize(PromptSpec(text="The capital of France is"))
            async with s.engine.open_request(
                PromptSpec(token_ids=prompt),
                params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=True),
            ) as stream:
                (generated,) = await stream.collect()
            body = {"prompt": prompt + generated.token_ids, "echo": True, "max_tokens": 0, "logprobs": 1}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            (choice,) = r.json()["choices"]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(prompt) + 3
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert all(x <= 0.0 for x in lp["token_logprobs"][1:])
            assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])  # the best, and the token
            scored = lp["token_logprobs"][-3:]
            for got, want in zip(scored, [t.logprob for t in generated.logprobs], strict=True):
                assert abs(got - want) < 0.05
