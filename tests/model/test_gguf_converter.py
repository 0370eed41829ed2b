"""GGUFs written by llama.cpp's own converter, served, against transformers in float32.

Tiny random checkpoints (hidden 64; 2 layers, SmolLM3 4 so that one has no rotary) are built by
transformers, converted by the real `convert_hf_to_gguf.py --outtype f32`
(`tests.support.llama_converter`: fetched once into its cache, else the tests skip saying how
to get it) and loaded as `ft serve --dtype float32` loads them (`load_torch_model`); every
step's log-probabilities on transformers' greedy path match within `TOLERANCE`, and the top 5
that `/v1/completions` returns over real HTTP do too.

A setting the converter does not write runs as llama.cpp runs it, and the load warns: a
Qwen3-MoE checkpoint with `norm_topk_prob` false converts to the one with it true (llama.cpp
always renormalizes), an OLMoE with it true to the one with it false (llama.cpp never does), a
SmolLM3 with `no_rope_layer_interval` 2 to the one with 4 (llama.cpp hard-codes it) and a
Mistral with a `sliding_window` to the one without.
"""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch

from ft.config import EngineConfig
from ft.engine.loading import load_torch_model
from ft.model.torch_runner import TorchRunner
from tests.support.gguf_files import tiny_tokens
from tests.support.llama_converter import HOW_TO_GET, Conversion, convert, find_converter
from tests.support.server import running_server
from tests.support.tiny_families import EOS, forced_logits, save_dir

transformers = pytest.importorskip("transformers")

PROMPT = (5, 70, 100, 33, 200, 17, 90, 140, 61, 12)
STEPS = 12
TOLERANCE = 2e-3  # nats; float32 on both sides agrees to about 1e-6
WINDOW = 8  # under the prompt and its continuation


@dataclass(frozen=True)
class Case:
    """A checkpoint to convert: its `model_type`, config fields, the pre-tokenizer its GGUF
    names, and the fields of the checkpoint llama.cpp runs its GGUF as (None: the same)."""

    model_type: str
    fields: dict[str, Any]
    pre: str
    runs_as: dict[str, Any] | None = None


CASES = {
    "llama": Case("llama", {}, "llama-bpe"),
    "qwen3": Case("qwen3", {}, "qwen2"),
    "qwen3_moe": Case("qwen3_moe", {"norm_topk_prob": True}, "qwen2"),
    "smollm3": Case("smollm3", {"num_hidden_layers": 4, "tie_word_embeddings": True}, "smollm"),
    # (OLMoE's converter writes an epsilon of 1e-5 whatever the checkpoint's: OLMoE's own)
    "olmoe": Case("olmoe", {"rms_norm_eps": 1e-5}, "olmo"),
    "qwen3_moe_unnormalized": Case(
        "qwen3_moe", {"norm_topk_prob": False}, "qwen2", runs_as={"norm_topk_prob": True}
    ),
    "olmoe_normalized": Case(
        "olmoe", {"rms_norm_eps": 1e-5, "norm_topk_prob": True}, "olmo", runs_as={"norm_topk_prob": False}
    ),
    "smollm3_interval_2": Case(
        "smollm3", {"no_rope_layer_interval": 2}, "smollm", runs_as={"no_rope_layer_interval": 4}
    ),
    "mistral_windowed": Case(
        "mistral", {"sliding_window": WINDOW}, "llama-bpe", runs_as={"sliding_window": None}
    ),
}  # fmt: skip
MATCHING = ("llama", "qwen3", "qwen3_moe", "smollm3", "olmoe")
LOSSY = {"qwen3_moe_unnormalized": "norm_topk_prob", "olmoe_normalized": "norm_topk_prob",
         "smollm3_interval_2": "no_rope_layers",
         "mistral_windowed": "sliding_window"}  # fmt: skip


