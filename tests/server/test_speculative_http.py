"""Speculative decoding over HTTP: every API, streamed and not, answers the same text with it as
without; the per-request switch; the counters in `/v1/stats` and `/metrics`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ft.engine.fake import FakeRunner, text_script
from tests.support.server import fake_server, parse_sse, wait_idle

PASSAGE = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
ANSWER = PASSAGE.replace("width", "w")
USER = [{"role": "user", "content": f"Rename width to w:\n{PASSAGE}"}]
SPEC = {"speculative_method": "ngram", "speculative_tokens": 5}

ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 200}),
    "completions": ("/v1/completions", {"prompt": USER[0]["content"], "max_tokens": 200}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 200}),
    "responses": ("/v1/responses", {"input": USER[0]["content"], "max_output_tokens": 200}),
}


def text_of(route: str, body: dict[str, Any]) -> str:
    if route == "chat":
        return str(body["choices"][0]["message"]["content"])
    if route == "completions":
        return str(body["choices"][0]["text"])
    if route == "messages":
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return "".join(
        part["text"]
        for item in body["output"]
        for part in item.get("content", [])
        if part["type"] == "output_text"
    )


def streamed_text(route: str, events: list[Any]) -> str:
    data = [e for e in events if isinstance(e, dict)]
    if route == "chat":
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in data if e.get("choices"))
    if route == "completions":
        return "".join(e["choices"][0]["text"] for e in data if e.get("choices"))
    if route == "messages":
        return "".join(e["delta"].get("text", "") for e in data if e.get("type") == "content_block_delta")
    return "".join(e["delta"] for e in data if e.get("type") == "response.output_text.delta")


async def answers(**config: Any) -> tuple[dict[str, str], dict[str, Any], str]:
    """Each route's text, non-streamed and streamed; the final stats and metrics."""
    out: dict[str, str] = {}
    async with fake_server(FakeRunner(text_script(ANSWER)), **config) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
            for route, (path, body) in ROUTES.items():
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                out[f"{route}"] = text_of(route, r.json())
                r = await client.post(path, json={**body, "stream": True})
                assert r.status_code == 200, r.text
                out[f"{route}-stream"] = streamed_text(route, parse_sse(r.text))
            stats = await wait_idle(client)
            metrics = (await client.get("/metrics")).text
    return out, stats, metrics


