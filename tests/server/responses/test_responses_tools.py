"""`/v1/responses` as Codex uses it, on the fake model: every tool type, custom and local_shell
calls both ways, namespaces, reasoning's encrypted_content, stored responses, hostile variants."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio

from ft.engine.fake import FakeRunner, text_script
from ft.server import RunningServer
from ft.server.openai.schemas import MAX_TOOLS
from ft.server.responses.schemas import MAX_GRAMMAR_LEN, ResponsesRequest
from ft.server.responses.store import MAX_HISTORY_MESSAGES
from ft.server.responses.tools import offered_tools
from tests.support.scripts import ANSWER, QUESTION, events_of
from tests.support.server import fake_server, wait_idle

FUNCTION = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
LARK = (
    'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?\n'
)
CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": LARK},
}
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}},
        {"type": "custom", "name": "agent_note", "format": {"type": "text"}},
        {"type": "web_search"},
    ],
}
HOSTED = [
    {"type": "web_search", "external_web_access": False},
    {"type": "web_search_preview", "search_context_size": "low"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation", "quality": "low"},
    {"type": "mcp", "server_label": "docs", "server_url": "https://example.invalid/mcp"},
    {"type": "tool_search"},
    {"type": "a_tool_type_of_2027", "anything": {"at": ["all"]}},
]
EVERY_TOOL = [FUNCTION, CUSTOM, {"type": "local_shell"}, NAMESPACE, *HOSTED]


def call_of(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
        return await c.post("/v1/responses", json=body)


# --- tool types ------------------------------------------------------------------------------


def test_local_tools_are_offered_and_hosted_ones_dropped() -> None:
    """Function, custom, local_shell and namespace members are offered; hosted and unknown
    types are not, and a custom tool's grammar is in its description."""
    req = ResponsesRequest.model_validate({"input": "hi", "tools": EVERY_TOOL})
    offered = offered_tools(req.tools)
    assert list(offered.by_name) == ["get_weather", "apply_patch", "local_shell", "spawn_agent", "agent_note"]
    assert offered.num_dropped == len(HOSTED) + 1  # and the namespace's web_search
    assert offered.by_name["spawn_agent"].namespace == "multi_agent_v1"
    patch = next(d for d in offered.definitions if d["function"]["name"] == "apply_patch")
    assert LARK in patch["function"]["description"]
    assert patch["function"]["parameters"]["required"] == ["input"]


async def test_every_tool_type_is_served_not_refused() -> None:
    """A request with every tool type OpenAI defines, and an unknown one, is a 200; the echoed
    hosted tools keep their type only."""
    async with fake_server() as s:
        r = await post(s, {"input": QUESTION, "tools": EVERY_TOOL, "tool_choice": {"type": "web_search"}})
        assert r.status_code == 200, r.text
        echoed = r.json()["tools"]
        assert [t["type"] for t in echoed] == [t["type"] for t in EVERY_TOOL]
        assert echoed[-1] == {"type": "a_tool_type_of_2027"}


