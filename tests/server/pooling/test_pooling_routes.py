"""/v1/embeddings, /v1/rerank and /v1/score on the fake model (real HTTP, exact arithmetic).

The fake model's hidden state of a token is `fake_hidden(token, position)`, so every pooled
vector is computed here by hand and compared.
"""

from __future__ import annotations

import base64
import math
import struct
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio

from ft.engine.fake import FAKE_HIDDEN, FakeRunner, byte_token, fake_hidden
from ft.server import RunningServer
from ft.server.pooling.schemas import MAX_INPUTS
from tests.support.server import fake_server, wait_idle

TEXTS = ["hello", "the world!", "naïve café", "a", "pooling goes through the scheduler"]


def unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


def pooled_by_hand(text: str, pooling: str = "last") -> list[float]:
    rows = [fake_hidden(byte_token(b), p) for p, b in enumerate(text.encode())]
    if pooling == "mean":
        return unit([sum(col) / len(rows) for col in zip(*rows, strict=True)])
    return unit(list(rows[0] if pooling == "cls" else rows[-1]))


async def embed(c: httpx.AsyncClient, **body: Any) -> list[list[float]]:
    r = await c.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


async def test_embeddings_have_openai_shape_and_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"input": "hello", "model": "fake", "user": "u1"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["model"] == "fake"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 5
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    assert len(item["embedding"]) == FAKE_HIDDEN
    assert math.isclose(sum(x * x for x in item["embedding"]), 1.0)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
async def test_each_pooling_gives_the_hand_computed_vector(pooling: str) -> None:
    """`--pooling` (the engine config) chooses the pooling; the fake model has no metadata, so
    auto is last."""
    options = {} if pooling == "last" else {"pooling": pooling}
    async with fake_server(**options) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        vectors = await embed(c, input=TEXTS)
    for text, v in zip(TEXTS, vectors, strict=True):
        assert v == pytest.approx(pooled_by_hand(text, pooling), abs=1e-12)


async def test_a_batch_equals_each_input_alone(client: httpx.AsyncClient) -> None:
    """Each input is its own engine request: batched, it gives what it gives alone, in order."""
    batch = await embed(client, input=TEXTS * 3)
    alone = [(await embed(client, input=t))[0] for t in TEXTS]
    assert batch == alone * 3


async def test_token_id_inputs_equal_their_text(client: httpx.AsyncClient) -> None:
    ids = [byte_token(b) for b in b"hello"]
    assert await embed(client, input=ids) == await embed(client, input="hello")
    assert await embed(client, input=[ids, ids[:2]]) == await embed(client, input=["hello", "he"])


async def test_base64_decodes_to_the_float_list(client: httpx.AsyncClient) -> None:
    floats = await embed(client, input=TEXTS)
    r = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
    for item, v in zip(r.json()["data"], floats, strict=True):
        raw = base64.b64decode(item["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(v, rel=1e-6)


async def test_dimensions_cut_and_renormalize(client: httpx.AsyncClient) -> None:
    (full,) = await embed(client, input="the world!")
    (cut,) = await embed(client, input="the world!", dimensions=3)
    assert cut == pytest.approx(unit(full[:3]))
    assert await embed(client, input="the world!", dimensions=FAKE_HIDDEN) == [full]


async def test_dimensions_past_the_hidden_size_is_a_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"input": "x", "dimensions": FAKE_HIDDEN + 1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "dimensions" and str(FAKE_HIDDEN) in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1], []]}, "input"),
        ({"input": 5}, "input"),
        ({"input": True}, "input"),
        ({"input": None}, "input"),
        ({"input": [1, "a"]}, "input[0]"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": [-1]}, "input[0]"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": [[5], [999999]]}, "input[1]"),
        ({"input": [999999]}, "input"),
    ],
)
async def test_malformed_inputs_are_400s(client: httpx.AsyncClient, body: dict[str, Any], param: str) -> None:
    r = await client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_too_many_inputs_is_a_400_before_any_work(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"input": ["a"] * (MAX_INPUTS + 1)})
    assert r.status_code == 400 and str(MAX_INPUTS) in r.json()["error"]["message"]
    stats = (await client.get("/v1/stats")).json()["requests"]
    assert stats["completed"] == 0 and stats["prompt_tokens_total"] == 0


