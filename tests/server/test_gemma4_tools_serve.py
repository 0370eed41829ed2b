"""Gemma 4's tool calls on a real (tiny, random) Gemma 4 served over HTTP.

The model is a transformers-built Gemma 4 whose vocabulary holds Gemma 4's markers as special
tokens, with a template that renders as Gemma 4's own (`tests.support.gemma4_template`). The
family's formats are the server's (`gemma4` calls and reasoning, no `--tool-call-parser`):
the template renders the tools, a call sent back and its result into the prompt (the same
prompt from all three APIs); the markers the parsers read survive decoding; and a forced choice
(`required`, or a named tool) is a grammar of calls in Gemma 4's notation, so whatever the
random weights write is a call: every API, streamed or not, returns a proper tool call whose
arguments have the schema's types.
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
from tests.support.gemma4_template import GEMMA4
from tests.support.server import running_server
from tests.support.tiny_gemma4 import gemma4_chat_model, marker_id, save_gemma4_chat_dir

pytest.importorskip("transformers")

Q = '<|"|>'
# Every value is bounded (an integer in a range, an enum, a boolean), so the grammar ends a call
# within a few hundred tokens whatever the weights write.
WEATHER = {"type": "object", "properties": {
    "days": {"type": "integer", "minimum": 1, "maximum": 9, "description": "How many days"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}},
    "required": ["days", "unit"]}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
        "required": ["zone"]}  # fmt: skip
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_gemma4_chat_dir(tmp_path_factory.mktemp("gemma4") / "tiny", gemma4_chat_model(seed=5), GEMMA4)


def server(model_dir: pathlib.Path) -> Any:
    config = EngineConfig(model=str(model_dir), dtype="float32", num_pages=512, compute_threads=1)
    return running_server(config)


# A call sent back and its result, in each API's spelling.
ROUND_TRIP: dict[str, dict[str, Any]] = {
    "chat": {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"days": 3, "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], "tools": TOOLS},
    "messages": {"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"days": 3, "unit": "celsius"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}],
        "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in TOOLS], "max_tokens": 1},
    "responses": {"input": [*USER, {"type": "function_call", "call_id": "fc_1", "name": "get_weather",
                                    "arguments": '{"days": 3, "unit": "celsius"}'},
                            {"type": "function_call_output", "call_id": "fc_1", "output": "sunny, 21 C"}],
                  "tools": [{"type": "function", **t["function"]} for t in TOOLS], "store": False,
                  "max_output_tokens": 1},
}  # fmt: skip
THE_CALL = f"<|tool_call>call:get_weather{{days:3,unit:{Q}celsius{Q}}}<tool_call|>"
THE_RESULT = f"<|tool_response>response:get_weather{{value:{Q}sunny, 21 C{Q}}}<tool_response|>"


async def test_the_tools_a_call_and_its_result_are_rendered_the_same_from_every_api(
    model_dir: pathlib.Path,
) -> None:
    """The template declares the tools in the system turn; a call sent back and its result are
    written in the model's turn in Gemma 4's notation, the markers as one token each, and the
    prompt ends after the result, where the model goes on; all three APIs render that prompt."""
    s: RunningServer
    async with server(model_dir) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        r = await c.post("/v1/tokenize", json=ROUND_TRIP["chat"])
        ids = r.json()["tokens"]
        prompt = (await c.post("/v1/detokenize", json={"tokens": ids})).json()["prompt"]
        counts = {"chat": len(ids)}
        chat = await c.post("/v1/chat/completions", json=ROUND_TRIP["chat"] | {"max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == len(ids)
        for api in ("messages", "responses"):
            r = await c.post(f"/v1/{api}", json=ROUND_TRIP[api])
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]  # Anthropic's input_tokens leaves out the cached ones
            counts[api] = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert prompt.startswith(
        f"<bos><|turn>system\n<|tool>declaration:get_weather{{description:{Q}The forecast{Q},parameters:"
    )
    assert f"<|tool>declaration:get_time{{description:{Q}The time{Q}" in prompt
    turn = "<|turn>user\nWeather in Paris for 3 days?<turn|>\n<|turn>model\n"
    assert prompt.endswith(turn + THE_CALL + THE_RESULT)
    assert {marker_id(m) for m in ("<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>")} <= set(ids)
    assert counts["messages"] == counts["responses"] == counts["chat"], counts


@pytest.mark.parametrize("marker", ["<|tool_call>", "<tool_call|>", Q, "<|channel>", "<channel|>"])
async def test_the_markers_the_parsers_read_survive_decoding(model_dir: pathlib.Path, marker: str) -> None:
    """Gemma 4's call, string and channel markers are special tokens, yet the text of a token
    of them is the marker (other special tokens are skipped), streamed or not."""
    async with server(model_dir) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        for stream in (False, True):
            body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": stream,
                    "logit_bias": {str(marker_id(marker)): 100}}  # fmt: skip
            r = await c.post("/v1/completions", json=body)
            text = "".join(
                json.loads(line[6:])["choices"][0]["text"]
                for line in r.text.splitlines()
                if line.startswith("data: {")
            ) if stream else r.json()["choices"][0]["text"]  # fmt: skip
            assert text == marker, (stream, text)


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


async def test_the_forced_output_is_gemma4s_notation(model_dir: pathlib.Path) -> None:
    """What the model wrote (its tokens, through `logprobs`) is the call as Gemma 4's template
    writes one, its markers as their tokens, read back as the call."""
    async with server(model_dir) as s, httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
        body = body_of("chat", USER, TOOLS, tool_choice="get_time", max_tokens=MAX_TOKENS, logprobs=True)
        r = (await c.post("/v1/chat/completions", json=body)).json()
    (choice,) = r["choices"]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert tokens[0] == "<|tool_call>" and tokens[-1] == "<tool_call|>" and tokens.count(Q) == 2, tokens
    written = b"".join(bytes(t["bytes"]) for t in choice["logprobs"]["content"]).decode()
    (call,) = choice["message"]["tool_calls"]
    zone = json.loads(call["function"]["arguments"])["zone"]
    assert written == f"<|tool_call>call:get_time{{zone:{Q}{zone}{Q}}}<tool_call|>"
