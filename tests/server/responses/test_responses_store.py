"""The `/v1/responses` store: bounded in count, bytes and age (least recently used, or oldest,
out first), holding JSON bytes rather than Python objects (what it holds is what it counts),
made and decoded off the event loop, with `GET`, `DELETE` and `previous_response_id` as before."""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.errors import InvalidRequest
from ft.server import RunningServer, ServerSettings
from ft.server.responses.store import (
    MAX_HISTORY_MESSAGES,
    Conversation,
    ResponseStore,
    StoredResponse,
    continue_conversation,
    decode_messages,
    encode_messages,
    stored,
)
from tests.support.engine import fake_hooks
from tests.support.server import TEST_SETTINGS, fake_server, loop_load, running_server

USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


class FakeClock:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(messages: list[dict[str, Any]], response: dict[str, Any] | None = None) -> StoredResponse:
    """The stored record of a response (`response`, else a small one) to `messages`."""
    conversation = continue_conversation(None, messages, is_stored=True, max_entry_bytes=1 << 30)
    record = stored(response or {"id": "r"}, conversation, [{"role": "assistant", "content": "ok"}])
    assert record is not None
    return record


# --- bounds ----------------------------------------------------------------------------------


def test_the_store_keeps_at_most_max_entries_the_least_recently_used_out_first() -> None:
    store = ResponseStore(max_entries=2)
    for name in ("a", "b"):
        assert store.put(name, entry(USER), owner=None)
    assert store.get("a", owner=None) is not None  # now b is the least recently used
    assert store.put("c", entry(USER), owner=None)
    assert (
        store.get("b", owner=None) is None
        and store.get("a", owner=None) is not None
        and store.get("c", owner=None) is not None
    )
    assert store.statistics().num_entries == 2


def test_the_store_keeps_at_most_max_bytes_counting_the_bytes_it_holds() -> None:
    one = entry([{"role": "user", "content": "x" * 3000}])
    store = ResponseStore(max_bytes=3 * one.num_bytes + 10)
    for name in ("a", "b", "c", "d"):
        assert store.put(name, one, owner=None)
    assert store.get("a", owner=None) is None and store.get("d", owner=None) is not None
    assert store.statistics().num_entries == 3 and store.statistics().num_bytes == 3 * one.num_bytes
    assert store.delete("b", owner=None) and not store.delete("b", owner=None)
    assert store.statistics().num_bytes == 2 * one.num_bytes


def test_a_response_past_max_age_is_gone_the_oldest_first() -> None:
    """Age counts from the put; a read makes a response recently used, not younger."""
    clock = FakeClock()
    store = ResponseStore(max_age_s=100.0, clock=clock)
    assert store.put("old", entry(USER), owner=None)
    clock.now += 60
    assert store.put("young", entry(USER), owner=None)
    clock.now += 39
    assert store.get("old", owner=None) is not None
    clock.now += 1
    assert store.get("old", owner=None) is None and store.get("young", owner=None) is not None
    assert store.statistics().num_entries == 1
    clock.now += 60
    assert store.statistics() == store.statistics().__class__(0, 0)
    assert (
        store.put("old", entry(USER), owner=None) and store.get("old", owner=None) is not None
    )  # stored again: a new age


def test_another_owner_finds_nothing_and_changes_nothing() -> None:
    """A response is its owner's: any other owner (None included) gets and deletes nothing,
    and its attempts do not make the response recently used."""
    store = ResponseStore(max_entries=2)
    assert store.put("a", entry(USER), owner="tenant-a")
    assert store.put("b", entry(USER), owner="tenant-a")
    for other in ("tenant-b", None):
        assert store.get("a", owner=other) is None and not store.delete("a", owner=other)
    assert store.put("c", entry(USER), owner="tenant-b")  # "a" is still the least recently used
    assert store.get("a", owner="tenant-a") is None and store.get("b", owner="tenant-a") is not None
    assert store.get("c", owner="tenant-b") is not None and store.delete("c", owner="tenant-b")


