"""Mixtral on the float path against transformers' `MixtralForCausalLM`: its per-expert
`block_sparse_moe.experts.N.w1/w2/w3` checkpoint names, its always-renormalized top-k router
(a softmax over the k chosen logits), its `llama` GGUFs with expert tensors, its
`sliding_window` (Mistral's, from safetensors and GGUF, float and packed), and two ranks."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import pytest
import torch

from ft.model import kernels
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.support.tiny_moe import mixtral_model, write_moe_gguf
from tests.support.tiny_qwen3 import generate, save_qwen3_dir

transformers = pytest.importorskip("transformers")

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return mixtral_model()


@pytest.fixture(scope="module")
def mixtral_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_qwen3_dir(tmp_path_factory.mktemp("mixtral") / "tiny-mixtral", hf_model)


def _runner(path: pathlib.Path, **load: Any) -> TorchRunner:
    return build_runner(
        load_model(path, torch.float32, **load), num_pages=32, page_size=4, dtype=torch.float32
    )


def test_the_checkpoint_is_stored_per_expert_and_maps_to_mixtral(mixtral_dir: pathlib.Path) -> None:
    from safetensors import safe_open

    with safe_open(str(mixtral_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names  # the layout real files have
    config = load_model(mixtral_dir, torch.float32).config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("mixtral", 8, 2)
    assert config.moe_intermediate_size == 64 and config.norm_topk_prob and not config.qk_norm


def test_float32_logits_and_greedy_tokens_match_transformers(
    hf_model: Any, mixtral_dir: pathlib.Path
) -> None:
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    tokens, logits = generate(_runner(mixtral_dir), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    assert tokens == ref[0, len(PROMPT) :].tolist()


def test_the_router_picks_transformers_experts_with_its_weights(
    hf_model: Any, mixtral_dir: pathlib.Path
) -> None:
    """Mixtral's rule is a softmax over the k chosen logits; ours (softmax over all, top-k,
    renormalized) is the same function: same experts, same weights, on every layer."""
    runner = _runner(mixtral_dir)
    x = torch.randn(31, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for i, layer in enumerate(runner.model.layers):
        with torch.inference_mode():
            _, their_weights, their_experts = hf_model.model.layers[i].mlp.gate(x)
            ours = layer.moe.route(x)
            logits = torch.nn.functional.linear(x, layer.moe.router)
            top, chosen = logits.topk(2, dim=-1)
        assert torch.equal(ours.experts, their_experts) and torch.equal(ours.experts, chosen)
        assert torch.allclose(ours.weights, their_weights, atol=1e-6)
        assert torch.allclose(ours.weights, torch.softmax(top, dim=-1), atol=1e-6)


def test_a_llama_gguf_with_expert_tensors_is_mixtral_and_matches_its_dequantized_weights(
    hf_model: Any, tmp_path: pathlib.Path
) -> None:
    """llama.cpp writes Mixtral as `general.architecture = llama` with `llama.expert_count`
    and permuted q/k rows: loaded as floats, it is transformers on the dequantized weights."""
    path = write_moe_gguf(tmp_path / "tiny-mixtral.Q8_0.gguf", hf_model)
    loaded = load_model(path, torch.float32)
    assert loaded.config.architecture == "mixtral" and loaded.config.num_experts == 8
    sd = dict(loaded.state_dict)
    for i in range(hf_model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.cat([sd.pop(p + "gate_proj"), sd.pop(p + "up_proj")], dim=1)
    dequantized = mixtral_model()
    dequantized.load_state_dict(sd, strict=True)
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


WINDOW = 8  # much shorter than PROMPT (44 tokens)


@pytest.fixture(scope="module")
def windowed_model() -> Any:
    return mixtral_model(sliding_window=WINDOW, attn_implementation="eager")


def _last_logits(model: Any) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor([PROMPT])).logits[0, -1]
    return logits


def test_a_sliding_window_runs_as_mistrals_from_safetensors(
    windowed_model: Any, tmp_path: pathlib.Path
) -> None:
    """Every layer attends its last 8 positions (the experts are only a different MLP): float32
    logits and greedy tokens are transformers'."""
    path = save_qwen3_dir(tmp_path / "tiny-mixtral-swa", windowed_model)
    config = load_model(path, torch.float32).config
    assert config.sliding_window == WINDOW and config.is_all_windowed and config.num_experts == 8
    with torch.inference_mode():
        ref = windowed_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    tokens, logits = generate(_runner(path), PROMPT, NEW_TOKENS)
    assert (logits - _last_logits(windowed_model)).abs().max().item() < 1e-4
    assert tokens == ref[0, len(PROMPT) :].tolist()


