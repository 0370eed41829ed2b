"""A tiny random Qwen3.5 and Qwen3.5-MoE served from safetensors over real HTTP, chatting
through Qwen3.5's published template (`tests/support/qwen_xml_template.py`).

With thinking on, the template's generation prompt leaves `<think>` open and the answer comes
back as reasoning; `chat_template_kwargs: {"enable_thinking": false}` reaches the template,
which closes an empty think block, and the answer is content. Each is transformers' greedy
continuation of the prompt the template rendered. (Greedy answers, snapshot hits, forks and
preemption over HTTP: `tests/server/test_hybrid_http.py`.)
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from ft.config import EngineConfig
from ft.tokenizer.template import render_chat
from tests.support.qwen_xml_template import QWEN35
from tests.support.server import running_server, wait_idle
from tests.support.tiny_families import save_dir
from tests.support.tiny_qwen35 import qwen35_model, transformers_text

pytest.importorskip("transformers")

MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "Hello there, tell me about the hello"}]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, pathlib.Path]:
    """transformers' model and its checkpoint directory (with Qwen3.5's published chat template)."""
    torch.set_num_threads(1)
    model = qwen35_model(request.param, seed=3)
    directory = save_dir(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}", model)
    tokenizer_config = directory / "tokenizer_config.json"
    tokenizer_config.write_text(
        json.dumps(json.loads(tokenizer_config.read_text()) | {"chat_template": QWEN35})
    )
    return model, directory


async def test_chat_template_kwargs_switch_qwen35s_thinking(served: tuple[Any, pathlib.Path]) -> None:
    hf_model, model_dir = served
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = EngineConfig(model=str(model_dir), dtype="float32", compute_threads=1, kv_cache_memory=4 << 20)
    async with (
        running_server(config) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as c,
    ):
        (listed,) = (await c.get("/v1/models")).json()["data"]
        assert listed["capabilities"]["reasoning"] is True  # the family's think format
        lengths = []
        for thinking in (True, False):
            body: dict[str, Any] = {
                "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": thinking},
            }  # fmt: skip
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            text = render_chat(QWEN35, MESSAGES, extra={"enable_thinking": thinking})
            assert text.endswith("<think>\n" if thinking else "<think>\n\n</think>\n\n")
            prompt = tok.encode(text, add_special_tokens=False).ids
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)
            lengths.append(len(prompt))
            message = r.json()["choices"][0]["message"]
            want = transformers_text(hf_model, model_dir, prompt, MAX_TOKENS)
            assert want and "</think>" not in want  # (a random model's bytes: the block never closes)
            if thinking:  # the parser's strip of the newlines just inside the block
                assert message["reasoning_content"] == want.strip("\n") and not message["content"]
            else:
                assert message["content"] == want and not message.get("reasoning_content")
        assert lengths[1] > lengths[0]  # the closed think block
        assert (await wait_idle(c))["recurrent_state"]["in_use"] == 0
