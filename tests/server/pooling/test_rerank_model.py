"""/v1/rerank and /v1/score on real rerankers over real HTTP: a Qwen3-Reranker-style GGUF (its
rerank template, its "yes"/"no" head softmaxed) and a Hugging Face
`Qwen3ForSequenceClassification` (no template: the query's tokens then the document's).

Each score is checked against transformers on the pair the reranker's format makes.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.engine.loading import EngineHooks
from ft.model import kernels
from ft.tokenizer.spec import byte_level_bpe_from_gguf
from tests.support.engine import fake_hooks
from tests.support.gguf_files import tiny_tokens
from tests.support.server import fake_server, running_server, wait_idle
from tests.support.tiny_rerank import (
    RERANK_TEMPLATE,
    causal_model,
    hf_scores,
    save_seq_cls_dir,
    seq_cls_model,
    write_rank_gguf,
)

transformers = pytest.importorskip("transformers")

QUERY = "the hello world"
DOCS = ["hello there", "the world", "Hello, hello!", "a b c", "world the hello"]
FLOAT_TOLERANCE = 1e-4
PACKED_TOLERANCE = 0.02


def tokens(text: str) -> list[int]:
    toks, merges, types = tiny_tokens()
    return byte_level_bpe_from_gguf(toks, merges, types, "qwen2").encode(text, add_special_tokens=False).ids


def template_ids(query: str, document: str) -> list[int]:
    return tokens(RERANK_TEMPLATE.replace("{query}", query).replace("{document}", document))


@pytest.fixture(scope="module")
def causal() -> Any:
    return causal_model()


@pytest.fixture(scope="module")
def rank_gguf(tmp_path_factory: pytest.TempPathFactory, causal: Any) -> pathlib.Path:
    return write_rank_gguf(tmp_path_factory.mktemp("rank") / "reranker.gguf", causal)


@asynccontextmanager
async def serve(path: pathlib.Path, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A real server on `path`, float32 unless `dtype` says (auto picks bfloat16 on some CPUs)."""
    options = {"dtype": "float32"} | options
    cfg = EngineConfig(model=str(path), num_pages=128, served_model_name="reranker", **options)
    async with running_server(cfg) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        yield c


@pytest.fixture
async def gguf_client(rank_gguf: pathlib.Path) -> AsyncIterator[httpx.AsyncClient]:
    async with serve(rank_gguf) as c:
        yield c


async def post(c: httpx.AsyncClient, path: str, **body: Any) -> dict[str, Any]:
    r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def test_rerank_scores_each_pair_with_the_template_and_head(
    gguf_client: httpx.AsyncClient, causal: Any
) -> None:
    pairs = [template_ids(QUERY, d) for d in DOCS]
    expected = hf_scores(causal, pairs)
    body = await post(gguf_client, "/v1/rerank", query=QUERY, documents=DOCS, model="reranker")
    assert body["scoring"] == "classifier" and body["model"] == "reranker"
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda k: -expected[k])
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=FLOAT_TOLERANCE)
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in pairs)
    await wait_idle(gguf_client)


async def test_rerank_top_n_return_documents_and_objects(gguf_client: httpx.AsyncClient) -> None:
    full = await post(gguf_client, "/v1/rerank", query=QUERY, documents=DOCS)
    cut = await post(gguf_client, "/rerank", query=QUERY, documents=[{"text": d} for d in DOCS], top_n=2,
                     return_documents=False)  # fmt: skip
    assert len(cut["results"]) == 2 and all("document" not in r for r in cut["results"])
    assert [r["index"] for r in cut["results"]] == [r["index"] for r in full["results"][:2]]
    for a, b in zip(cut["results"], full["results"], strict=False):
        assert a["relevance_score"] == pytest.approx(b["relevance_score"], abs=1e-9)


async def test_score_is_the_same_pair_scored(gguf_client: httpx.AsyncClient, causal: Any) -> None:
    one = await post(gguf_client, "/v1/score", text_1=QUERY, text_2=DOCS)
    pairwise = await post(gguf_client, "/v1/score", text_1=[QUERY, DOCS[0]], text_2=[DOCS[1], QUERY])
    assert one["scoring"] == "classifier"
    expected = hf_scores(causal, [template_ids(QUERY, d) for d in DOCS])
    assert [d["score"] for d in one["data"]] == pytest.approx(expected, abs=FLOAT_TOLERANCE)
    pair_expected = hf_scores(causal, [template_ids(QUERY, DOCS[1]), template_ids(DOCS[0], QUERY)])
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(pair_expected, abs=FLOAT_TOLERANCE)


async def test_embeddings_on_a_reranker_are_refused(gguf_client: httpx.AsyncClient) -> None:
    r = await gguf_client.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "reranker" in error["message"] and "--pooling last" in error["message"]
    assert error["param"] == "input" and error["type"] == "invalid_request_error"


