"""Tiny random hybrids served over real HTTP: LFM2 (short convolutions between attention
layers), Granite 4.0-H (Mamba-2 layers between attention layers, experts beside a shared MLP),
Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers between gated attention layers; experts beside a
shared expert).

Every answer is compared with transformers' greedy continuation of the same token ids on the
same weights: a first request; a second turn that extends the first prompt, which restores the
state snapshot taken at the first prompt's last full page (`cached_tokens` > 0) and still
answers as transformers does; `n` = 2 choices (the second forks from the first's state);
requests preempted mid-sequence by a small KV pool and recomputed. After everything no state
slot is held but snapshots', and `/metrics` shows the `ft_state_*` series.
"""

from __future__ import annotations

import pathlib
from typing import Any

import httpx
import pytest
import torch
import trio
from tokenizers import Tokenizer

from ft.actors.detokenizer import CONTEXT_TOKENS
from ft.config import EngineConfig
from ft.core.detok import SeqDetokenizer
from ft.engine.engine import open_engine
from ft.engine.lifetime import EngineState
from tests.support.server import running_server, wait_idle
from tests.support.tiny_families import EOS, save_dir
from tests.support.tiny_granite_hybrid import granite_hybrid_model, save_granite_hybrid_dir
from tests.support.tiny_lfm2 import lfm2_model, save_lfm2_dir
from tests.support.tiny_qwen35 import qwen35_model

pytest.importorskip("transformers")

PROMPT = [(i * 7) % 250 + 3 for i in range(40)]  # its last full page before its last token ends at 32
SECOND_TURN = PROMPT + [(i * 11) % 240 + 5 for i in range(25)]
MAX_TOKENS = 12
# one sequence's recurrent state: LFM2's 2 conv layers of 64 channels x 2 inputs; Granite's 2
# Mamba-2 layers of a conv state (3 x 192) and an SSM state (8 heads x 16 x 16); Qwen3.5's 3
# DeltaNet layers of a conv state (3 x 192) and 4 value heads' 16 x 32 matrices; float32
QWEN35_SLOT = 3 * (3 * 192 + 4 * 16 * 32) * 4
SLOT_BYTES = {
    "tiny-lfm2": 2 * 64 * 2 * 4,
    "tiny-granite-hybrid": 2 * (3 * 192 + 8 * 16 * 16) * 4,
    "tiny-qwen3_5": QWEN35_SLOT,
    "tiny-qwen3_5_moe": QWEN35_SLOT,
}


@pytest.fixture(scope="module", params=sorted(SLOT_BYTES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def hf_model(family: str) -> Any:
    torch.set_num_threads(1)
    if family.startswith("tiny-qwen3_5"):
        return qwen35_model(family.removeprefix("tiny-"), seed=3)
    return lfm2_model(seed=3) if family == "tiny-lfm2" else granite_hybrid_model("moe", seed=3)


@pytest.fixture(scope="module")
def model_dir(hf_model: Any, family: str, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    save = save_lfm2_dir if family == "tiny-lfm2" else save_granite_hybrid_dir
    if family.startswith("tiny-qwen3_5"):
        save = save_dir
    return save(tmp_path_factory.mktemp("hybrid-http") / family, hf_model)


def expected_text(hf_model: Any, model_dir: pathlib.Path, prompt: list[int], n: int = MAX_TOKENS) -> str:
    """transformers' greedy continuation of `prompt` (up to its EOS, hidden), as the server's
    detokenizer writes those tokens (a byte completing the prompt's last character is the
    prompt's: decoded after the prompt's tail)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    out = ids[len(prompt) :]
    detok = SeqDetokenizer(lambda t: str(tok.decode(list(t))), (), prompt[-CONTEXT_TOKENS:])
    pieces = [detok.add(t, is_last=i == len(out) - 1, is_hidden=t == eos)[0] for i, t in enumerate(out)]
    return "".join(pieces)


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


async def test_greedy_answers_prefix_hits_and_forks_match_transformers(
    hf_model: Any, model_dir: pathlib.Path, family: str
) -> None:
    async with (
        running_server(config(model_dir)) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as c,
    ):
        first = await complete(c, PROMPT)
        assert first["choices"][0]["text"] == expected_text(hf_model, model_dir, PROMPT)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        second = await complete(c, SECOND_TURN)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the snapshot's page
        assert second["choices"][0]["text"] == expected_text(hf_model, model_dir, SECOND_TURN)

        forked = await complete(c, SECOND_TURN[:55], n=2)
        want = expected_text(hf_model, model_dir, SECOND_TURN[:55])
        assert [choice["text"] for choice in forked["choices"]] == [want, want]

        stats = await wait_idle(c)
        state = stats["recurrent_state"]
        assert state["slots"] == 32 + 4 and state["in_use"] == 0
        slot_bytes = SLOT_BYTES[family]
        assert state["snapshot_hits"] >= 1 and state["snapshots"] >= 1 and state["slot_bytes"] == slot_bytes
        # the slots came out of the budget before the pages did
        assert stats["kv"]["total_pages"] == ((4 << 20) - 36 * slot_bytes) // s.engine.kv_page_bytes
        metrics = (await c.get("/metrics")).text
        assert f'ft_state_slots_in_use{{model="{family}"}} 0.0' in metrics
        assert "ft_state_snapshot_hits_total" in metrics


async def test_requests_preempted_mid_sequence_still_answer_as_transformers(
    hf_model: Any, model_dir: pathlib.Path
) -> None:
    """Four requests whose pages do not fit together (20 pages of 4 tokens, each needs 13): the
    newest are preempted while decoding, recomputed, and answer as transformers does."""
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
        assert answers[k] == expected_text(hf_model, model_dir, prompt, 24), k


@pytest.mark.parametrize(
    ("options", "match"),
    [
        # 2032 slots (1 KiB, 20.5 KiB or 30.75 KiB) do not fit 1 MiB
        (
            {"kv_cache_memory": 1 << 20, "state_snapshots": 2000},
            "cannot hold the recurrent state: 2032 slots",
        ),
        (
            {"speculative_method": "ngram"},
            "speculative decoding is not supported for models with recurrent layers",
        ),
    ],
)
async def test_a_start_a_hybrid_cannot_make_fails_naming_why(
    model_dir: pathlib.Path, options: dict[str, Any], match: str
) -> None:
    with trio.fail_after(120):
        async with open_engine(config(model_dir, **options), wait_ready=False) as engine:
            with pytest.raises(RuntimeError, match=match):
                await engine.wait_ready()
            assert engine.state == EngineState.ERROR
