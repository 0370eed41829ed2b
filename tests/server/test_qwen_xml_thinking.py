"""Qwen3.5's chat template over real HTTP, on the fake model's scripted output: the template
opens `<think>`, so the output begins as reasoning up to `</think>` (then text, XML tool calls
typed by the tools' schemas), in all three APIs, streamed or not; `enable_thinking: false`
closes the block and the output is content; the template's XML format is the tool-call
format without any `--tool-call-parser`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest

from ft.config import EngineConfig
from ft.engine.fake import CHATML, FakeRunner, text_script
from ft.engine.loading import ModelParts
from tests.support.api_outputs import APIS, Answer, ask, body_of
from tests.support.engine import fake_hooks, fake_parts
from tests.support.qwen_xml_template import QWEN3_CODER, QWEN35
from tests.support.server import running_server

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
]  # fmt: skip
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"  # noqa: E501
CONTEXT = 8192  # Qwen3.5's tool prompt is ~2k bytes: ~2k tokens of the byte tokenizer


def parts(runner: FakeRunner, template: str, reasoning: str | None) -> Callable[[EngineConfig], ModelParts]:
    """The fake model with `template`, as a family whose reasoning format is `reasoning` loads it."""
    load = fake_parts(runner, CONTEXT)

    def load_with_template(config: EngineConfig) -> ModelParts:
        loaded = load(config)
        return replace(
            loaded, tokenizer=replace(loaded.tokenizer, chat_template=template), reasoning_parser=reasoning
        )

    return load_with_template


async def answers(
    output: str,
    *,
    template: str = QWEN35,
    reasoning: str | None = None,
    apis: tuple[str, ...] = APIS,
    tools: list[dict[str, Any]] | None = TOOLS,
    **extra: Any,
) -> dict[tuple[str, bool], Answer]:
    """Each API's answer, streamed and not, when the model writes `output`."""
    runner = FakeRunner(script=text_script(output))
    hooks = fake_hooks(load_model=parts(runner, template, reasoning))
    config = EngineConfig(num_pages=1024, served_model_name="fake")
    out = {}
    async with (
        running_server(config, hooks=hooks) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=60) as c,
    ):
        for api in apis:
            for stream in (False, True):
                body = body_of(api, USER, tools, max_tokens=512, **extra)
                out[api, stream] = await ask(c, api, body, stream=stream)
    return out


@pytest.mark.parametrize("reasoning", [None, "think"], ids=["no reasoning parser", "think"])
async def test_the_output_of_an_open_think_block_is_reasoning_until_it_closes(reasoning: str | None) -> None:
    """The template ends the prompt with `<think>\\n`: the text before `</think>` is reasoning
    (`reasoning_content`, a thinking block, a reasoning item), the rest the answer, in every
    API, streamed or not, whether or not a reasoning parser is configured."""
    for key, answer in (
        await answers("The user wants weather.\n</think>\n\nSunny.", reasoning=reasoning)
    ).items():
        assert (answer.reasoning, answer.text, answer.calls) == ("The user wants weather.", "Sunny.", []), key


async def test_a_call_after_the_reasoning_is_a_typed_tool_call() -> None:
    """Reasoning, then an XML call: a tool call whose `days` is the integer the schema says."""
    output = "Paris, 3 days.\n</think>\n\n" + CALL
    for key, answer in (await answers(output)).items():
        assert answer.reasoning == "Paris, 3 days." and answer.text == "", key
        assert answer.calls == [("get_weather", {"city": "Paris", "days": 3})], key
        assert answer.ended_in_calls, key


async def test_with_thinking_off_the_template_closes_the_block_and_the_output_is_content() -> None:
    """`enable_thinking: false` (chat's `chat_template_kwargs`, Anthropic's disabled thinking)
    renders `<think>\\n\\n</think>\\n\\n`: the output is the answer, a stray `</think>` in it text."""
    output = "Sunny.</think> Warm."
    off = await answers(output, apis=("chat",), chat_template_kwargs={"enable_thinking": False})
    off |= await answers(output, apis=("messages",), thinking={"type": "disabled"})
    for key, answer in off.items():
        assert (answer.reasoning, answer.text) == ("", output), key


async def test_a_template_that_opens_no_block_leaves_the_output_alone() -> None:
    """Without an open `<think>` in the prompt (ChatML) and no reasoning parser, `</think>` is text."""
    for key, answer in (await answers("Ponder.</think>Done.", template=CHATML, tools=None)).items():
        assert (answer.reasoning, answer.text) == ("", "Ponder.</think>Done."), key


async def test_qwen3_coders_template_reads_its_xml_calls() -> None:
    """Qwen3-Coder's template (no thinking) spells the XML format: its calls are parsed so."""
    for key, answer in (await answers("Checking.\n" + CALL, template=QWEN3_CODER)).items():
        assert answer.text == "Checking.\n" and answer.reasoning == "", key
        assert answer.calls == [("get_weather", {"city": "Paris", "days": 3})], key
