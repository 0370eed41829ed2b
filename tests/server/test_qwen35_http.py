"""Tiny random Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet between gated attention layers) served
from safetensors over real HTTP.

Every answer is transformers' greedy continuation of the same token ids on the same weights: a
first request; a second that extends the first prompt, restoring the state snapshot taken at
the first prompt's last full page (`cached_tokens` > 0); requests preempted mid-sequence by a
small KV pool and recomputed; chats rendered by Qwen3.5's published template, thinking on (the
prompt leaves `<think>` open: the answer comes back as reasoning) and switched off through
`chat_template_kwargs` (the prompt ends in a closed, empty think block: the answer is content),
each answered as transformers continues that prompt. After each, no state slot is held but
snapshots'.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx
import pytest
import torch
import trio
from tokenizers import Tokenizer

from ft.config import EngineConfig
from ft.tokenizer.template import render_chat
from tests.support.qwen_xml_template import QWEN35
from tests.support.server import running_server, wait_idle
from tests.support.tiny_families import save_dir
from tests.support.tiny_qwen35 import qwen35_model, transformers_text

pytest.importorskip("transformers")

PROMPT = [(i * 7) % 250 + 3 for i in range(40)]  # its last full page before its last token ends at 32
SECOND_TURN = PROMPT + [(i * 11) % 240 + 5 for i in range(25)]
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


def config(model_dir: pathlib.Path, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", compute_threads=1, kv_cache_memory=4 << 20, state_snapshots=4
    )
    return EngineConfig(**(fields | overrides))


async def complete(c: httpx.AsyncClient, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0} | extra
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_greedy_answers_and_a_snapshot_restore_match_transformers(
    served: tuple[Any, pathlib.Path],
) -> None:
    hf_model, model_dir = served
    async with (
        running_server(config(model_dir)) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as c,
    ):
        first = await complete(c, PROMPT)
        assert first["choices"][0]["text"] == transformers_text(hf_model, model_dir, PROMPT, MAX_TOKENS)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        second = await complete(c, SECOND_TURN)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the snapshot's page
        assert second["choices"][0]["text"] == transformers_text(hf_model, model_dir, SECOND_TURN, MAX_TOKENS)

        state = (await wait_idle(c))["recurrent_state"]
        assert state["in_use"] == 0 and state["snapshot_hits"] >= 1
        assert state["slot_bytes"] == 3 * 4 * (3 * 192 + 4 * 16 * 32)  # 3 DeltaNet layers, float32


async def test_requests_preempted_mid_sequence_still_answer_as_transformers(
    served: tuple[Any, pathlib.Path],
) -> None:
    """Four requests whose pages do not fit together (20 pages of 4 tokens, each needs 13): the
    newest are preempted while decoding, recomputed, and answer as transformers does."""
    hf_model, model_dir = served
    prompts = [[(i * (k + 3)) % 240 + 4 for i in range(28 + k)] for k in range(4)]
    cfg = config(model_dir, page_size=4, num_pages=20, max_running_requests=4)
    async with (
        running_server(cfg) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as c,
    ):
        answers: dict[int, str] = {}

        async def one(k: int) -> None:
            body = await complete(c, prompts[k], max_tokens=24)
            answers[k] = body["choices"][0]["text"]

        async with trio.open_nursery() as nursery:
            for k in range(4):
                nursery.start_soon(one, k)
        stats = await wait_idle(c)
        assert stats["scheduler"]["preemptions"] > 0
        assert stats["recurrent_state"]["in_use"] == 0
    for k, prompt in enumerate(prompts):
        assert answers[k] == transformers_text(hf_model, model_dir, prompt, 24), k


async def test_chat_template_kwargs_reach_qwen35s_template(served: tuple[Any, pathlib.Path]) -> None:
    hf_model, model_dir = served
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    async with (
        running_server(config(model_dir)) as s,
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
            assert "</think>" not in want  # (a random model's bytes: the block never closes)
            if thinking:  # the parser's strip of the newlines just inside the block
                assert message["reasoning_content"] == want.strip("\n") and not message["content"]
            else:
                assert message["content"] == want and not message.get("reasoning_content")
        assert lengths[1] > lengths[0]  # the closed think block
        assert (await wait_idle(c))["recurrent_state"]["in_use"] == 0
