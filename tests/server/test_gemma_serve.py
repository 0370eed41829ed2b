"""A tiny random Gemma 3 served end to end from its Q8_0 GGUF (packed path, sliding windows):
the chat template from GGUF metadata folds the system prompt into the first user turn, the
answer is the runner's own greedy continuation (stopping at `<end_of_turn>`), and the same
request answers the same again (its prompt then partly from the prefix cache)."""

from __future__ import annotations

import pathlib

import httpx
import pytest
import torch

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.params import SamplingParams
from ft.tokenizer.template import render_chat
from tests.support.server import running_server
from tests.support.tiny_gemma import gemma3_model, write_gemma_gguf

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello the user"}]
MAX_TOKENS = 12  # past the window of 8 with the prompt


def expected_answer(model: pathlib.Path) -> tuple[int, list[int], str]:
    """Prompt length, greedy tokens and text, computed on the packed runner directly."""
    loaded = load_model(model, torch.float32, quantized=True)
    spec = loaded.tokenizer
    text = render_chat(spec.chat_template, MESSAGES, bos_token=spec.bos_token)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nHello the user<end_of_turn>\n")
    tok = spec.build()
    prompt = tuple(tok.encode(text, add_special_tokens=False).ids)
    runner = build_runner(loaded, num_pages=64, page_size=16, dtype=torch.float32, kv_dtype=torch.float16)
    greedy = SamplingParams(temperature=0.0)
    pages = tuple(range(4))
    logits = runner.forward([SeqWork(0, prompt, 0, pages, True, greedy, 0)])
    assert logits is not None
    out = [int(logits[0].argmax())]
    while len(out) < MAX_TOKENS and out[-1] not in spec.eos_token_ids:
        step = runner.step(
            [SeqWork(0, (out[-1],), len(prompt) + len(out) - 1, pages, True, greedy, len(out))]
        )
        out.append(step[0].token_id)
    kept = [t for t in out if t not in spec.eos_token_ids]
    return len(prompt), kept, tok.decode(kept)


async def test_gemma3_gguf_answers_with_its_greedy_continuation(tmp_path: pathlib.Path) -> None:
    model = write_gemma_gguf(tmp_path / "tiny-gemma3.Q8_0.gguf", gemma3_model(query_pre_attn_scalar=32))
    prompt_len, tokens, text = expected_answer(model)
    config = EngineConfig(model=str(model), num_pages=64, dtype="auto", kv_cache_dtype="float16")
    async with running_server(config) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        answers = []
        for _ in range(2):
            r = await c.post(
                "/v1/chat/completions",
                json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] == prompt_len
            assert body["usage"]["completion_tokens"] >= len(tokens)
            answers.append(body["choices"][0]["message"]["content"])
        assert answers == [text, text]
