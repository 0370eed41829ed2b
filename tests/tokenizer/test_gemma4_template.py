"""The Gemma 4 template fixture renders what Gemma 4's published template renders (tools,
calls, tool results, reasoning, the generation prompt), and a call it writes reads back through
the `gemma4` parser as the arguments it was given."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.toolcalls import parse_tool_calls
from ft.tokenizer.template import render_chat
from tests.support.gemma4_template import GEMMA4

Q = '<|"|>'
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"}, "days": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}}, "required": ["city"]}}}]  # fmt: skip
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
FUNCTION = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
CALL = {"role": "assistant", "content": None, "reasoning_content": "Paris, 3 days.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": FUNCTION}]}  # fmt: skip
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
SYSTEM = (
    f"<bos><|turn>system\nBe brief.<|tool>declaration:get_weather{{description:{Q}The forecast{Q},"
    f"parameters:{{properties:{{city:{{description:{Q}The city{Q},type:{Q}STRING{Q}}},"
    f"days:{{type:{Q}INTEGER{Q}}},"
    f"unit:{{enum:[{Q}celsius{Q},{Q}fahrenheit{Q}],type:{Q}STRING{Q}}}}},required:[{Q}city{Q}],"
    f"type:{Q}OBJECT{Q}}}}}<tool|><turn|>\n"
)
THE_CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>"
THE_RESULT = f"<|tool_response>response:get_weather{{value:{Q}sunny, 21 C{Q}}}<tool_response|>"
# What Gemma 4's published template renders for each conversation (bos `<bos>`).
PUBLISHED: list[tuple[list[dict[str, Any]], dict[str, Any], str]] = [
    (ASK, {}, SYSTEM + "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"),
    (
        [*ASK, CALL, RESULT],
        {},
        SYSTEM + "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|channel>thought\nParis, 3 days.\n"
        "<channel|>" + THE_CALL + THE_RESULT,
    ),
    (
        [
            *ASK,
            CALL,
            RESULT,
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "And Oslo?"},
        ],
        {"enable_thinking": True},
        SYSTEM.replace("system\n", "system\n<|think|>\n")
        + "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
        + THE_CALL
        + THE_RESULT
        + "Sunny.<turn|>\n<|turn>user\nAnd Oslo?<turn|>\n<|turn>model\n",
    ),
    (
        [*ASK, CALL],
        {},
        SYSTEM + "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|channel>thought\n"
        "Paris, 3 days.\n<channel|>" + THE_CALL + "<|tool_response>",
    ),  # fmt: skip
]


def test_the_fixture_renders_as_gemma4s_published_template() -> None:
    """Tools as declarations, the call and its result in the model's turn (the reasoning of a
    call after the last user message kept, earlier ones dropped), the generation prompt an
    empty thought, none after a tool result, `<|think|>` with thinking on."""
    for messages, extra, expected in PUBLISHED:
        assert render_chat(GEMMA4, messages, tools=TOOLS, bos_token="<bos>", extra=extra) == expected


keys = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)
texts = st.text(st.characters(codec="utf-8"), max_size=20).filter(lambda s: Q not in s)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**9), 10**9) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200)
@given(arguments=st.dictionaries(keys, values, max_size=4))
def test_a_call_the_template_writes_reads_back_as_its_arguments(arguments: dict[str, Any]) -> None:
    """Whatever arguments a call sent back carries (text with braces, commas, markers' pieces;
    nested objects and arrays; `None`, which the template writes as Python does), the parser
    reads what the template wrote as those arguments."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    prompt = render_chat(GEMMA4, messages, bos_token="")
    written = prompt.removeprefix("<|turn>user\nq<turn|>\n<|turn>model\n").removesuffix("<|tool_response>")
    content, calls = parse_tool_calls(written, "gemma4")
    assert content == "" and [(name, json.loads(args)) for name, args in calls] == [("f", arguments)]
