"""Tenants over real HTTP: one caller cannot read another's prompt through the prefix cache.

The attack: a client that knows the shape of another's prompt ("... my PIN is NNNN ...") sends
candidates and reads `usage.prompt_tokens_details.cached_tokens`; the candidate that matches
the victim's cached pages further shows more cached tokens. With several API keys each key is
its own partition of the cache, and within one key each `cache_salt` is; the same key and salt
still reuse their prefix.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pytest

from ft.config import EngineConfig
from ft.server.edge.tenants import MAX_API_KEYS, Tenants, tenant_id
from ft.server.settings import ServerSettings
from tests.support.server import TEST_SETTINGS, fake_server, running_server

PIN = "4821"
WRONG = ["0000", "1234", "4820", "4801", "9821", "4721", "4822", "5821", "4800"]
PREFIX = "You are the vault's assistant. Remember this, and say it to no one: my PIN is "
SUFFIX = ". Never repeat it, whatever anyone asks, and answer every question politely."


def pin_prompt(pin: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{PREFIX}{pin}{SUFFIX} What is the weather like?"}]


async def cached_tokens(c: httpx.AsyncClient, key: str | None, pin: str, **body: Any) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = await c.post(
        "/v1/chat/completions",
        json={"messages": pin_prompt(pin), "max_tokens": 1, **body},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def probe(c: httpx.AsyncClient, key: str | None, **body: Any) -> dict[str, int]:
    """Cached tokens of each candidate PIN, wrong ones first (the attacker's own pages warm)."""
    return {pin: await cached_tokens(c, key, pin, **body) for pin in [*WRONG, PIN]}


def leaks(seen: dict[str, int]) -> bool:
    """Whether the right PIN stands out: more cached tokens than every wrong candidate."""
    return seen[PIN] > max(seen[pin] for pin in WRONG)


async def test_with_two_api_keys_one_cannot_probe_the_others_prompt() -> None:
    async with (
        fake_server(api_keys=("key-a", "key-b")) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=30) as c,
    ):
        full = await cached_tokens(c, "key-a", PIN)
        assert full == 0
        seen = await probe(c, "key-b")
        assert not leaks(seen), seen
        assert seen[PIN] in {seen[pin] for pin in WRONG}
        # Prefix reuse is unchanged for the key that wrote the pages.
        again = await cached_tokens(c, "key-a", PIN)
        assert again >= 128 and again > seen[PIN]


@pytest.mark.slow  # the real default model
async def test_on_the_default_model_a_second_key_cannot_probe_the_first_keys_prompt() -> None:
    settings = replace(TEST_SETTINGS, api_keys=("key-a", "key-b"))
    async with (
        running_server(EngineConfig(compute_threads=1), settings=settings) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as c,
    ):
        assert await cached_tokens(c, "key-a", PIN) == 0
        seen = await probe(c, "key-b")
        assert not leaks(seen), seen
        again = await cached_tokens(c, "key-a", PIN)
        assert again > seen[PIN] and again >= 32


async def test_with_one_key_a_cache_salt_keeps_callers_apart() -> None:
    async with fake_server(api_key="shared") as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        assert await cached_tokens(c, "shared", PIN, cache_salt="alice") == 0
        for salt in ({"cache_salt": "mallory"}, {}):
            seen = await probe(c, "shared", **salt)
            assert not leaks(seen), (salt, seen)
        again = await cached_tokens(c, "shared", PIN, cache_salt="alice")
        assert again >= 128 and again > seen[PIN]


async def test_without_keys_or_salts_the_prefix_is_shared_as_before() -> None:
    """One tenant: the cache is shared (what an operator running one key gets), and that is
    exactly what the probe reads; the partitions above are what stops it."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        await cached_tokens(c, None, PIN)
        assert leaks(await probe(c, None))


async def test_embeddings_are_partitioned_per_key_too() -> None:
    """Pooling fills and reads the same prefix cache (last pooling reuses a cached prefix)."""
    text = f"{PREFIX}{PIN}{SUFFIX}"

    async def cached(c: httpx.AsyncClient, key: str, path: str, body: dict[str, Any]) -> int:
        r = await c.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with (
        fake_server(api_keys=("key-a", "key-b")) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=30) as c,
    ):
        for path, body in (
            ("/v1/embeddings", {"input": text}),
            ("/v1/rerank", {"query": f"rerank: {text}", "documents": ["a"]}),
            ("/v1/score", {"text_1": f"score: {text}", "text_2": "a"}),
        ):
            assert await cached(c, "key-a", path, body) == 0
            assert await cached(c, "key-b", path, body) == 0, path
            assert await cached(c, "key-a", path, body) >= 64, path


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/rerank", {"query": "hi", "documents": ["a"]}),
        ("/v1/score", {"text_1": "hi", "text_2": "a"}),
    ],
)
async def test_every_route_that_fills_the_cache_takes_a_cache_salt(path: str, body: dict[str, Any]) -> None:
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        assert (await c.post(path, json={**body, "cache_salt": "tenant-7 salt"})).status_code == 200
        for bad in ("", "x" * 257, "line\nbreak", 7):
            r = await c.post(path, json={**body, "cache_salt": bad})
            assert r.status_code == 400, (bad, r.text)
            error = r.json()["error"]
            assert "cache_salt" in str(error), error


async def cached_on(c: httpx.AsyncClient, path: str, body: dict[str, Any], where: tuple[str, ...]) -> int:
    """The cached prompt tokens `path`'s answer to `body` reports, at `where` in its usage."""
    r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    value: Any = r.json()["usage"]
    for key in where:
        value = value[key]
    return int(value)


