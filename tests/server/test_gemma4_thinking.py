"""Gemma 4's thought channel over real HTTP, on the fake model's scripted output with Gemma 4's
template, as the family loads (`gemma4` reasoning and tool calls): `<|channel>thought\\n…
<channel|>` is reasoning (`reasoning_content`, a thinking block, a reasoning item) and the rest
the answer or its calls, in all three APIs, streamed or not; `enable_thinking` puts `<|think|>`
in the system turn and leaves the generation prompt to the model; a template that leaves the
channel open starts the output in it, even with no reasoning parser configured."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest

from ft.config import EngineConfig
from ft.engine.fake import FakeRunner, text_script
from ft.engine.loading import ModelParts
from tests.support.api_outputs import APIS, Answer, ask, body_of
from tests.support.engine import fake_hooks, fake_parts
from tests.support.gemma4_template import GEMMA4
from tests.support.server import running_server

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
]  # fmt: skip
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
CONTEXT = 8192  # the tool prompt is ~600 bytes: as many tokens of the byte tokenizer
# A template that opens the channel for the model (as some Gemma 4 templates do with thinking on)
OPEN = GEMMA4.replace("{{- '<|channel>thought\\n<channel|>' -}}", "{{- '<|channel>thought\\n' -}}")


def parts(runner: FakeRunner, template: str, reasoning: str | None) -> Callable[[EngineConfig], ModelParts]:
    """The fake model with `template`, loaded as Gemma 4 (its tool-call format) with `reasoning`."""
    load = fake_parts(runner, CONTEXT)

    def load_as_gemma4(config: EngineConfig) -> ModelParts:
        loaded = load(config)
        tokenizer = replace(loaded.tokenizer, chat_template=template, bos_token="<bos>")
        return replace(loaded, tokenizer=tokenizer, reasoning_parser=reasoning, tool_call_parser="gemma4")

    return load_as_gemma4


async def answers(
    output: str,
    *,
    template: str = GEMMA4,
    reasoning: str | None = "gemma4",
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


async def test_the_thought_channel_is_reasoning_and_the_rest_the_answer() -> None:
    """`<|channel>thought\\n…<channel|>`: its text (without the label) is the reasoning, in every
    API, streamed or not."""
    for key, answer in (
        await answers("<|channel>thought\nThe user wants weather.\n<channel|>Sunny.")
    ).items():
        assert (answer.reasoning, answer.text, answer.calls) == ("The user wants weather.", "Sunny.", []), key


async def test_a_call_after_the_thought_is_a_typed_tool_call() -> None:
    """Reasoning, then a call in Gemma 4's notation: a tool call whose `days` is an integer."""
    output = "<|channel>thought\nParis, 3 days.<channel|>" + CALL
    for key, answer in (await answers(output)).items():
        assert answer.reasoning == "Paris, 3 days." and answer.text == "", key
        assert answer.calls == [("get_weather", {"city": "Paris", "days": 3})], key
        assert answer.ended_in_calls, key


async def test_an_answer_without_a_channel_is_all_answer() -> None:
    """Thinking off (the template's empty thought closes the channel): the answer is text."""
    for key, answer in (await answers("Sunny, 21 C.")).items():
        assert (answer.reasoning, answer.text) == ("", "Sunny, 21 C."), key


@pytest.mark.parametrize("reasoning", [None, "gemma4"], ids=["no reasoning parser", "gemma4"])
async def test_a_channel_the_template_left_open_is_reasoning_until_it_closes(reasoning: str | None) -> None:
    """A prompt that ends with `<|channel>thought\\n`: the output up to `<channel|>` is
    reasoning, with or without a reasoning parser configured."""
    output = "Hmm, Paris.\n<channel|>Sunny."
    for key, answer in (await answers(output, template=OPEN, reasoning=reasoning, tools=None)).items():
        assert (answer.reasoning, answer.text) == ("Hmm, Paris.", "Sunny."), key


async def test_enable_thinking_asks_for_thought_and_leaves_the_prompt_to_the_model() -> None:
    """`chat_template_kwargs: {"enable_thinking": true}` renders
    `<|think|>` first in the system turn and a generation prompt without the empty thought."""
    runner = FakeRunner(script=text_script("x"))
    hooks = fake_hooks(load_model=parts(runner, GEMMA4, "gemma4"))
    config = EngineConfig(num_pages=1024, served_model_name="fake")
    async with (
        running_server(config, hooks=hooks) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=60) as c,
    ):
        prompts = []
        for kwargs in ({}, {"enable_thinking": True}):
            body = {"messages": USER, "tools": TOOLS, "chat_template_kwargs": kwargs}
            ids = (await c.post("/v1/tokenize", json=body)).json()["tokens"]
            prompts.append((await c.post("/v1/detokenize", json={"tokens": ids})).json()["prompt"])
    off, on = prompts
    assert off.startswith("<bos><|turn>system\n<|tool>declaration:get_weather{")
    assert off.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    assert on.startswith("<bos><|turn>system\n<|think|>\n<|tool>declaration:get_weather{")
    assert on.endswith("<|turn>user\nWeather in Paris for 3 days?<turn|>\n<|turn>model\n")
