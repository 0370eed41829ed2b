"""A model family's tool-call format is the server's when none is configured (Phi-4-mini's
`phi4_mini_json`, Granite's `granite`, Gemma 4's `gemma4`), else the one its chat template
spells (Qwen3-Coder's XML: `qwen3_coder`); a configured `--tool-call-parser` wins."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest

from ft.config import EngineConfig
from ft.core.reasoning import REASONING_PARSERS
from ft.core.toolcalls import TOOL_CALL_PARSERS, template_tool_call_parser
from ft.engine.fake import FakeRunner
from ft.engine.loading import ModelParts
from ft.model.architectures import ARCHITECTURES, by_name
from tests.support.chat_templates import TEMPLATES
from tests.support.engine import fake_hooks, fake_parts
from tests.support.qwen_xml_template import QWEN3_CODER, QWEN35
from tests.support.scripts import text_script
from tests.support.server import TEST_SETTINGS, running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


GEMMA4_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)


def _parts(
    runner: FakeRunner, parser: str | None, template: str | None = None
) -> Callable[[EngineConfig], ModelParts]:
    load = fake_parts(runner, 8192)

    def load_as_family(config: EngineConfig) -> ModelParts:
        parts = replace(load(config), tool_call_parser=parser)
        if template is None:
            return parts
        return replace(parts, tokenizer=replace(parts.tokenizer, chat_template=template))

    return load_as_family


def test_the_families_name_their_formats() -> None:
    assert by_name("phi3").tool_call_parser == "phi4_mini_json"
    assert by_name("granite").tool_call_parser == "granite"
    assert by_name("smollm3").tool_call_parser is None  # <tool_call> JSON: hermes
    assert by_name("gemma4").tool_call_parser == by_name("gemma4").reasoning_parser == "gemma4"


def test_every_family_names_known_formats() -> None:
    """A family's formats are parsers the server has (a typo would fail every request)."""
    for arch in ARCHITECTURES:
        assert arch.tool_call_parser in (None, *TOOL_CALL_PARSERS), arch.name
        assert arch.reasoning_parser in (None, *REASONING_PARSERS), arch.name


def test_a_template_that_spells_xml_calls_names_qwen3_coder() -> None:
    """Qwen3-Coder's and Qwen3.5's templates teach the XML format; the JSON-calling ones none."""
    assert template_tool_call_parser(QWEN3_CODER) == template_tool_call_parser(QWEN35) == "qwen3_coder"
    assert all(template_tool_call_parser(t) is None for t in TEMPLATES.values())
    assert template_tool_call_parser(None) is None


@pytest.mark.parametrize(
    ("family", "configured", "output", "is_call"),
    [
        ("granite", None, f"<|tool_call|>{CALL}", True),
        ("phi4_mini_json", None, f"<|tool_call|>{CALL}<|/tool_call|>", True),
        (None, None, f"<|tool_call|>{CALL}", False),  # hermes reads no such call: text
        ("granite", "hermes", f"<|tool_call|>{CALL}", False),  # the operator's parser wins
        (None, None, XML_CALL, True),  # Qwen3-Coder's template: qwen3_coder
        ("granite", None, XML_CALL, False),  # the family's format wins over the template's
        (None, "hermes", XML_CALL, False),  # and the operator's over both
        ("gemma4", None, GEMMA4_CALL, True),  # Gemma 4's notation
        (None, None, GEMMA4_CALL, False),
    ],
)
async def test_the_familys_tool_call_format_is_the_default(
    family: str | None, configured: str | None, output: str, is_call: bool
) -> None:
    runner = FakeRunner(script=text_script(output))
    template = QWEN3_CODER if output == XML_CALL else None
    hooks = fake_hooks(load_model=_parts(runner, family, template))
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
