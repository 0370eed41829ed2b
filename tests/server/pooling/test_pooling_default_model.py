"""Embeddings, rerank and score over real HTTP on the real default model (SmolLM2-135M, packed)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from ft.config import EngineConfig
from ft.model.loader import load_model
from ft.model.pull import cached_model_path
from ft.model.runners import build_runner
from tests.model.test_pooling_agreement import ft_pooled
from tests.support.server import running_server, wait_idle

pytestmark = pytest.mark.slow  # the real default model

# Over 16 tokens (one KV page) so that a second request can start from the prefix cache.
TEXTS = [
    "The capital of France is Paris, a city on the Seine with a long history of art.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_server_embeddings_are_the_engines_pooled_vectors(pooling: str) -> None:
    """The SDK's vectors are the runner's pooled vectors normalized; a repeat is served from the
    prefix cache under last pooling (not under mean: cached pages have no hidden states) and
    gives the same vector; rerank is the cosine of the vectors."""
    loaded = load_model(cached_model_path(), torch.float32, quantized=True)
    prompts = [loaded.tokenizer.build().encode(t).ids for t in TEXTS]
    # The server's KV cache is float16 on the packed path (`--kv-cache-dtype auto`).
    runner = build_runner(loaded, num_pages=64, page_size=16, dtype=torch.float32, kv_dtype=torch.float16)
    expected = ft_pooled(runner, prompts, pooling)
    async with (
        running_server(EngineConfig(pooling=pooling)) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as c,
    ):
        sdk = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
        async with sdk:
            first = await sdk.embeddings.create(model="any", input=TEXTS)
            again = await sdk.embeddings.create(model="any", input=TEXTS[0])
        vectors = [d.embedding for d in first.data]
        assert len(vectors[0]) == 576 and first.usage.prompt_tokens == sum(len(p) for p in prompts)
        for v, e in zip(vectors, expected, strict=True):
            assert v == pytest.approx(e.tolist(), abs=1e-6)
        assert again.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)
        r = await c.post("/v1/embeddings", json={"input": TEXTS[0]})
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > 0) if pooling == "last" else (cached == 0)
        rerank = (await c.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:]})).json()
        assert rerank["results"][0]["relevance_score"] == pytest.approx(
            cosine(vectors[0], vectors[1]), abs=1e-6
        )
        await wait_idle(c)
