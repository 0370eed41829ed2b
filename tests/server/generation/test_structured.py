"""Structured output at the edge: every API's fields, 400s before engine work, matchers freed
with the request scope (fake model: its scripted text ignores grammars)."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import pytest
import trio

from ft.engine.fake import FakeRunner, text_script
from ft.grammar import spec
from ft.grammar.compiled import Grammar, Matcher
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.server import RunningServer
from tests.support.engine import fake_engine
from tests.support.server import fake_server, health_watch, loop_load, wait_idle

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BAD_SCHEMA = {"type": "frobnicate"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
         "response_format.json_schema.schema"),
        ({"guided_json": BAD_SCHEMA}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "(x{500}){500}"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "[a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs.regex"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
          "tool_choice": "required"}, "tools"),
        ({"messages": [*USER, {"role": "assistant", "content": '{"a": '}], "continue_final_message": True,
          "add_generation_prompt": False, "guided_json": {"type": "object"}}, "continue_final_message"),
    ],
)  # fmt: skip
async def test_bad_constraints_are_400s_naming_the_field(
    server: RunningServer, client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    """Invalid, hostile or conflicting constraints are 400s before any engine work, streamed or not."""
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={"messages": USER, "stream": stream} | body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
    await wait_idle(client)
    assert server.engine.stats.completed == 0 and server.engine.stats.prompt_tokens_total == 0


async def test_every_api_accepts_its_spelling(client: httpx.AsyncClient) -> None:
    """Chat, completions, responses and messages each take their own structured-output fields."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    posts: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"messages": USER, "guided_json": schema}),
        ("/v1/chat/completions", {"messages": USER, "guided_json": True}),
        ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"choice": ["a", "b"]}}),
        ("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required"}),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}),
        ("/v1/completions", {"prompt": "x", "guided_grammar": 'root ::= "a"+'}),
        ("/v1/responses", {"input": "x",
                           "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}}),
        ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                           "tool_choice": "required"}),
        ("/v1/messages", {"messages": USER, "max_tokens": 5,
                          "output_format": {"type": "json_schema", "schema": schema}}),
        ("/v1/messages", {"messages": USER, "max_tokens": 5, "tools": [{"name": "f", "input_schema": schema}],
                          "tool_choice": {"type": "any"}}),
    ]  # fmt: skip
    for path, body in posts:
        r = await client.post(path, json={"max_tokens": 3} | body if path != "/v1/responses" else body)
        assert r.status_code == 200, (path, r.text)


async def test_responses_echo_the_text_format(client: httpx.AsyncClient) -> None:
    """A Responses answer reports the `text.format` it followed."""
    fmt = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    r = await client.post(
        "/v1/responses", json={"input": "x", "text": {"format": fmt}, "max_output_tokens": 2}
    )
    assert r.json()["text"]["format"] == fmt


async def test_hostile_grammars_do_not_stall_the_loop(
    server: RunningServer, client: httpx.AsyncClient
) -> None:
    """Compiling happens in a worker: /health answers while hostile grammars are refused, and
    no step on the loop spends half a second of CPU (CPU: a loaded machine's wait is no stall)."""
    async with health_watch(server.base_url), loop_load() as load:
        for pattern in ["(x{500}){500}", "(a{1000}){1000}", "[a-z]{1,60000}@(b{300}){300}"]:
            r = await client.post("/v1/chat/completions", json={"messages": USER, "guided_regex": pattern})
            assert r.status_code in (200, 400)
    assert load.longest_step_s < 0.5, load


class SpyGrammar(Grammar):
    """A grammar that remembers the matchers it hands out."""

    handed: list[Matcher]

    def matcher(self) -> Matcher:
        m = super().matcher()
        self.handed.append(m)
        return m


