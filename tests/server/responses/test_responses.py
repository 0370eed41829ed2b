"""`/v1/responses` on the fake model: the official openai SDK, event order, tools, no leaks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner, text_script
from ft.server import RunningServer
from tests.support.scripts import ANSWER, CALL, QUESTION, events_of, tool_then_answer
from tests.support.server import fake_server, wait_idle

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def sdk(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


async def post(server: RunningServer, body: dict[str, Any] | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
        return await c.post("/v1/responses", content=content, headers={"content-type": "application/json"})


# --- the SDK ---------------------------------------------------------------------------------


async def test_sdk_create_and_stream_agree(server: RunningServer) -> None:
    """The SDK's create and stream agree on output text and status."""
    async with sdk(server) as client:
        whole = await client.responses.create(model="fake", input=QUESTION, instructions="Be brief.")
        assert whole.id.startswith("resp_") and whole.object == "response"
        assert whole.status == "completed" and whole.incomplete_details is None
        assert whole.output_text == "Hello from the fake model."
        (item,) = whole.output
        assert item.type == "message" and item.role == "assistant" and item.status == "completed"
        assert whole.usage is not None and whole.usage.input_tokens > 0
        assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
        async with client.responses.stream(model="fake", input=QUESTION, instructions="Be brief.") as stream:
            pieces = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(pieces) == whole.output_text == final.output_text
        assert final.usage is not None
        assert final.usage.output_tokens == whole.usage.output_tokens