async def test_an_input_past_the_context_is_a_400_naming_the_limit() -> None:
    async with fake_server(context_length=64) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await c.post("/v1/embeddings", json={"input": ["ok", "x" * 65]})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "input[1]"
        assert "65 tokens" in error["message"] and "64 tokens" in error["message"]
        assert len(await embed(c, input="x" * 64)) == 1  # the whole context is the input's


async def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    async with fake_server(context_length=64) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await c.post("/v1/embeddings", json={"input": "y" * 100, "truncate_prompt_tokens": 10})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
        r = await c.post("/v1/embeddings", json={"input": "y" * 100, "truncate_prompt_tokens": -1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
        r = await c.post("/v1/embeddings", json={"input": "y", "truncate_prompt_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


async def test_more_inputs_than_the_queue_holds_are_pooled_in_windows() -> None:
    """A batch larger than running + queued capacity is served, a window at a time."""
    async with (
        fake_server(max_running_requests=2, max_queued_requests=1) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=30) as c,
    ):
        texts = [f"input {i}" for i in range(20)]
        assert await embed(c, input=texts) == [pooled_by_hand(t) for t in texts]
        assert (await wait_idle(c))["requests"]["completed"] == 20


async def test_a_client_that_leaves_frees_its_scopes() -> None:
    async with (
        fake_server(FakeRunner(step_s=0.2), max_prefill_tokens=16) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        async with trio.open_nursery() as nursery:  # the client leaves once its request is in
            nursery.start_soon(partial(c.post, "/v1/embeddings", json={"input": ["z" * 200] * 8}))
            with trio.fail_after(30):
                while (await c.get("/v1/stats")).json()["requests"]["active"] == 0:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        stats = await wait_idle(c)
        assert stats["requests"]["aborted"] >= 1 and stats["requests"]["completed"] == 0


async def test_rerank_scores_are_the_cosines_of_the_embeddings(client: httpx.AsyncClient) -> None:
    """Rerank's math, not a ranking a random model cannot make: each score is the cosine of the
    query's and the document's vectors from /v1/embeddings, sorted highest first."""
    query, docs = TEXTS[0], TEXTS[1:]
    vectors = await embed(client, input=[query, *docs])
    cosines = [sum(a * b for a, b in zip(vectors[0], v, strict=True)) for v in vectors[1:]]
    body = {"query": query, "documents": [docs[0], {"text": docs[1]}, *docs[2:]], "model": "fake"}
    r = await client.post("/v1/rerank", json=body)
    assert r.status_code == 200
    out = r.json()
    results = out["results"]
    assert sorted(x["index"] for x in results) == list(range(len(docs)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert scores == pytest.approx(sorted(cosines, reverse=True), abs=1e-12)
    for x in results:
        assert x["relevance_score"] == pytest.approx(cosines[x["index"]], abs=1e-12)
        assert x["document"] == {"text": docs[x["index"]]}
    assert out["usage"]["prompt_tokens"] == sum(len(t.encode()) for t in TEXTS)


async def test_rerank_top_n_and_return_documents(client: httpx.AsyncClient) -> None:
    body = {"query": "q?", "documents": TEXTS, "top_n": 2, "return_documents": False}
    whole = (await client.post("/v1/rerank", json=body | {"top_n": None})).json()["results"]
    top = (await client.post("/v1/rerank", json=body)).json()["results"]
    assert top == whole[:2] and all("document" not in x for x in top)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": [""]}, "documents"),
        ({"query": "q", "documents": [{"txt": "a"}]}, "documents[0].text"),
        ({"query": "q", "documents": "a"}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": 1, "documents": ["a"]}, "query"),
    ],
)
async def test_malformed_rerank_is_a_400(client: httpx.AsyncClient, body: dict[str, Any], param: str) -> None:
    r = await client.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_score_one_to_many_and_pairwise(client: httpx.AsyncClient) -> None:
    vectors = await embed(client, input=TEXTS)

    def cos(i: int, j: int) -> float:
        return sum(a * b for a, b in zip(vectors[i], vectors[j], strict=True))

    r = await client.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert r.status_code == 200 and r.json()["object"] == "list"
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3] and all(d["object"] == "score" for d in data)
    assert [d["score"] for d in data] == pytest.approx([cos(0, j) for j in range(1, 5)], abs=1e-12)
    r = await client.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[3:]})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx([cos(0, 3), cos(1, 4)], abs=1e-12)
    r = await client.post("/v1/score", json={"text_1": "same", "text_2": "same"})
    assert r.json()["data"][0]["score"] == pytest.approx(1.0)


async def test_score_with_mismatched_lists_is_a_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"


async def test_openai_sdk_embeddings_create(server: RunningServer, client: httpx.AsyncClient) -> None:
    """The OpenAI SDK (which asks for base64 by default and decodes it) gets our vectors."""
    floats = await embed(client, input=TEXTS[:2])
    sdk = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    async with sdk:
        out = await sdk.embeddings.create(model="fake", input=TEXTS[:2])
        as_floats = await sdk.embeddings.create(model="fake", input=TEXTS[:2], encoding_format="float")
        with pytest.raises(openai.BadRequestError):
            await sdk.embeddings.create(model="fake", input="")
    assert [d.embedding for d in out.data] == [pytest.approx(v, rel=1e-6) for v in floats]
    assert [d.embedding for d in as_floats.data] == floats
    assert out.usage.prompt_tokens == len(TEXTS[0]) + len(TEXTS[1])


async def test_an_input_whose_step_fails_fails_the_request_and_frees_the_rest() -> None:
    """The runner fails one input (alone, after the batch is bisected): the request is a 500
    and every other input's scope closes."""
    bad = byte_token(ord("!"))

    def fail_bad_rows(works: list[Any]) -> None:
        if any(bad in w.token_ids for w in works):
            raise RuntimeError("a fault in the model step")

    async with (
        fake_server(FakeRunner(step_s=0.05), before_step=fail_bad_rows) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        r = await c.post("/v1/embeddings", json={"input": ["fine " * 20, "broken!", "fine too " * 20]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        stats = await wait_idle(c)
        assert stats["requests"]["failed"] == 1
        assert len(await embed(c, input="fine")) == 1  # the engine serves on


async def test_a_full_queue_refuses_an_embedding_with_503() -> None:
    async with (
        fake_server(FakeRunner(step_s=0.05), max_running_requests=1, max_queued_requests=0) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(partial(c.post, "/v1/completions", json={"prompt": "hi", "max_tokens": 50}))
        with trio.fail_after(30):
            while (await c.get("/v1/stats")).json()["requests"]["active"] == 0:
                await trio.sleep(0.01)
        r = await c.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 503 and "Retry-After" in r.headers
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
async def test_rerank_answers_on_vllm_and_cohere_paths(client: httpx.AsyncClient, path: str) -> None:
    body = {"query": "q?", "documents": TEXTS}
    expected = (await client.post("/v1/rerank", json=body)).json()["results"]
    r = await client.post(path, json=body)
    assert r.status_code == 200 and r.json()["results"] == expected


POOLING_BODIES = [
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/rerank", {"query": "hi", "documents": ["a"]}),
    ("/v1/score", {"text_1": "hi", "text_2": "a"}),
]


@pytest.mark.parametrize(("path", "body"), POOLING_BODIES)
async def test_pooling_routes_take_json_only(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    """A cross-site "simple request" (no JSON content type) never reaches the engine."""
    import json

    r = await client.post(path, content=json.dumps(body), headers={"content-type": "text/plain"})
    assert r.status_code == 415


@pytest.mark.parametrize(("path", "body"), POOLING_BODIES)
async def test_pooling_routes_need_the_api_key(path: str, body: dict[str, Any]) -> None:
    async with fake_server(api_key="sesame") as s, httpx.AsyncClient(base_url=s.base_url) as c:
        assert (await c.post(path, json=body)).status_code == 401
        r = await c.post(path, json=body, headers={"authorization": "Bearer sesame"})
        assert r.status_code == 200


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
async def test_a_repeated_input_uses_the_prefix_cache_only_under_last_pooling(pooling: str) -> None:
    """The second embedding of a 100-token text reuses its cached pages under last pooling
    (usage says how many) and recomputes them under mean and cls; the vector is the same."""
    async with fake_server(pooling=pooling) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        text = "cache me " * 11 + "!"
        first = await c.post("/v1/embeddings", json={"input": text})
        second = await c.post("/v1/embeddings", json={"input": text})
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (96 if pooling == "last" else 0)  # the full 16-token pages before the last
        assert second.json()["data"] == first.json()["data"]
        assert first.json()["data"][0]["embedding"] == pytest.approx(pooled_by_hand(text, pooling), abs=1e-12)