def test_a_response_too_large_to_keep_is_not_stored() -> None:
    store = ResponseStore(max_entry_bytes=1000)
    assert not store.put("huge", entry([{"role": "user", "content": "x" * 2000}]), owner=None)
    assert store.get("huge", owner=None) is None and store.statistics().num_entries == 0
    too_long = continue_conversation(
        None, [{"role": "user", "content": "x" * 2000}], is_stored=True, max_entry_bytes=1000
    )
    assert too_long.history is None  # a new conversation past the bound is served, not stored
    assert stored({"id": "r"}, too_long, []) is None


def test_continuing_past_the_history_bounds_is_a_400_naming_previous_response_id() -> None:
    long = entry([{"role": "user", "content": "x"}] * (MAX_HISTORY_MESSAGES - 1))
    with pytest.raises(InvalidRequest) as info:
        continue_conversation(
            long, [{"role": "user", "content": "more"}], is_stored=True, max_entry_bytes=1 << 30
        )
    assert info.value.param == "previous_response_id"
    big = entry([{"role": "user", "content": "x" * 40_000}])
    with pytest.raises(InvalidRequest) as info:
        continue_conversation(
            big, [{"role": "user", "content": "y" * 20_000}], is_stored=False, max_entry_bytes=50_000
        )
    assert info.value.param == "previous_response_id"