async def test_input_items_and_text_parts(server: RunningServer) -> None:
    """Message items of every role, with text parts, are accepted as input."""
    async with sdk(server) as client:
        done = await client.responses.create(
            model="fake",
            input=[
                {"role": "developer", "content": "Be brief."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Rainy."}]},
                {"role": "user", "content": "And tomorrow?"},
            ],
            max_output_tokens=5,
            temperature=0,
            top_p=0.5,
            text={"format": {"type": "text"}},
        )
    assert done.status == "incomplete"
    assert done.incomplete_details is not None
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == "Hello"


async def test_sdk_bad_parameter_is_bad_request(server: RunningServer) -> None:
    """A bad parameter raises the SDK's BadRequestError naming it."""
    async with sdk(server) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="fake", input=QUESTION, temperature=-1)
        assert info.value.body["param"] == "temperature"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"tools": [{"name": "no_type"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": [{"type": "teleport_call"}]}, "input"),
        ({"input": [{"type": "local_shell_call_output", "output": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
async def test_unsupported_or_invalid_fields_are_400(
    server: RunningServer, extra: dict[str, Any], param: str
) -> None:
    """Unsupported features and invalid fields are 400s naming the field."""
    r = await post(server, {"model": "fake", "input": QUESTION} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param), error


async def test_unknown_stored_responses_are_404(server: RunningServer) -> None:
    """GET and DELETE of a response never stored are 404s, through the SDK too."""
    assert (await post(server, {"input": QUESTION, "store": False})).status_code == 200
    async with httpx.AsyncClient(base_url=server.base_url) as c:
        for method in ("GET", "DELETE"):
            r = await c.request(method, "/v1/responses/resp_abc")
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "not_found"
    async with sdk(server) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_abc")


async def test_unpackable_top_k_is_400_and_leaks_nothing(server: RunningServer) -> None:
    """An integer past 64 bits is a 400, streamed or not, and leaves nothing registered."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as c:
        baseline = (await wait_idle(c))["requests"]["active"]
        for stream in ("", ',"stream":true'):
            body = '{"model":"fake","input":"hi","max_output_tokens":4' + stream
            r = await post(server, body + ',"top_k":' + str(2**64) + "}")
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "top_k"
            assert (await wait_idle(c))["requests"]["active"] == baseline
            assert (await post(server, body + ',"top_k":40}')).status_code == 200
        assert (await wait_idle(c))["requests"]["active"] == baseline


# --- streaming -------------------------------------------------------------------------------

TEXT_ITEM = ["response.output_item.added", "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


async def test_stream_event_order_and_sequence_numbers(server: RunningServer) -> None:
    """A stream follows OpenAI's event order with increasing sequence numbers."""
    r = await post(server, {"model": "fake", "input": QUESTION, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    names = [n for n, _ in events]
    n = len("Hello from the fake model.")
    assert names == (
        ["response.created", "response.in_progress"]
        + TEXT_ITEM
        + ["response.output_text.delta"] * n
        + TEXT_DONE
        + ["response.completed"]
    )
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == name for name, d in events)
    completed = events[-1][1]["response"]
    assert completed["status"] == "completed" and completed["usage"]["output_tokens"] > 0
    item_ids = {d.get("item_id") for _, d in events if "item_id" in d}
    assert item_ids == {completed["output"][0]["id"]}


async def test_stream_ends_incomplete_on_max_output_tokens(server: RunningServer) -> None:
    """A stream cut by max_output_tokens ends with response.incomplete."""
    r = await post(server, {"input": QUESTION, "stream": True, "max_output_tokens": 3})
    name, last = events_of(r.text)[-1]
    assert name == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"


def fail_after(num_generated: int) -> Callable[[list[SeqWork]], None]:
    def hook(works: list[SeqWork]) -> None:
        if any(w.num_generated >= num_generated for w in works):
            raise RuntimeError("injected fault")

    return hook


async def test_error_mid_stream_is_response_failed() -> None:
    """A fault after the headers ends the stream with response.failed."""
    async with fake_server(before_step=fail_after(3)) as s:
        r = await post(s, {"input": QUESTION, "stream": True})
        assert r.status_code == 200
        events = events_of(r.text)
        names = [n for n, _ in events]
        assert "response.output_text.delta" in names and names[-1] == "response.failed"
        failed = events[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["message"]
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            await wait_idle(c)


async def test_heartbeat_comments_while_prefill_is_slow() -> None:
    """A slow prefill gets heartbeat comments before the first output item."""
    async with fake_server(FakeRunner(script=text_script("Hi"), step_s=0.7)) as s:
        r = await post(s, {"input": QUESTION, "stream": True})
        before_output = r.text.split("response.output_item.added")[0]
        assert ": heartbeat" in before_output
        assert events_of(r.text)[-1][0] == "response.completed"


# --- tools -----------------------------------------------------------------------------------


async def test_function_call_round_trip() -> None:
    """A function_call item and its output make a round trip through the SDK."""
    async with fake_server(FakeRunner(script=tool_then_answer())) as s, sdk(s) as client:
        first = await client.responses.create(model="fake", input=QUESTION, tools=TOOLS)
        (call,) = first.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
        second = await client.responses.create(
            model="fake",
            tools=TOOLS,
            input=[
                {"role": "user", "content": QUESTION},
                *[item.model_dump(exclude_none=True) for item in first.output],
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
            ],
        )
        assert second.output_text == ANSWER


async def test_streamed_function_call_events() -> None:
    """A streamed function call sends its arguments delta and done events."""
    async with fake_server(FakeRunner(script=text_script(CALL))) as s:
        r = await post(s, {"input": QUESTION, "tools": TOOLS, "stream": True})
        events = events_of(r.text)
        names = [n for n, _ in events]
        assert names == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        added = events[2][1]["item"]
        assert added["type"] == "function_call" and added["arguments"] == ""
        assert json.loads(events[3][1]["delta"]) == {"city": "Paris"}
        assert events[4][1]["name"] == "get_weather"
        async with (
            sdk(s) as client,
            client.responses.stream(model="fake", input=QUESTION, tools=TOOLS) as stream,
        ):
            final = await stream.get_final_response()
        (call,) = final.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
        for choice in ("required", {"type": "function", "name": "get_weather"}):
            r = await post(s, {"input": QUESTION, "tools": TOOLS, "tool_choice": choice})
            assert r.json()["output"][0]["type"] == "function_call"
        r = await post(s, {"input": QUESTION, "tools": TOOLS, "tool_choice": "none"})
        assert r.json()["output"][0]["content"][0]["text"] == CALL


async def test_reasoning_items_with_a_reasoning_parser() -> None:
    """With a reasoning parser, <think> output becomes a reasoning item."""
    runner = FakeRunner(script=text_script("<think>Ponder.</think>Done."))
    async with fake_server(runner, reasoning_parser="think") as s, sdk(s) as client:
        done = await client.responses.create(model="fake", input=QUESTION)
        assert [i.type for i in done.output] == ["reasoning", "message"]
        assert done.output[0].content[0].text == "Ponder."  # type: ignore[union-attr,index]
        assert done.output_text == "Done."
        async with client.responses.stream(model="fake", input=QUESTION) as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_response()
        assert "response.reasoning_text.delta" in kinds
        assert [i.type for i in final.output] == ["reasoning", "message"]
        assert final.output_text == "Done."