async def test_a_pair_past_the_context_names_its_document(rank_gguf: pathlib.Path) -> None:
    async with serve(rank_gguf, max_model_len=64) as c:
        r = await c.post("/v1/rerank", json={"query": QUERY, "documents": ["ok", "x " * 80]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents[1]"
        cut = await post(c, "/v1/rerank", query=QUERY, documents=["ok", "x " * 80], truncate_prompt_tokens=64)
        assert len(cut["results"]) == 2
        await wait_idle(c)


async def test_many_pairs_through_few_slots_match_one_by_one(rank_gguf: pathlib.Path) -> None:
    """More pairs than running slots (and prefill chunks of 16): the same scores as alone."""
    docs = [f"{d} {k}" for k in range(6) for d in DOCS]
    async with serve(rank_gguf, max_running_requests=2, max_prefill_tokens=16) as c:
        many = (await post(c, "/v1/score", text_1=QUERY, text_2=docs))["data"]
        alone = [(await post(c, "/v1/score", text_1=QUERY, text_2=d))["data"][0]["score"] for d in docs[:4]]
        assert [d["score"] for d in many[:4]] == pytest.approx(alone, abs=1e-6)
        await wait_idle(c)


@pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")
async def test_a_quantized_reranker_runs_packed(tmp_path: pathlib.Path, causal: Any) -> None:
    path = write_rank_gguf(tmp_path / "q8.gguf", causal, quantized=True)
    expected = hf_scores(causal, [template_ids(QUERY, d) for d in DOCS])
    async with serve(path, dtype="auto") as c:  # a quantized GGUF runs as stored
        body = await post(c, "/v1/rerank", query=QUERY, documents=DOCS)
        stats = (await c.get("/v1/stats")).json()
        assert stats["kv"]["dtype"] == "float16"  # the packed path's KV (floats would be float32)
        model = (await c.get("/v1/models")).json()["data"][0]
        assert model["capabilities"]["rerank"] == "classifier" and not model["capabilities"]["embeddings"]
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=PACKED_TOLERANCE)


async def test_a_sequence_classifier_directory_scores_query_then_document(tmp_path: pathlib.Path) -> None:
    hf = seq_cls_model("qwen3", seed=3)
    directory = save_seq_cls_dir(tmp_path / "cls", hf)
    expected = hf_scores(hf, [tokens(QUERY) + tokens(d) for d in DOCS])
    async with serve(directory) as c:
        body = await post(c, "/v1/rerank", query=QUERY, documents=DOCS, top_n=3)
        assert body["scoring"] == "classifier"
        assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda k: -expected[k])[
            :3
        ]
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=FLOAT_TOLERANCE)
        await wait_idle(c)


async def test_a_model_without_a_head_reranks_by_cosine() -> None:
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        assert (await post(c, "/v1/rerank", query="a", documents=["b"]))["scoring"] == "cosine"
        assert (await post(c, "/v1/score", text_1="a", text_2="b"))["scoring"] == "cosine"


async def test_rank_pooling_on_a_model_without_a_head_fails_the_load() -> None:
    cfg = EngineConfig(num_pages=64, pooling="rank")
    async with running_server(cfg, hooks=fake_hooks(), wait_ready=False) as s:
        with trio.fail_after(30), pytest.raises(RuntimeError, match="--pooling rank needs a reranker"):
            await s.engine.wait_ready()


async def test_a_client_that_leaves_a_rerank_frees_its_pairs(rank_gguf: pathlib.Path) -> None:
    """Steps slowed to 50 ms (in the runner's thread): the client leaves mid-rerank, every pair's
    scope closes, its pages are freed and the engine is idle."""
    cfg = EngineConfig(model=str(rank_gguf), num_pages=128, dtype="float32", max_prefill_tokens=16)
    hooks = EngineHooks(before_step=lambda works: time.sleep(0.05))
    async with running_server(cfg, hooks=hooks) as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        finished: list[httpx.Response] = []

        async def rerank() -> None:
            body = {"query": QUERY, "documents": [d * 8 for d in DOCS] * 4}
            finished.append(await c.post("/v1/rerank", json=body))

        async with trio.open_nursery() as nursery:  # the client leaves once its pairs run
            nursery.start_soon(rerank)
            with trio.fail_after(30):
                while (await c.get("/v1/stats")).json()["requests"]["running"] == 0:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert not finished
        stats = await wait_idle(c)
        assert stats["requests"]["aborted"] >= 1
        after = await post(c, "/v1/rerank", query=QUERY, documents=DOCS)  # still serves
        assert len(after["results"]) == len(DOCS)


async def test_special_tokens_go_where_the_tokenizer_adds_them(tmp_path: pathlib.Path) -> None:
    """A tokenizer that adds BOS and EOS: `[BOS] query [EOS] document [EOS]` (llama-server's
    rule), the texts' own tokens without a BOS each."""
    hf = seq_cls_model("llama", seed=5)
    bos, eos = tiny_tokens()[0].index("<|im_start|>"), tiny_tokens()[0].index("<|im_end|>")
    directory = save_seq_cls_dir(tmp_path / "cls", hf, bos_token="<|im_start|>", add_bos_token=True,
                                 add_eos_token=True)  # fmt: skip
    pairs = [[bos, *tokens(QUERY), eos, *tokens(d), eos] for d in DOCS]
    expected = hf_scores(hf, pairs)
    async with serve(directory) as c:
        body = await post(c, "/v1/score", text_1=QUERY, text_2=DOCS)
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=FLOAT_TOLERANCE)
        assert body["usage"]["prompt_tokens"] == sum(len(p) for p in pairs)
