"""OLMoE on the float path against transformers' `OlmoeForCausalLM`: RMSNorm over the whole q and
k projections (not per head), softmax over every expert then top-k without renormalization, its
`olmoe` GGUFs, and two ranks (whose whole-projection norms sum their squares over the ranks)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ft.model.gguf_file import ModelFileError
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.support.gguf_files import RawGGUF, dims
from tests.support.tiny_moe import olmoe_model, write_moe_gguf
from tests.support.tiny_qwen3 import generate, save_qwen3_dir

transformers = pytest.importorskip("transformers")

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=[False, True], ids=["raw-topk", "norm-topk"])
def hf_model(request: pytest.FixtureRequest) -> Any:
    return olmoe_model(norm_topk_prob=request.param)


@pytest.fixture(scope="module")
def olmoe_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_qwen3_dir(tmp_path_factory.mktemp("olmoe") / "tiny-olmoe", hf_model)


def _runner(path: pathlib.Path) -> TorchRunner:
    return build_runner(load_model(path, torch.float32), num_pages=32, page_size=4, dtype=torch.float32)


def test_config_maps_the_whole_projection_norms_and_the_router(
    hf_model: Any, olmoe_dir: pathlib.Path
) -> None:
    config = load_model(olmoe_dir, torch.float32).config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("olmoe", 8, 3)
    assert config.qk_norm and config.qk_norm_whole
    assert config.norm_topk_prob == hf_model.config.norm_topk_prob


def test_float32_logits_and_greedy_tokens_match_transformers(hf_model: Any, olmoe_dir: pathlib.Path) -> None:
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    tokens, logits = generate(_runner(olmoe_dir), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    assert tokens == ref[0, len(PROMPT) :].tolist()


def test_the_norms_span_the_whole_projection_not_each_head(hf_model: Any, olmoe_dir: pathlib.Path) -> None:
    """The same q and k through ours and transformers' norms agree; a per-head norm would not."""
    layer = _runner(olmoe_dir).model.layers[0]
    theirs = hf_model.model.layers[0].self_attn
    q = torch.randn(5, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(4)) * 3
    k = q[:, : layer.config.kv_size].flip(0)
    from ft.model.llama import whole_qk_norm

    with torch.inference_mode():
        ours_q, ours_k = whole_qk_norm(q, k, layer.q_norm, layer.k_norm, None)
        assert torch.allclose(ours_q, theirs.q_norm(q), atol=1e-6)
        assert torch.allclose(ours_k, theirs.k_norm(k), atol=1e-6)
        per_head = q.view(5, -1, 32) * torch.rsqrt(q.view(5, -1, 32).pow(2).mean(-1, keepdim=True) + 1e-6)
        assert not torch.allclose(ours_q, (per_head.view(5, -1) * layer.q_norm.weight), atol=1e-3)


def test_the_router_does_not_renormalize_unless_configured(hf_model: Any, olmoe_dir: pathlib.Path) -> None:
    moe = _runner(olmoe_dir).model.layers[1].moe
    x = torch.randn(17, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        _, their_weights, their_experts = hf_model.model.layers[1].mlp.gate(x)
        ours = moe.route(x)
    assert torch.equal(ours.experts, their_experts)
    assert torch.allclose(ours.weights, their_weights, atol=1e-6)
    sums = ours.weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == hf_model.config.norm_topk_prob


def test_gguf_loads_and_matches_transformers_on_its_dequantized_weights(
    hf_model: Any, tmp_path: pathlib.Path
) -> None:
    if hf_model.config.norm_topk_prob:
        pytest.skip("llama.cpp's olmoe never renormalizes the top-k weights")
    path = write_moe_gguf(tmp_path / "tiny-olmoe.Q8_0.gguf", hf_model)
    loaded = load_model(path, torch.float32)
    assert loaded.config.architecture == "olmoe" and not loaded.config.norm_topk_prob
    sd = dict(loaded.state_dict)
    for i in range(hf_model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.cat([sd.pop(p + "gate_proj"), sd.pop(p + "up_proj")], dim=1)
    dequantized = olmoe_model()
    dequantized.load_state_dict(sd, strict=True)
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


def test_a_per_head_q_norm_in_an_olmoe_gguf_is_refused_naming_it(
    hf_model: Any, tmp_path: pathlib.Path
) -> None:
    path = write_moe_gguf(tmp_path / "tiny-olmoe.gguf", hf_model)
    dims("blk.1.attn_q_norm.weight", 32)(RawGGUF.read(path)).write(tmp_path / "bad.gguf")
    with pytest.raises(ModelFileError, match=r"blk\.1\.attn_q_norm\.weight: expected shape \[128\]"):
        load_model(tmp_path / "bad.gguf", torch.float32)


@pytest.mark.parametrize("change", [{"clip_qkv": 8.0}, {"attention_bias": True}])
def test_configs_ft_cannot_run_exactly_are_refused(
    olmoe_dir: pathlib.Path, tmp_path: pathlib.Path, change: dict[str, object]
) -> None:
    cfg = json.loads((olmoe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(ValueError, match=f"olmoe with {next(iter(change))}"):
        load_model(tmp_path, torch.float32)


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(olmoe_dir: pathlib.Path) -> None:
    """Each rank holds half the heads: the whole-q/k norms need both ranks' squares."""
    from tests.support.parallel import tensor_parallel_runner

    one_tokens, one_logits = generate(_runner(olmoe_dir), PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(olmoe_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4
