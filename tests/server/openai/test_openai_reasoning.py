"""Reasoning on chat completions under both names clients use: `reasoning_content` and `reasoning`."""

from __future__ import annotations

import httpx
import pytest
import trio

from ft.engine.fake import FakeRunner, text_script
from ft.server.openai.format import chat_message_for_template
from ft.server.openai.schemas import ChatMessage
from tests.support.server import fake_server, parse_sse

USER = [{"role": "user", "content": "Think."}]


async def test_a_message_carries_its_reasoning_under_both_names() -> None:
    """A non-streamed message has `reasoning_content` (AI SDK, opencode) and `reasoning` (vLLM)."""
    runner = FakeRunner(script=text_script("<think>Ponder.</think>Done."))
    async with (
        fake_server(runner, reasoning_parser="think") as s,
        httpx.AsyncClient(base_url=s.base_url) as c,
    ):
        with trio.fail_after(30):
            r = await c.post("/v1/chat/completions", json={"messages": USER})
        message = r.json()["choices"][0]["message"]
        assert message["content"] == "Done."
        assert message["reasoning_content"] == message["reasoning"] == "Ponder."


async def test_streamed_deltas_carry_reasoning_under_both_names() -> None:
    """Every streamed reasoning delta has both names, with the same text."""
    runner = FakeRunner(script=text_script("<think>Ponder.</think>Done."))
    async with (
        fake_server(runner, reasoning_parser="think") as s,
        httpx.AsyncClient(base_url=s.base_url) as c,
    ):
        with trio.fail_after(30):
            r = await c.post("/v1/chat/completions", json={"messages": USER, "stream": True})
        deltas = [f["choices"][0]["delta"] for f in parse_sse(r.text) if f != "[DONE]" and f["choices"]]
        reasoning = [d for d in deltas if "reasoning_content" in d or "reasoning" in d]
        assert reasoning and all(d["reasoning_content"] == d["reasoning"] for d in reasoning)
        assert "".join(d["reasoning"] for d in reasoning) == "Ponder."
        assert "".join(d.get("content") or "" for d in deltas) == "Done."


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
def test_reasoning_sent_back_under_either_name_reaches_the_template(name: str) -> None:
    """An assistant turn's reasoning, sent back under either name, is the template's
    `reasoning_content` (what reasoning templates read)."""
    message = ChatMessage.model_validate({"role": "assistant", "content": "Done.", name: "Ponder."})
    assert chat_message_for_template(message)["reasoning_content"] == "Ponder."


async def test_reasoning_sent_back_is_accepted_on_the_route() -> None:
    """A conversation whose assistant turn carries `reasoning` (vLLM's name) is a 200, not a 400."""
    messages = [*USER, {"role": "assistant", "content": "Done.", "reasoning": "Ponder."}, *USER]
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        with trio.fail_after(30):
            r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
