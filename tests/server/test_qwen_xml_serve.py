"""Forced tool calls in Qwen3-Coder's XML on a real (tiny, random) model served over HTTP.

The model is a transformers-built Qwen3 whose chat template is Qwen3.5's: the template renders
the tools into the prompt and teaches the XML call format, which becomes the server's
(`qwen3_coder`, no `--tool-call-parser` given). A forced choice (`required`, or a named tool)
is a grammar of XML calls, so whatever the random weights write is a call: every API, streamed
or not, returns a proper tool call whose arguments have the schema's types.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx
import jsonschema
import pytest

from ft.config import EngineConfig
from ft.server import RunningServer
from tests.support.api_outputs import APIS, ask, body_of
from tests.support.qwen_xml_template import QWEN35
from tests.support.server import running_server
from tests.support.tiny_qwen3 import EOS, qwen3_model, save_qwen3_dir

pytest.importorskip("transformers")

# Every value is bounded (an integer in a range, an enum, a boolean), so the grammar ends a call
# within a few hundred tokens whatever the weights write.
WEATHER = {"type": "object", "properties": {
    "days": {"type": "integer", "minimum": 1, "maximum": 9, "description": "How many days"},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}},
    "required": ["days", "unit"]}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny random Qwen3 (a context for Qwen3.5's ~2k-token tool prompt) with Qwen3.5's template."""
    directory = save_qwen3_dir(
        tmp_path_factory.mktemp("qwen35") / "tiny", qwen3_model(max_position_embeddings=8192)
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "bos_token": None, "chat_template": QWEN35})
    )
    return directory


def server(model_dir: pathlib.Path) -> Any:
    return running_server(EngineConfig(model=str(model_dir), dtype="float32", num_pages=1024))


async def test_the_tools_are_rendered_into_the_prompt_which_leaves_think_open(
    model_dir: pathlib.Path,
) -> None:
    """Qwen3.5's template writes the tools (as JSON) and its call format into the system
    prompt, and ends the generation prompt inside `<think>`."""
    s: RunningServer
    async with server(model_dir) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        ids = (await c.post("/v1/tokenize", json={"messages": USER, "tools": TOOLS})).json()["tokens"]
        prompt = (await c.post("/v1/detokenize", json={"tokens": ids})).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt
    assert "<function=example_function_name>\n<parameter=example_parameter_1>" in prompt
    assert prompt.endswith(
        "<|im_start|>user\nWeather in Paris for 3 days?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def assert_valid_calls(calls: list[tuple[str, Any]], names: set[str]) -> None:
    """Each call is of one of `names`, its arguments valid against the tool's schema (so `days`
    is an integer, `metric` a boolean, `unit` one of its strings)."""
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.parametrize("api", APIS)
async def test_a_named_forced_call_is_one_typed_tool_call_in_every_api(
    model_dir: pathlib.Path, api: str
) -> None:
    """`tool_choice` naming `get_weather` (OpenAI's function, Anthropic's `tool`, Responses'
    function): one call of it with typed arguments, streamed or not."""
    async with server(model_dir) as s, httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
        for stream in (False, True):
            body = body_of(api, USER, TOOLS, tool_choice="get_weather", max_tokens=MAX_TOKENS)
            answer = await ask(c, api, body, stream=stream)
            assert answer.text == "" and answer.reasoning == "", (stream, answer)
            assert len(answer.calls) == 1 and answer.ended_in_calls, (stream, answer)
            assert_valid_calls(answer.calls, {"get_weather"})


async def test_a_required_call_is_a_call_of_any_tool(model_dir: pathlib.Path) -> None:
    """`tool_choice: required`: a call of one of the offered tools, nothing else, streamed or
    not (one: parallel calls have no bound but `max_tokens`)."""
    async with server(model_dir) as s, httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
        for stream in (False, True):
            body = body_of(
                "chat", USER, TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, parallel_tool_calls=False
            )
            answer = await ask(c, "chat", body, stream=stream)
            assert answer.text == "" and len(answer.calls) == 1 and answer.ended_in_calls, (stream, answer)
            assert_valid_calls(answer.calls, {"get_weather", "get_time"})


async def test_the_forced_output_is_the_templates_xml(model_dir: pathlib.Path) -> None:
    """What the model wrote (its tokens, through `logprobs`) is the XML call format Qwen3.5's
    template teaches, read back as the call."""
    async with server(model_dir) as s, httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
        body = body_of("chat", USER, TOOLS, tool_choice="get_time", max_tokens=MAX_TOKENS, logprobs=True)
        r = (await c.post("/v1/chat/completions", json=body)).json()
    (choice,) = r["choices"]
    written = "".join(t["token"] for t in choice["logprobs"]["content"])
    (call,) = choice["message"]["tool_calls"]
    zone = json.loads(call["function"]["arguments"])["zone"]
    parameter = f"<parameter=zone>\n{zone}\n</parameter>\n"
    assert written == f"<tool_call>\n<function=get_time>\n{parameter}</function>\n</tool_call>"
