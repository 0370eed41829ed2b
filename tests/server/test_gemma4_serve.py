"""A tiny random Gemma 4 (per-layer embeddings, global layers with keys as values, KV-sharing
layers) served end to end from safetensors: greedy `/v1/completions` gives transformers' greedy
tokens, and the same request again answers the same with its prompt's full pages from the
prefix cache."""

from __future__ import annotations

import pathlib

import httpx
import torch

from ft.config import EngineConfig
from tests.support.server import running_server
from tests.support.tiny_gemma4 import gemma4_model, save_gemma4_dir

PROMPT = [(11 + 29 * i) % 320 + 3 for i in range(45)]  # past the window of 8, and two pages of 16
MAX_TOKENS = 10


async def test_gemma4_completions_are_transformers_greedy_tokens(tmp_path: pathlib.Path) -> None:
    model = gemma4_model(
        seed=3, hidden_size_per_layer_input=8, attention_k_eq_v=True, num_global_key_value_heads=1,
        num_kv_shared_layers=2,
    )  # fmt: skip
    directory = save_gemma4_dir(tmp_path / "tiny-gemma4", model)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(directory / "tokenizer.json")).decode(out[0, len(PROMPT) :].tolist())
    config = EngineConfig(model=str(directory), num_pages=64, dtype="float32", compute_threads=1)
    async with running_server(config) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        cached = []
        for _ in range(2):
            body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["usage"]["prompt_tokens"] == len(PROMPT)
            assert reply["usage"]["completion_tokens"] == MAX_TOKENS
            assert reply["choices"][0]["text"] == expected
            cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 32]  # the prompt's two full pages of 16
