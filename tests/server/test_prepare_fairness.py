"""Preparing a request (tokenizing, templating, compiling its grammar) over real HTTP: a prompt
that cannot fit is refused before it is tokenized whole, and one client's refusals never
queue ahead of another client's work.

Clients are told apart by their peer address: each test's clients connect from their own
loopback address (127.0.0.2, 127.0.0.3, ...), which Linux routes like 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.engine.fake import CHATML
from ft.model.gguf_loader import gguf_tokenizer, open_gguf
from ft.model.pull import default_model_path
from ft.server import RunningServer
from tests.support.engine import fake_hooks, with_template
from tests.support.server import running_server

HOSTILE, HONEST = "127.0.0.2", "127.0.0.3"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
LOOPING_TEMPLATE = f"{{% if messages[-1]['content'] == 'loop' %}}{LOOP}{{% endif %}}" + CHATML
SLICE_CHARS = 32 * 1024


def client_from(address: str, server: RunningServer) -> httpx.AsyncClient:
    """An HTTP client on `server` whose connections come from the loopback `address`."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=server.base_url, transport=transport, timeout=120)


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1} | extra


def crashing_schema(k: int) -> dict[str, Any]:
    """A JSON schema whose chain of 1,000 `$ref`s overflows llguidance's stack (a segfault)."""
    n = 1000
    defs: dict[str, Any] = {
        f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}, "required": ["x"]}
        for i in range(n)
    }
    defs[f"a{n}"] = {"type": "string", "description": f"variant {k}"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def with_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return chat("hi", response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})


async def wait_until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(60):
        while not condition():
            await trio.sleep(0.01)


async def finish_order(
    server: RunningServer,
    hostile: list[dict[str, Any]],
    honest: dict[str, Any],
    queued: Callable[[], bool],
) -> tuple[list[tuple[str, int]], int]:
    """Post the `hostile` bodies from HOSTILE, then, once `queued()`, `honest` from HONEST;
    return who finished in which order (with their statuses) and the hostile ones before it."""
    done: list[tuple[str, int]] = []

    async def post(address: str, body: dict[str, Any]) -> None:
        async with client_from(address, server) as client:
            response = await client.post("/v1/chat/completions", json=body)
            done.append((address, response.status_code))

    async with trio.open_nursery() as nursery:
        for body in hostile:
            nursery.start_soon(post, HOSTILE, body)
        await wait_until(queued)
        nursery.start_soon(post, HONEST, honest)
    before = next(i for i, (address, _) in enumerate(done) if address == HONEST)
    return done, before


# --- huge prompts: refused before they are tokenized -------------------------------------------


@pytest.mark.slow
async def test_a_chat_prompt_far_past_the_context_is_refused_by_its_bytes_without_being_tokenized() -> None:
    """Four 4 MB chats were tokenized whole (~800k tokens, 84 s) before their refusal: 2 MB
    is at least 24,691 tokens of the default model (81 bytes at most a token), so none is."""
    async with running_server(EngineConfig()) as server, client_from(HOSTILE, server) as client:
        before = server.engine.tokenizer_statistics()
        words = ("alpha beta gamma delta " * 90_000)[:2_000_000]
        r = await client.post("/v1/chat/completions", json=chat(words))
        after = server.engine.tokenizer_statistics()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "at least 24" in error["message"] and "8192" in error["message"]
    assert after.num_chars_tokenized == before.num_chars_tokenized
    assert after.num_jobs == before.num_jobs + 1  # rendered and measured in one job, no more


@pytest.mark.slow
async def test_a_prompt_within_the_byte_bound_is_refused_after_the_slices_that_pass_the_context() -> None:
    """460 KB of English passes the bytes (at least 5,680 tokens) but is ~100k tokens: it is
    refused once its first slices count past 8,192, not after all of it."""
    async with running_server(EngineConfig()) as server, client_from(HOSTILE, server) as client:
        before = server.engine.tokenizer_statistics()
        text = "alpha beta gamma delta " * 20_000
        r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
        after = server.engine.tokenizer_statistics()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "counted in its first" in error["message"]
    tokenized = after.num_chars_tokenized - before.num_chars_tokenized
    assert tokenized <= 3 * 2 * SLICE_CHARS < len(text) // 2


@pytest.mark.slow
async def test_tokenize_of_a_long_text_goes_a_slice_a_job_and_gives_the_whole_texts_ids() -> None:
    """`/v1/tokenize` has no context to refuse by: it counts every token, a slice at a time
    (other clients' jobs go between them), and the ids are the whole text's."""
    text = "".join(f"word{k} and more, " for k in range(15_000))  # 240,000 characters
    async with running_server(EngineConfig()) as server, client_from(HONEST, server) as client:
        before = server.engine.tokenizer_statistics()
        r = await client.post("/v1/tokenize", json={"prompt": text})
        after = server.engine.tokenizer_statistics()
    assert r.status_code == 200, r.text
    assert after.num_jobs - before.num_jobs >= len(text) // (2 * SLICE_CHARS)
    assert after.num_chars_tokenized - before.num_chars_tokenized == len(text)
    spec = gguf_tokenizer(open_gguf(default_model_path(progress=False)), 8192)
    whole = spec.build().encode(text, add_special_tokens=False).ids
    tokens = r.json()["tokens"]
    assert tokens[len(tokens) - len(whole) :] == whole and len(tokens) - len(whole) in (0, 1)  # (a BOS)


# --- one client's refusals do not queue ahead of another's work --------------------------------


async def test_an_honest_chat_waits_for_one_template_deadline_refusal_not_for_all_of_them() -> None:
    """Six chats whose template runs to its deadline (0.5 s each, one worker) made an honest
    chat queued behind them wait for all six; it now enters right after the one rendering."""
    hooks = fake_hooks(executor=None, load_model=with_template(LOOPING_TEMPLATE))
    cfg = EngineConfig(num_pages=64, template_timeout_s=0.5, tokenizer_workers=1)
    async with running_server(cfg, hooks=hooks) as server:
        engine = server.engine
        done, before = await finish_order(
            server,
            [chat("loop") for _ in range(6)],
            chat("hi"),
            lambda: engine.tokenizer_statistics().slots.num_waiting >= 5,
        )
    assert sorted(status for _, status in done) == [200] + [400] * 6
    assert before <= 2, done  # the one rendering (and at most one that slipped in ahead)


async def test_a_new_schema_waits_for_the_compiles_running_not_for_another_clients_crashing_ones() -> None:
    """Schemas that crash the compiler, each paying its worker's restart in its own slot: a new
    schema from another client is compiled as soon as a slot frees, not after all of them."""
    hooks = fake_hooks(executor=None)
    async with running_server(EngineConfig(num_pages=64), hooks=hooks) as server:
        engine = server.engine
        slots = engine.grammar_statistics().slots.num_slots
        count = slots + 3
        done, before = await finish_order(
            server,
            [with_schema(crashing_schema(k)) for k in range(count)],
            with_schema({"type": "object", "properties": {"answer": {"type": "integer"}}}),
            lambda: engine.grammar_statistics().num_compiling >= count,
        )
        stats = engine.grammar_statistics()
    assert sorted(status for _, status in done) == [200] + [400] * count
    assert before <= slots + 1, done  # those compiling (and one that slipped in ahead)
    assert stats.num_worker_restarts == count  # each crash paid for its own replacement