def build(case: Case, overrides: dict[str, Any] | None = None) -> Any:
    """The random float32 checkpoint of `case` (the same weights for any `overrides`)."""
    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=tokens.index(EOS), pad_token_id=0,
        bos_token_id=None, attn_implementation="eager",
    )  # fmt: skip
    if case.model_type == "qwen3_moe":
        fields |= dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if case.model_type == "olmoe":
        fields |= dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)
    fields |= case.fields | (overrides or {})
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(case.model_type, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # weights of 0.08 and norms around 1: logprobs that move with every layer
        for name, p in model.named_parameters():
            p.copy_(
                1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p)
            )
    return model.eval()


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Each case's GGUF, written by llama.cpp's converter (all in one process)."""
    converter = find_converter()
    if converter is None:
        pytest.skip(HOW_TO_GET)
    root = tmp_path_factory.mktemp("converted")
    jobs = []
    for name, case in CASES.items():
        # the directory names the model: a "llama" GGUF named Mistral is Mistral
        checkpoint = save_dir(root / f"tiny-{name.replace('_', '-')}", build(case))
        tokenizer_config = (
            checkpoint / "tokenizer_config.json"
        )  # (not the family's class: OLMoE's adds tokens)
        tokenizer_config.write_text(
            json.dumps(
                json.loads(tokenizer_config.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
            )
        )
        jobs.append(Conversion(checkpoint, root / f"{name}.gguf", case.pre))
    convert(converter, jobs)
    return {name: job.outfile for name, job in zip(CASES, jobs, strict=True)}


def reference(case: Case) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `PROMPT` and the log-probabilities `[STEPS, vocab]`
    before each, for the checkpoint llama.cpp runs `case`'s GGUF as."""
    model = build(case, case.runs_as)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0]
        logits = model(out[None]).logits[0, len(PROMPT) - 1 : -1]
    return out[len(PROMPT) :].tolist(), torch.log_softmax(logits.float(), dim=-1)


def served_logprobs(gguf: pathlib.Path, forced: list[int]) -> torch.Tensor:
    """The log-probabilities `[STEPS, vocab]` of `gguf` loaded as `ft serve --dtype float32`
    loads it, fed `forced` after `PROMPT`."""
    parts = load_torch_model(EngineConfig(model=str(gguf), dtype="float32"))
    runner = parts.make_runner(32, 4)
    assert isinstance(runner, TorchRunner)
    steps = forced_logits(runner, PROMPT, forced[:-1])
    return torch.log_softmax(torch.stack(steps).float(), dim=-1)


@pytest.mark.parametrize("name", MATCHING)
def test_converted_gguf_matches_transformers(
    name: str, converted: dict[str, pathlib.Path], caplog: pytest.LogCaptureFixture
) -> None:
    tokens, expected = reference(CASES[name])
    with caplog.at_level(logging.WARNING, logger="ft.model"):
        got = served_logprobs(converted[name], tokens)
    diff = (got - expected).abs().max().item()
    print(f"{name}: max |d logprob| {diff:.3g} over {STEPS} steps")
    assert diff < TOLERANCE
    if name in ("llama", "qwen3"):  # (the MoEs' and SmolLM3's files cannot say their settings)
        assert not [r for r in caplog.records if "converter does not write" in r.getMessage()]


@pytest.mark.parametrize("name", LOSSY)
def test_a_setting_the_converter_drops_runs_as_llama_cpp_runs_it_and_is_logged(
    name: str, converted: dict[str, pathlib.Path], caplog: pytest.LogCaptureFixture
) -> None:
    tokens, expected = reference(CASES[name])
    with caplog.at_level(logging.INFO, logger="ft.model"):
        got = served_logprobs(converted[name], tokens)
    assert (got - expected).abs().max().item() < TOLERANCE
    (warning,) = [r.getMessage() for r in caplog.records if "converter does not write" in r.getMessage()]
    assert repr(LOSSY[name]) in warning
    unconverted = dict(CASES[name].fields)  # the checkpoint as it was differs: the check can fail
    _, as_trained = reference(Case(CASES[name].model_type, unconverted, CASES[name].pre))
    lost = (got - as_trained).abs().max().item()
    print(f"{name}: max |d logprob| against the checkpoint as it was {lost:.3g}")
    assert lost > 10 * TOLERANCE


@pytest.mark.parametrize("name", ["qwen3_moe", "smollm3"])
async def test_served_top_logprobs_over_http_match_transformers(
    name: str, converted: dict[str, pathlib.Path]
) -> None:
    tokens, expected = reference(CASES[name])
    config = EngineConfig(model=str(converted[name]), dtype="float32", num_pages=64)
    body = {"prompt": list(PROMPT), "max_tokens": STEPS, "temperature": 0, "logprobs": 5}
    async with running_server(config) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        detokenized = {i: s.engine.detokenize([i]) for i in range(expected.shape[1])}
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [detokenized[t] for t in tokens]
    for step, top in enumerate(logprobs["top_logprobs"]):
        for text, value in top.items():  # a text several byte tokens share is one of theirs
            candidates = [expected[step, i].item() for i, t in detokenized.items() if t == text]
            assert min(abs(value - v) for v in candidates) < TOLERANCE, (step, text)
    chosen = [expected[step, t].item() for step, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"], chosen, strict=True)) < TOLERANCE