async def test_custom_tool_call_round_trip() -> None:
    """The model's call of a custom tool is a custom_tool_call with its input string, streamed
    with custom_tool_call_input events; its output is accepted on the next turn."""
    patch = "*** Begin Patch\n*** End Patch\n"
    runner = FakeRunner(script=text_script(call_of("apply_patch", {"input": patch})))
    async with fake_server(runner) as s:
        whole = (await post(s, {"input": QUESTION, "tools": [CUSTOM]})).json()
        (call,) = whole["output"]
        assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch"
        assert call["input"] == patch and call["call_id"]
        r = await post(s, {"input": QUESTION, "tools": [CUSTOM], "stream": True})
        events = events_of(r.text)
        names = [n for n, _ in events]
        assert names[2:] == [
            "response.output_item.added",
            "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert events[-2][1]["item"]["input"] == patch
        follow_up = [
            {"role": "user", "content": QUESTION},
            call,
            {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "applied"},
        ]
        assert (await post(s, {"input": follow_up, "tools": [CUSTOM]})).status_code == 200


async def test_local_shell_call_round_trip() -> None:
    """The model's local_shell call is a local_shell_call with an exec action; its output item
    (keyed by `id`, as OpenAI spells it, or `call_id`) is accepted on the next turn."""
    runner = FakeRunner(script=text_script(call_of("local_shell", {"command": ["ls", "-la"]})))
    async with fake_server(runner) as s:
        whole = (await post(s, {"input": QUESTION, "tools": [{"type": "local_shell"}]})).json()
        (call,) = whole["output"]
        assert call["type"] == "local_shell_call"
        assert call["action"] == {"type": "exec", "command": ["ls", "-la"]}
        for key in ("id", "call_id"):
            follow_up = [
                {"role": "user", "content": QUESTION},
                call,
                {"type": "local_shell_call_output", key: call["call_id"], "output": "total 0"},
            ]
            r = await post(s, {"input": follow_up, "tools": [{"type": "local_shell"}]})
            assert r.status_code == 200, r.text


async def test_namespace_member_call_is_a_function_call_with_its_namespace() -> None:
    """A call of a namespace's member function is a function_call naming the namespace."""
    runner = FakeRunner(script=text_script(call_of("spawn_agent", {})))
    async with fake_server(runner) as s:
        (call,) = (await post(s, {"input": QUESTION, "tools": [NAMESPACE]})).json()["output"]
        assert call["type"] == "function_call" and call["name"] == "spawn_agent"
        assert call["namespace"] == "multi_agent_v1"


async def test_reasoning_encrypted_content_out_and_in() -> None:
    """With include reasoning.encrypted_content, reasoning items carry it; sent back, with the
    hosted items of an earlier turn, the next request is served."""
    runner = FakeRunner(script=text_script("<think>Ponder.</think>Done."))
    async with fake_server(runner, reasoning_parser="think") as s:
        body = {"input": QUESTION, "include": ["reasoning.encrypted_content"], "store": False}
        output = (await post(s, body)).json()["output"]
        assert output[0]["type"] == "reasoning" and output[0]["encrypted_content"]
        plain = (await post(s, {"input": QUESTION})).json()["output"]
        assert "encrypted_content" not in plain[0]
        follow_up = [
            {"role": "user", "content": QUESTION},
            *output,
            {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
            {"role": "user", "content": "And then?"},
        ]
        assert (await post(s, {"input": follow_up})).status_code == 200


# --- stored responses ------------------------------------------------------------------------


async def test_stored_response_get_continue_delete() -> None:
    """A response is stored by default: GET returns it, previous_response_id continues its
    conversation (the tool's result reaches the model), DELETE forgets it."""
    call = call_of("get_weather", {"city": "Paris"})
    first: list[int] = []
    said_call, said_answer = text_script(call), text_script(ANSWER)

    def script(work: Any) -> int:
        if not first:
            first.append(work.num_prompt_tokens)
        return said_call(work) if work.num_prompt_tokens <= first[0] else said_answer(work)

    async with fake_server(FakeRunner(script=script)) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        created = (await post(s, {"input": QUESTION, "tools": [FUNCTION]})).json()
        assert created["store"] is True
        got = await c.get(f"/v1/responses/{created['id']}")
        assert got.status_code == 200 and got.json() == created
        (item,) = created["output"]
        follow_up = {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}
        body = {"previous_response_id": created["id"], "input": [follow_up], "tools": [FUNCTION]}
        second = (await post(s, body)).json()
        assert second["previous_response_id"] == created["id"]
        assert second["output"][0]["content"][0]["text"] == ANSWER
        deleted = await c.delete(f"/v1/responses/{created['id']}")
        assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
        assert (await c.get(f"/v1/responses/{created['id']}")).status_code == 404
        # The second response holds its whole conversation: deleting the first breaks nothing.
        third = await post(s, {"previous_response_id": second["id"], "input": "Thanks."})
        assert third.status_code == 200, third.text
        gone = await post(s, {"previous_response_id": created["id"], "input": "Again?"})
        assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"


async def test_store_false_and_streamed_responses() -> None:
    """store false keeps nothing; a streamed response is stored when it completes."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        unstored = (await post(s, {"input": QUESTION, "store": False})).json()
        assert unstored["store"] is False
        assert (await c.get(f"/v1/responses/{unstored['id']}")).status_code == 404
        r = await post(s, {"input": QUESTION, "stream": True})
        completed = events_of(r.text)[-1][1]["response"]
        got = await c.get(f"/v1/responses/{completed['id']}")
        assert got.status_code == 200 and got.json()["output"] == completed["output"]


# --- hostile variants ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tools",
    [
        [FUNCTION | {"name": f"f{i}"} for i in range(MAX_TOOLS + 1)],
        [NAMESPACE | {"tools": [FUNCTION | {"name": f"f{i}"} for i in range(MAX_TOOLS)]}, FUNCTION],
        [FUNCTION, NAMESPACE | {"tools": [FUNCTION]}],
        [
            CUSTOM
            | {"format": {"type": "grammar", "syntax": "lark", "definition": "(" * (MAX_GRAMMAR_LEN + 1)}}
        ],  # noqa: E501
        [{"type": "x" * 10_000}],
    ],
    ids=["too_many", "namespace_flattens_past_max", "duplicate_name", "huge_grammar", "huge_type"],
)
async def test_hostile_tool_lists_are_400_and_hold_nothing(tools: list[Any]) -> None:
    """Too many tools (counting namespace members), duplicates, a grammar past its bound and a
    huge type name are 400s naming tools, and leave nothing registered or stored."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        baseline = (await wait_idle(c))["requests"]["active"]
        with trio.fail_after(30):
            r = await post(s, {"input": QUESTION, "tools": tools})
        assert r.status_code == 400, r.text[:500]
        assert r.json()["error"]["param"].startswith("tools")
        assert (await wait_idle(c))["requests"]["active"] == baseline


async def test_unknown_tool_with_a_huge_payload_is_dropped_not_held() -> None:
    """An unknown tool type carrying megabytes is served; neither the prompt nor the stored
    response keeps its payload."""
    payload = {"type": "future_tool", "blob": ["x" * 1000] * 1000}
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await post(s, {"input": QUESTION, "tools": [payload]})
        assert r.status_code == 200, r.text[:500]
        assert len(r.content) < 10_000
        stored = await c.get(f"/v1/responses/{r.json()['id']}")
        assert len(stored.content) < 10_000


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k": "v" * 513},
        {"k" * 65: "v"},
        {"k": {"nested": "v"}},
        {f"k{i}": "v" * 60 for i in range(50_000)},  # ~3.5 MiB: 16 such filled the store
    ],
    ids=["too_many_pairs", "long_value", "long_key", "not_a_string", "megabytes"],
)
async def test_metadata_past_openais_bounds_is_400_and_stores_nothing(metadata: dict[str, Any]) -> None:
    """`metadata` is kept with a stored response: past OpenAI's bounds (16 string pairs, keys
    to 64 chars, values to 512) it is a 400 naming metadata, and nothing is stored or held."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        with trio.fail_after(30):
            r = await post(s, {"input": QUESTION, "max_output_tokens": 2, "metadata": metadata})
        assert r.status_code == 400, r.text[:500]
        assert r.json()["error"]["param"].startswith("metadata")
        assert (await wait_idle(c))["requests"]["active"] == 0
        ok = {f"k{i}": "v" * 512 for i in range(16)}
        r = await post(s, {"input": QUESTION, "max_output_tokens": 2, "metadata": ok})
        assert r.status_code == 200, r.text[:500]
        stored = await c.get(f"/v1/responses/{r.json()['id']}")
        assert stored.json()["metadata"] == ok


async def test_unbounded_previous_response_chain_is_400_and_holds_nothing() -> None:
    """Continuing a stored conversation past the history bound is a 400 naming
    previous_response_id; nothing is registered and nothing new stored."""
    many = [{"role": "user", "content": "x"}] * (MAX_HISTORY_MESSAGES - 1)
    async with (
        fake_server(context_length=131072, num_pages=4096) as s,
        httpx.AsyncClient(base_url=s.base_url) as c,
    ):
        created = await post(s, {"input": many, "max_output_tokens": 2})
        assert created.status_code == 200, created.text[:500]
        first = created.json()
        baseline = (await wait_idle(c))["requests"]["active"]
        more = [{"role": "user", "content": "y"}] * 8
        r = await post(s, {"previous_response_id": first["id"], "input": more})
        assert r.status_code == 400, r.text[:500]
        assert r.json()["error"]["param"] == "previous_response_id"
        assert (await wait_idle(c))["requests"]["active"] == baseline


async def test_deeply_nested_custom_grammar_within_bounds_is_never_compiled() -> None:
    """A custom tool's lark grammar nested 30,000 deep is shown to the model, never compiled:
    the request is served at once, with no grammar compile held."""
    nested = "start: " + "(" * 30_000 + '"x"' + ")" * 30_000
    tool = CUSTOM | {"format": {"type": "grammar", "syntax": "lark", "definition": nested}}
    async with (
        fake_server(context_length=131072, num_pages=8192) as s,
        httpx.AsyncClient(base_url=s.base_url) as c,
    ):
        with trio.fail_after(30):
            r = await post(s, {"input": QUESTION, "tools": [tool], "store": False})
        assert r.status_code == 200, r.text[:500]
        assert (await wait_idle(c))["requests"]["active"] == 0


async def test_sdk_retrieve_continue_and_delete() -> None:
    """The openai SDK's retrieve, previous_response_id and delete work against the store."""
    async with (
        fake_server() as s,
        openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0) as client,
    ):
        first = await client.responses.create(model="fake", input=QUESTION)
        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
        second = await client.responses.create(model="fake", input="More?", previous_response_id=first.id)
        assert second.previous_response_id == first.id and second.status == "completed"
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