def test_without_the_window_the_logits_differ(windowed_model: Any, tmp_path: pathlib.Path) -> None:
    """The window is what makes the test above pass: the same weights attending everything differ."""
    path = save_qwen3_dir(tmp_path / "tiny-mixtral-swa", windowed_model)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"sliding_window": None}))
    assert load_model(path, torch.float32).config.sliding_window == 0
    _, logits = generate(_runner(path), PROMPT, 1)
    assert (logits - _last_logits(windowed_model)).abs().max().item() > 1e-2


def _dequantized(loaded: Any, config: Any) -> Any:
    """transformers' Mixtral holding a loaded GGUF's (dequantized) weights."""
    sd = dict(loaded.state_dict)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.cat([sd.pop(p + "gate_proj"), sd.pop(p + "up_proj")], dim=1)
    model = mixtral_model(sliding_window=WINDOW, attn_implementation="eager")
    model.load_state_dict(sd, strict=True)
    return model


def test_a_gguf_with_a_sliding_window_matches_transformers_on_its_weights(
    windowed_model: Any, tmp_path: pathlib.Path
) -> None:
    """`llama.attention.sliding_window` in a Mixtral GGUF (a `llama` file with experts) applies
    as in a Mistral one: the float path is transformers on the dequantized weights."""
    path = write_moe_gguf(tmp_path / "tiny-mixtral-swa.Q8_0.gguf", windowed_model)
    loaded = load_model(path, torch.float32)
    assert loaded.config.architecture == "mixtral" and loaded.config.sliding_window == WINDOW
    _, logits = generate(build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32), PROMPT, 1)
    assert (logits - _last_logits(_dequantized(loaded, windowed_model.config))).abs().max().item() < 1e-4


def test_a_mixtral_gguf_without_the_window_key_warns_that_the_converter_drops_it(
    hf_model: Any, windowed_model: Any, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As Mistral's: llama.cpp's converter writes no window; a file with the key says nothing."""
    for model, warns in ((hf_model, True), (windowed_model, False)):
        caplog.clear()
        path = write_moe_gguf(tmp_path / f"mixtral-{warns}.Q8_0.gguf", model)
        with caplog.at_level(logging.WARNING, logger="ft.model"):
            assert load_model(path, torch.float32).config.architecture == "mixtral"
        assert any("'sliding_window'" in r.getMessage() for r in caplog.records) == warns


@pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")
def test_the_packed_path_runs_the_window_and_agrees_with_the_float_path(
    windowed_model: Any, tmp_path: pathlib.Path
) -> None:
    path = write_moe_gguf(tmp_path / "tiny-mixtral-swa.Q8_0.gguf", windowed_model)
    want_tokens, want = generate(_runner(path), PROMPT, NEW_TOKENS)
    packed = _runner(path, quantized=True)
    assert packed.packed is not None and all(layer.args.window == WINDOW for layer in packed.packed.layers)
    got_tokens, got = generate(packed, PROMPT, NEW_TOKENS)
    assert (got - want).abs().max().item() < 0.04 * (want.max() - want.min()).item()
    assert got_tokens[0] == want_tokens[0]


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(mixtral_dir: pathlib.Path) -> None:
    from tests.support.parallel import tensor_parallel_runner

    one_tokens, one_logits = generate(_runner(mixtral_dir), PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(mixtral_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4