def test_the_bounds_are_validated_settings() -> None:
    for bad in (
        {"response_store_max_entries": 0},
        {"response_store_bytes": 10},
        {"response_store_max_age_s": 0.0},
        {"response_store_max_age_s": float("nan")},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerSettings(**bad)


# --- what it holds ---------------------------------------------------------------------------


def test_the_store_holds_json_bytes_and_counts_exactly_them() -> None:
    """No dict or list of the conversation is kept: its turns and the response are bytes, and
    the byte bound counts what they hold (each bytes object's payload)."""
    calls = [tool_call(k) for k in range(20)]
    record = entry([*USER, {"role": "assistant", "content": "", "tool_calls": calls}], {"id": "r", "x": "é"})
    parts = [record.response, *record.history, record.output]
    assert all(type(p) is bytes for p in parts)
    assert record.num_bytes == sum(len(p) for p in parts)
    overhead = sys.getsizeof(b"")
    assert sum(sys.getsizeof(p) - overhead for p in parts) == record.num_bytes
    store = ResponseStore()
    assert store.put("r", record, owner=None) and store.statistics().num_bytes == record.num_bytes
    assert json.loads(record.response) == {"id": "r", "x": "é"}


def test_a_conversation_decodes_to_the_messages_it_was_made_of() -> None:
    """Tool calls' arguments (objects, strings, the odd shapes), content parts and non-ASCII
    text come back as they went in, across a continuation."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Sé brève. 日本"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi \u2028"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                tool_call(1),
                {"id": "s", "type": "function", "function": {"name": "f", "arguments": "not json {"}},
                {"id": "t", "type": "function", "function": {"name": "f", "arguments": {}}},
                {
                    "id": "u",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"arguments_json": "x"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert decode_messages(encode_messages(messages)) == messages
    first = entry(messages)
    more = [{"role": "user", "content": "and?"}]
    conversation = continue_conversation(first, more, is_stored=True, max_entry_bytes=1 << 30)
    assert conversation.messages == [*messages, {"role": "assistant", "content": "ok"}, *more]
    assert conversation.history is not None and conversation.history[: len(first.history)] == first.history


def tool_call(k: int, size: int = 100) -> dict[str, Any]:
    arguments = {"v": list(range(10_000 + k, 10_000 + k + size))}
    return {"id": f"c{k}", "type": "function", "function": {"name": "f", "arguments": arguments}}


# --- over HTTP -------------------------------------------------------------------------------


def heavy_body(seed: int) -> dict[str, Any]:
    """A ~3.7 MB `input` whose tool calls' arguments parse into ~520,000 values (the fake
    model's template renders none of them, so it fits its context)."""
    arguments = json.dumps({"v": list(range(10_000 + seed, 19_000 + seed))})  # ~63 KB each
    calls = [
        {"type": "function_call", "call_id": f"c{k}", "name": "f", "arguments": arguments} for k in range(58)
    ]
    outputs = [{"type": "function_call_output", "call_id": f"c{k}", "output": "ok"} for k in range(58)]
    return {"input": [{"role": "user", "content": "hi"}, *calls, *outputs], "max_output_tokens": 2}


async def in_thread(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
    """The fake model's tokenizer job in a thread, as worker processes are off the loop."""
    return await trio.to_thread.run_sync(job, payload)


@asynccontextmanager
async def heavy_server(**settings: Any) -> AsyncIterator[RunningServer]:
    """A fake-model server for large conversations, its tokenizing off the loop."""
    cfg = EngineConfig(num_pages=1024, served_model_name="fake")
    hooks = fake_hooks(context_length=8192, executor=in_thread)
    async with running_server(cfg, hooks=hooks, settings=replace(TEST_SETTINGS, **settings)) as server:
        yield server


async def test_stored_conversations_cost_heap_blocks_per_turn_not_per_value() -> None:
    """Eight responses of ~520,000 parsed argument values each, stored: the heap grows by a few
    blocks per response (4.2 million as dicts and lists)."""
    async with heavy_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
        bodies = [heavy_body(i) for i in range(8)]
        assert (
            await c.post("/v1/responses", json={"input": "warm up", "max_output_tokens": 2})
        ).status_code == 200
        gc.collect()
        before = sys.getallocatedblocks()
        ids = []
        with trio.fail_after(120):
            for body in bodies:
                r = await c.post("/v1/responses", json=body)
                assert r.status_code == 200 and r.json()["store"] is True, r.text[:300]
                ids.append(r.json()["id"])
        gc.collect()
        grown = sys.getallocatedblocks() - before
        assert grown < 50_000, grown
        for response_id in ids:
            assert (await c.get(f"/v1/responses/{response_id}")).status_code == 200


async def test_storing_and_continuing_large_conversations_runs_off_the_loop() -> None:
    """Storing a large conversation, continuing it (`previous_response_id`) and reading it back
    do their encoding and decoding in threads: no step of a request on the loop is more than a
    small part of one request's work off it (measuring the conversation on the loop was one
    step as long as the work)."""
    rounds = 3
    async with heavy_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
        bodies = [json.dumps(heavy_body(i)).encode() for i in range(rounds)]  # not on the loop below
        with trio.fail_after(120):
            async with loop_load() as load:
                for body in bodies:
                    first = await c.post("/v1/responses", content=body, headers=JSON)
                    assert first.status_code == 200, first.text[:300]
                    more = {
                        "previous_response_id": first.json()["id"],
                        "input": "and?",
                        "max_output_tokens": 2,
                    }
                    second = await c.post("/v1/responses", json=more)
                    assert second.status_code == 200 and second.json()["store"] is True, second.text[:300]
                    got = await c.get(f"/v1/responses/{second.json()['id']}")
                    assert got.json() == second.json()
    per_request_off_loop = load.off_loop_s / (2 * rounds)
    assert load.longest_step_s < per_request_off_loop / 5, load


async def test_the_store_bounds_are_the_servers_settings() -> None:
    """`--response-store-max-entries 2`: a third stored response evicts the least recently
    used; GET, DELETE and `previous_response_id` answer for the others as before."""
    async with fake_server(response_store_max_entries=2) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        ids = []
        for _ in range(3):
            r = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        assert (await c.get(f"/v1/responses/{ids[0]}")).status_code == 404
        gone = await c.post("/v1/responses", json={"previous_response_id": ids[0], "input": "more"})
        assert gone.status_code == 400 and gone.json()["error"]["code"] == "previous_response_not_found"
        kept = await c.post("/v1/responses", json={"previous_response_id": ids[2], "input": "more"})
        assert kept.status_code == 200 and kept.json()["previous_response_id"] == ids[2]
        assert (await c.delete(f"/v1/responses/{ids[2]}")).json()["deleted"] is True
        assert (await c.get(f"/v1/responses/{ids[2]}")).status_code == 404


def test_a_conversation_not_stored_is_not_encoded() -> None:
    """`store: false` without a previous response: nothing is encoded (no work for nothing)."""
    assert continue_conversation(None, USER, is_stored=False, max_entry_bytes=10) == Conversation(USER, None)
