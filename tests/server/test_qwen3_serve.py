"""A tiny random Qwen3 served end to end: its GGUF (packed path), its safetensors (float32) and
a Qwen3-MoE's safetensors (float32) and GGUF (dequantized: the packed kernels run no experts).

The answer is the runner's own greedy continuation of the prompt Qwen3's template renders from
GGUF metadata, `enable_thinking` reaching the template through `chat_template_kwargs`. The
family's reasoning format (`think`) is the server's when none is configured.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
import torch

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner
from ft.engine.loading import ModelParts
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.params import SamplingParams
from ft.tokenizer.template import render_chat
from tests.support.engine import fake_hooks, fake_parts
from tests.support.scripts import text_script
from tests.support.server import TEST_SETTINGS, running_server
from tests.support.tiny_qwen3 import qwen3_model, qwen3_moe_model, save_qwen3_dir, write_qwen3_gguf

pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Hello there"}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return qwen3_model()


def expected_answer(model: pathlib.Path, *, quantized: bool, enable_thinking: bool) -> tuple[int, str]:
    """Prompt length and greedy text of `MAX_TOKENS` tokens, computed on the runner directly."""
    loaded = load_model(model, torch.float32, quantized=quantized)
    spec = loaded.tokenizer
    text = render_chat(spec.chat_template, MESSAGES, extra={"enable_thinking": enable_thinking})
    tok = spec.build()
    prompt = tuple(tok.encode(text, add_special_tokens=False).ids)
    runner = build_runner(loaded, num_pages=64, page_size=16, dtype=torch.float32)
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
    return len(prompt), tok.decode([t for t in out if t not in spec.eos_token_ids])


@pytest.mark.parametrize("source", ["gguf", "safetensors", "moe-safetensors", "moe-gguf"])
async def test_qwen3_answers_with_its_greedy_continuation(
    hf_model: Any, tmp_path: pathlib.Path, source: str
) -> None:
    weights = qwen3_moe_model() if source.startswith("moe") else hf_model
    if source.endswith("gguf"):
        model = write_qwen3_gguf(tmp_path / "tiny-qwen3.Q8_0.gguf", weights)
        # dtype auto runs Q8_0 as stored; a MoE loads as floats (float32 here: "auto" may pick bf16)
        config = EngineConfig(model=str(model), num_pages=64, dtype="auto" if source == "gguf" else "float32")
    else:
        model = save_qwen3_dir(tmp_path / "tiny-qwen3", weights)
        config = EngineConfig(model=str(model), dtype="float32", num_pages=64)
    quantized = source == "gguf"
    prompt_lengths = []
    async with (
        running_server(config) as s,  # no --reasoning-parser: the family's, think
        httpx.AsyncClient(base_url=s.base_url, timeout=60) as c,
    ):
        (listed,) = (await c.get("/v1/models")).json()["data"]
        assert listed["capabilities"]["reasoning"] is True
        for thinking in (False, True):
            r = await c.post(
                "/v1/chat/completions",
                json={
                    "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "chat_template_kwargs": {"enable_thinking": thinking},
                },
            )  # fmt: skip
            assert r.status_code == 200, r.text
            body = r.json()
            prompt_len, text = expected_answer(model, quantized=quantized, enable_thinking=thinking)
            assert body["usage"]["prompt_tokens"] == prompt_len
            prompt_lengths.append(prompt_len)
            message = body["choices"][0]["message"]
            if thinking:  # no `<think>` was written: a model that opens none answers as content
                assert (message.get("reasoning_content") or "") + (message["content"] or "") == text
            else:
                assert message["content"] == text and not message.get("reasoning_content")
    assert prompt_lengths[0] > prompt_lengths[1]  # enable_thinking false wrote an empty think block


def _parts_with_reasoning(runner: FakeRunner, parser: str | None) -> Callable[[EngineConfig], ModelParts]:
    """The fake model's parts, as a family whose reasoning format is `parser` loads them."""
    load = fake_parts(runner)
    return lambda config: replace(load(config), reasoning_parser=parser)


@pytest.mark.parametrize(
    ("family", "configured", "reasoning", "content"),
    [
        ("think", None, "Ponder.", "Done."),  # Qwen3 with no --reasoning-parser
        (None, None, None, "<think>Ponder.</think>Done."),  # a family without one: text left alone
        (None, "think", "Ponder.", "Done."),  # the operator's parser, whatever the family
    ],
)
async def test_the_model_familys_reasoning_format_is_the_default(
    family: str | None, configured: str | None, reasoning: str | None, content: str
) -> None:
    runner = FakeRunner(script=text_script("<think>Ponder.</think>Done."))
    hooks = fake_hooks(load_model=_parts_with_reasoning(runner, family))
    settings = replace(TEST_SETTINGS, reasoning_parser=configured)
    config = EngineConfig(num_pages=256, served_model_name="fake")
    async with (
        running_server(config, hooks=hooks, settings=settings) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        r = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 64})
        message = r.json()["choices"][0]["message"]
        assert (message["content"], message.get("reasoning_content")) == (content, reasoning)
        (listed,) = (await c.get("/v1/models")).json()["data"]
        assert listed["capabilities"]["reasoning"] is (reasoning is not None)
