"""A model family's tool-call format is the server's when none is configured (Phi-4-mini's
`phi4_mini_json`, Granite's `granite`); a configured `--tool-call-parser` wins."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest

from ft.config import EngineConfig
from ft.engine.fake import FakeRunner
from ft.engine.loading import ModelParts
from ft.model.architectures import by_name
from tests.support.engine import fake_hooks, fake_parts
from tests.support.scripts import text_script
from tests.support.server import TEST_SETTINGS, running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def _parts(runner: FakeRunner, parser: str | None) -> Callable[[EngineConfig], ModelParts]:
    load = fake_parts(runner)
    return lambda config: replace(load(config), tool_call_parser=parser)


def test_the_families_name_their_formats() -> None:
    assert by_name("phi3").tool_call_parser == "phi4_mini_json"
    assert by_name("granite").tool_call_parser == "granite"
    assert by_name("smollm3").tool_call_parser is None  # <tool_call> JSON: hermes


@pytest.mark.parametrize(
    ("family", "configured", "output", "is_call"),
    [
        ("granite", None, f"<|tool_call|>{CALL}", True),
        ("phi4_mini_json", None, f"<|tool_call|>{CALL}<|/tool_call|>", True),
        (None, None, f"<|tool_call|>{CALL}", False),  # hermes reads no such call: text
        ("granite", "hermes", f"<|tool_call|>{CALL}", False),  # the operator's parser wins
    ],
)
async def test_the_familys_tool_call_format_is_the_default(
    family: str | None, configured: str | None, output: str, is_call: bool
) -> None:
    runner = FakeRunner(script=text_script(output))
    hooks = fake_hooks(load_model=_parts(runner, family))
    settings = replace(TEST_SETTINGS, tool_call_parser=configured)
    config = EngineConfig(num_pages=256, served_model_name="fake")
    async with (
        running_server(config, hooks=hooks, settings=settings) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        r = await c.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 128}
        )
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        if is_call:
            (call,) = message["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            assert not message["content"]
        else:
            assert not message.get("tool_calls") and message["content"] == output