async def test_a_request_that_leaves_frees_its_matchers() -> None:
    """Leaving mid-generation drops every choice's matcher with the request's sequences."""
    async with fake_engine() as engine:
        real = await engine.compile_grammar(spec.regex("[a-z ]+", "x"))
        spy = SpyGrammar(real.spec, real.template)
        object.__setattr__(spy, "handed", [])

        async def compile_spy(_: object) -> Grammar:
            return spy

        engine.compile_grammar = compile_spy  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=200, n=3, grammar=spec.regex("[a-z ]+", "x"))
        async with engine.open_request(PromptSpec(text="hello"), params=params) as stream:
            with trio.fail_after(10):
                async for _ in stream:
                    break  # a first token: every choice is running; the request leaves
        assert len(spy.handed) == 3
        with trio.fail_after(30):
            while any(sys.getrefcount(m) > 3 for m in spy.handed):  # list + loop var + argument
                await trio.sleep(0.01)
        assert engine.core is not None and not engine.core.running and not engine.core.waiting


@pytest.mark.parametrize("parser", ["think", "deepseek_r1"])
async def test_constrained_output_is_all_content_under_a_reasoning_parser(parser: str) -> None:
    """A grammar shapes the output from its first token, so it has no reasoning block: with a
    reasoning parser configured the answer is still content, even a JSON string quoting `<think>`."""
    answer = '{"a": "<think>x"}'
    schema = {"type": "object"}
    async with (
        fake_server(FakeRunner(text_script(answer)), reasoning_parser=parser) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=10) as client,
    ):
        r = await client.post("/v1/chat/completions", json={"messages": USER, "guided_json": schema})
        assert r.json()["choices"][0]["message"]["content"] == answer
        fmt = {"type": "json_schema", "name": "n", "schema": schema}
        r = await client.post("/v1/responses", json={"input": "x", "text": {"format": fmt}})
        assert [o["type"] for o in r.json()["output"]] == ["message"]
        assert r.json()["output"][0]["content"][0]["text"] == answer
        fmt = {"type": "json_schema", "schema": schema}
        r = await client.post("/v1/messages", json={"messages": USER, "max_tokens": 50, "output_format": fmt})
        assert r.json()["content"] == [{"type": "text", "text": answer}]


async def test_a_prefill_with_structured_output_is_a_400(client: httpx.AsyncClient) -> None:
    """A grammar shapes a whole new answer, so it cannot continue a prefilled assistant turn
    (the client would join the prefill and a second JSON value)."""
    prefill = [*USER, {"role": "assistant", "content": '{"a": '}]
    fmt = {"type": "json_schema", "schema": {"type": "object"}}
    r = await client.post("/v1/messages", json={"messages": prefill, "max_tokens": 5, "output_format": fmt})
    assert r.status_code == 400, r.text
    assert "prefill" in r.json()["error"]["message"]


async def test_a_stop_string_inside_a_constrained_answer_does_not_cut_it() -> None:
    """A stop string that occurs inside the constrained answer does not end it: an answer under
    a grammar that says `stop` is the whole answer, valid (issue 18: it was cut, said `stop`)."""
    answer = '{"a": "x", "b": [1, 2]}'
    async with fake_engine(FakeRunner(text_script(answer))) as engine:
        regex = spec.regex(r'\{"a": "x", "b": \[1, 2\]\}', "guided_regex")
        for grammar in (spec.json_object("response_format"), regex):
            params = SamplingParams(max_tokens=100, stop=('"', ", ", "]"), grammar=grammar)
            async with engine.open_request(PromptSpec(text="hello"), params=params) as stream:
                deltas = await stream.collect()
            assert "".join(d.text for d in deltas) == answer
            assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason is None
        # without a grammar the same stop strings apply
        params = SamplingParams(max_tokens=100, stop=(", ",))
        async with engine.open_request(PromptSpec(text="hello"), params=params) as stream:
            deltas = await stream.collect()
        assert "".join(d.text for d in deltas) == '{"a": "x"'
        assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == ", "
