"""A tiny random SmolLM3 served end to end from its GGUF (packed path): the answer is the
runner's own greedy continuation of the prompt SmolLM3's template renders, `enable_thinking`
reaching the template through `chat_template_kwargs`, and the family's `think` reasoning format
the server's when none is configured."""

from __future__ import annotations

import pathlib
from typing import Any

import httpx
import pytest
import torch

from ft.config import EngineConfig
from ft.model import kernels
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.tokenizer.template import render_chat
from tests.support.server import running_server
from tests.support.tiny_families import smollm3_model, write_gguf
from tests.support.tiny_qwen3 import generate

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")

MESSAGES = [{"role": "user", "content": "Hello there"}]
MAX_TOKENS = 6


def expected(model: pathlib.Path, enable_thinking: bool) -> tuple[int, str]:
    """Prompt length and greedy text, computed on a packed runner directly."""
    loaded = load_model(model, torch.float32, quantized=True)
    spec = loaded.tokenizer
    text = render_chat(spec.chat_template, MESSAGES, extra={"enable_thinking": enable_thinking})
    tok = spec.build()
    prompt = tuple(tok.encode(text, add_special_tokens=False).ids)
    # 16 pages of 32 slots: SmolLM3's system block is long in byte tokens
    runner = build_runner(loaded, num_pages=32, page_size=32, dtype=torch.float32, kv_dtype=torch.float16)
    tokens, _ = generate(runner, prompt, MAX_TOKENS)
    if any(t in spec.eos_token_ids for t in tokens):
        tokens = tokens[: min(tokens.index(t) for t in spec.eos_token_ids if t in tokens)]
    return len(prompt), tok.decode(tokens)


async def test_smollm3_answers_with_its_greedy_continuation(tmp_path: pathlib.Path) -> None:
    model = write_gguf(tmp_path / "tiny-smollm3.Q8_0.gguf", smollm3_model(), template="smollm3")
    config = EngineConfig(model=str(model), num_pages=64)
    lengths = []
    async with running_server(config) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        (listed,) = (await c.get("/v1/models")).json()["data"]
        assert listed["capabilities"]["reasoning"] is True  # the family's think
        for thinking in (False, True):
            body: dict[str, Any] = {
                "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": thinking},
            }  # fmt: skip
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            prompt_len, text = expected(model, thinking)
            assert r.json()["usage"]["prompt_tokens"] == prompt_len
            lengths.append(prompt_len)
            message = r.json()["choices"][0]["message"]
            assert (message.get("reasoning_content") or "") + (message["content"] or "") == text
    assert lengths[0] > lengths[1]  # enable_thinking false wrote an empty think block