async def test_completions_responses_and_messages_partition_by_salt_too() -> None:
    prompt = f"{PREFIX}{PIN}{SUFFIX}"  # messages and responses render it alike: each its own salts
    calls = [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 1}, ("prompt_tokens_details", "cached_tokens")),
        (
            "/v1/responses",
            {"input": prompt, "max_output_tokens": 1},
            ("input_tokens_details", "cached_tokens"),
        ),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1},
            ("cache_read_input_tokens",),
        ),
    ]
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        for path, body, where in calls:
            salted = {**body, "cache_salt": f"a {path}"}
            assert await cached_on(c, path, salted, where) == 0
            assert await cached_on(c, path, {**body, "cache_salt": f"b {path}"}, where) == 0
            assert await cached_on(c, path, salted, where) >= 64, path


async def test_a_second_key_is_its_own_tenant_and_a_wrong_key_none() -> None:
    async with (
        fake_server(api_key="key-a", api_keys=("key-b",)) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=30) as c,
    ):
        for key, status in (("key-a", 200), ("key-b", 200), ("key-c", 401), ("key-", 401), (None, 401)):
            headers = {"x-api-key": key} if key else {}
            assert (await c.get("/v1/models", headers=headers)).status_code == status, key


def test_a_tenant_is_named_by_a_hash_of_its_key_never_the_key() -> None:
    tenants = Tenants(["key-a", "key-b"])
    a, b = tenants.identify(b"key-a"), tenants.identify(b"key-b")
    assert a is not None and b is not None and a.tenant == tenant_id("key-a") != b.tenant
    assert a.tenant is not None and "key-a" not in a.tenant and len(a.tenant) == 32
    assert tenants.identify(b"key-c") is None and tenants.identify(None) is None
    assert b"key-a" not in repr(vars(tenants)).encode()  # digests and ids only


def test_one_key_or_none_is_one_tenant() -> None:
    one = Tenants(["only"])
    caller = one.identify(b"only")
    assert caller is not None and caller.tenant is None
    anyone = Tenants([]).identify(None)
    assert anyone is not None and anyone.tenant is None


def test_api_keys_are_bounded_and_never_empty() -> None:
    ServerSettings(api_keys=tuple(f"k{i}" for i in range(MAX_API_KEYS)))
    with pytest.raises(ValueError, match="at most 4096"):
        ServerSettings(api_key="one more", api_keys=tuple(f"k{i}" for i in range(MAX_API_KEYS)))
    with pytest.raises(ValueError, match="empty"):
        ServerSettings(api_keys=("a", ""))
    assert ServerSettings(api_key="a", api_keys=("b", "a")).all_api_keys == ("a", "b")


KEY_A, KEY_B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


async def stored_response(c: httpx.AsyncClient, headers: dict[str, str], *, stream: bool) -> str:
    """The id of a response stored by the caller of `headers` (streamed or not)."""
    body = {"input": "hi", "max_output_tokens": 2, "stream": stream}
    r = await c.post("/v1/responses", json=body, headers=headers)
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["id"])
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    return str(events[-1]["response"]["id"])


def continuing(previous: str) -> dict[str, Any]:
    return {"previous_response_id": previous, "input": "more", "max_output_tokens": 2}


async def ask(c: httpx.AsyncClient, how: str, response_id: str, headers: dict[str, str]) -> httpx.Response:
    """GET, DELETE or continue (`previous_response_id`) the stored response `response_id`."""
    if how == "continue":
        return await c.post("/v1/responses", json=continuing(response_id), headers=headers)
    return await c.request(how, f"/v1/responses/{response_id}", headers=headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stored_response_is_read_deleted_and_continued_only_by_its_own_key(stream: bool) -> None:
    """Key B holding key A's response id gets what an unknown id gets (so it cannot tell the
    response exists), and its DELETE deletes nothing; key A's calls work as before."""
    unknown = "resp_" + "0" * 32
    async with (
        fake_server(api_keys=("key-a", "key-b")) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=30) as c,
    ):
        response_id = await stored_response(c, KEY_A, stream=stream)
        mine = await ask(c, "GET", response_id, KEY_A)
        assert mine.status_code == 200 and mine.json()["id"] == response_id, mine.text
        for how in ("GET", "DELETE", "continue"):
            theirs = await ask(c, how, response_id, KEY_B)
            never = await ask(c, how, unknown, KEY_B)
            assert theirs.status_code == never.status_code != 200, (how, theirs.text)
            assert theirs.json() == json.loads(never.text.replace(unknown, response_id)), how
        assert (await ask(c, "GET", response_id, KEY_A)).json() == mine.json()
        more = await ask(c, "continue", response_id, KEY_A)
        assert more.status_code == 200 and more.json()["previous_response_id"] == response_id
        assert (await ask(c, "GET", more.json()["id"], KEY_B)).status_code == 404  # A's too
        deleted = await ask(c, "DELETE", response_id, KEY_A)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert (await ask(c, "GET", response_id, KEY_A)).status_code == 404


async def test_with_one_key_a_stored_response_is_every_callers_as_before() -> None:
    shared = {"Authorization": "Bearer shared"}
    async with fake_server(api_key="shared") as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        response_id = await stored_response(c, shared, stream=False)
        for how in ("GET", "continue", "DELETE"):
            assert (await ask(c, how, response_id, shared)).status_code == 200, how


async def test_with_several_keys_the_workers_are_shared_by_key_not_by_address() -> None:
    """Two keys from one address are two clients of the fair queue (`current_client`); one
    key's refusals then wait behind the other key's work, not beside it."""
    async with (
        fake_server(api_keys=("key-a", "key-b")) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=30) as c,
    ):
        for key in ("key-a", "key-b"):
            await cached_tokens(c, key, PIN)
        assert s.engine.tokenizer_statistics().slots.num_clients == 2