async def test_every_api_streamed_or_not_answers_the_same_with_speculation() -> None:
    without, _, _ = await answers()
    with_spec, stats, metrics = await answers(**SPEC)
    assert with_spec == without
    assert all(text == ANSWER for text in without.values()), without
    spec = stats["speculative"]
    assert spec["method"] == "ngram" and spec["max_tokens"] == 5
    assert spec["accepted_tokens"] > 8 * 10  # each of the 8 answers copied most of the passage
    assert 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] > 1
    counted = {
        line.split("{")[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("ft_spec_decode_") and not line.startswith("#")
    }
    assert counted["ft_spec_decode_accepted_tokens_total"] == spec["accepted_tokens"]
    assert counted["ft_spec_decode_draft_tokens_total"] == spec["draft_tokens"]
    assert counted["ft_spec_decode_acceptance_ratio"] == pytest.approx(spec["acceptance_rate"])


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_request_turns_speculation_off_with_speculative_false(route: str) -> None:
    async with fake_server(FakeRunner(text_script(ANSWER)), **SPEC) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
            path, body = ROUTES[route]
            for stream in (False, True):
                r = await client.post(path, json={**body, "speculative": False, "stream": stream})
                assert r.status_code == 200, r.text
                text = streamed_text(route, parse_sse(r.text)) if stream else text_of(route, r.json())
                assert text == ANSWER
            assert (await wait_idle(client))["speculative"]["draft_tokens"] == 0
            r = await client.post(path, json={**body, "speculative": True})
            assert r.status_code == 200 and text_of(route, r.json()) == ANSWER
            assert (await wait_idle(client))["speculative"]["accepted_tokens"] > 0


@pytest.mark.parametrize("value", ["no", 0, None, [True]])
async def test_speculative_must_be_a_boolean(value: object) -> None:
    async with fake_server(**SPEC) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
            for route in ROUTES:
                path, body = ROUTES[route]
                r = await client.post(path, json={**body, "speculative": value})
                assert r.status_code == 400, r.text
                assert "speculative" in r.text


async def draft_answers(model: str, **config: Any) -> tuple[dict[str, str], dict[str, Any], str]:
    """`answers` on a real tiny GGUF (greedy, the engine without its cost model)."""
    from ft.config import EngineConfig
    from ft.engine.loading import EngineHooks
    from tests.support.engine import no_step_costs
    from tests.support.server import running_server

    out: dict[str, str] = {}
    cfg = EngineConfig(model=model, compute_threads=1, num_pages=64, tokenizer_workers=1, **config)
    async with running_server(cfg, hooks=EngineHooks(step_costs=no_step_costs)) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            for route, (path, body) in ROUTES.items():
                greedy = {**body, "temperature": 0.0, "max_tokens": 24, "max_output_tokens": 24}
                if route == "responses":
                    del greedy["max_tokens"]
                else:
                    del greedy["max_output_tokens"]
                r = await client.post(path, json=greedy)
                assert r.status_code == 200, r.text
                out[route] = text_of(route, r.json())
                r = await client.post(path, json={**greedy, "stream": True})
                assert r.status_code == 200, r.text
                out[f"{route}-stream"] = streamed_text(route, parse_sse(r.text))
            stats = await wait_idle(client)
            metrics = (await client.get("/metrics")).text
    return out, stats, metrics


async def test_a_draft_model_answers_every_api_the_same_and_counts_its_drafts(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tests.support.gguf_files import write_tiny_gguf

    model = str(write_tiny_gguf(tmp_path_factory.mktemp("http") / "tiny.gguf", seed=3))
    without, _, _ = await draft_answers(model)
    with_spec, stats, metrics = await draft_answers(
        model, speculative_method="draft", speculative_model=model, speculative_tokens=4
    )
    assert with_spec == without
    spec = stats["speculative"]
    assert spec["method"] == "draft" and spec["draft_tokens"] > 8 * 4
    assert spec["accepted_tokens"] == spec["draft_tokens"]  # the model drafting for itself
    assert f'ft_spec_decode_accepted_tokens_total{{model="tiny"}} {float(spec["accepted_tokens"])}' in metrics


WORDS = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"enum": ["the", "hello", "the hello"]},
                             "minItems": 8, "maxItems": 10}},
    "required": ["words"], "additionalProperties": False,
}  # fmt: skip


async def schema_answers(model: str, **config: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """OpenAI chat under `response_format` `json_schema` on a real tiny GGUF, greedy: the text
    non-streamed and streamed; the final stats."""
    from ft.config import EngineConfig
    from ft.engine.loading import EngineHooks
    from tests.support.engine import no_step_costs
    from tests.support.server import running_server

    body = {
        "messages": [{"role": "user", "content": "the hello the hello"}],
        "temperature": 0.0,
        "max_tokens": 160,
        "response_format": {"type": "json_schema", "json_schema": {"name": "words", "schema": WORDS}},
    }
    out: dict[str, str] = {}
    cfg = EngineConfig(model=model, compute_threads=1, num_pages=64, tokenizer_workers=1, **config)
    async with running_server(cfg, hooks=EngineHooks(step_costs=no_step_costs)) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out["chat"] = text_of("chat", r.json())
            r = await client.post("/v1/chat/completions", json={**body, "stream": True})
            assert r.status_code == 200, r.text
            out["chat-stream"] = streamed_text("chat", parse_sse(r.text))
            stats = await wait_idle(client)
    return out, stats


async def test_a_json_schema_answer_drafts_and_is_the_same_streamed_or_not(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import json

    import jsonschema

    from tests.support.gguf_files import write_tiny_gguf

    model = str(write_tiny_gguf(tmp_path_factory.mktemp("schema") / "tiny.gguf", seed=3))
    without, _ = await schema_answers(model)
    with_spec, stats = await schema_answers(model, **SPEC)
    assert with_spec == without and without["chat"] == without["chat-stream"]
    jsonschema.validate(json.loads(without["chat"]), WORDS)
    assert stats["speculative"]["draft_tokens"] > 0 and stats["speculative"]["accepted_tokens"] > 0
