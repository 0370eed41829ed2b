"""Qwen3-MoE on the float path against transformers' `Qwen3MoeForCausalLM`, routing expert by expert.

The checkpoint is saved by transformers (per-expert `experts.N.*_proj` names); ft fuses each
layer's experts into `[experts, ...]` weights and runs each expert once over the tokens routed
to it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ft.model.cuda_graphs import GraphedRunner
from ft.model.gguf_file import ModelFileError
from ft.model.loader import is_quantized_gguf, load_model
from ft.model.moe import SparseMoE
from ft.model.parallel.shard import check_shardable
from ft.model.runners import build_runner
from tests.support.gguf_files import RawGGUF, dims
from tests.support.tiny_qwen3 import (
    generate,
    qwen3_moe_model,
    save_qwen3_dir,
    write_qwen3_gguf,
)

transformers = pytest.importorskip("transformers")

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=[True, False], ids=["norm-topk", "raw-topk"])
def hf_model(request: pytest.FixtureRequest) -> Any:
    return qwen3_moe_model(norm_topk_prob=request.param)


@pytest.fixture(scope="module")
def moe_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_qwen3_dir(tmp_path_factory.mktemp("qwen3-moe") / "tiny-qwen3-moe", hf_model)


@pytest.fixture(scope="module")
def moe_gguf(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_qwen3_gguf(tmp_path_factory.mktemp("qwen3-moe-gguf") / "tiny-qwen3-moe.Q8_0.gguf", hf_model)


def test_config_maps_the_experts(hf_model: Any, moe_dir: pathlib.Path) -> None:
    config = load_model(moe_dir, torch.float32).config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert config.moe_intermediate_size == 32 and config.norm_topk_prob == hf_model.config.norm_topk_prob


def test_float32_logits_and_greedy_tokens_match_transformers(hf_model: Any, moe_dir: pathlib.Path) -> None:
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    runner = build_runner(load_model(moe_dir, torch.float32), num_pages=32, page_size=4, dtype=torch.float32)
    tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    expected_tokens = ref[0, len(PROMPT) :].tolist()
    assert tokens[: len(expected_tokens)] == expected_tokens


def test_each_layer_routes_and_mixes_like_transformers_expert_by_expert(
    hf_model: Any, moe_dir: pathlib.Path
) -> None:
    """Per layer, on the same inputs: the same experts chosen with the same weights, each
    expert's output the same, and the mixture the same."""
    runner = build_runner(load_model(moe_dir, torch.float32), num_pages=32, page_size=4, dtype=torch.float32)
    x = torch.randn(len(PROMPT), hf_model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(runner.model.layers):
        ours: SparseMoE = layer.moe
        theirs = hf_model.model.layers[i].mlp
        with torch.inference_mode():
            _, their_weights, their_experts = theirs.gate(x)
            routing = ours.route(x)
            assert torch.equal(routing.experts, their_experts)
            assert torch.allclose(routing.weights, their_weights, atol=1e-6)
            for expert in range(hf_model.config.num_experts):
                one = torch.full_like(routing.experts[:, :1], expert)
                weight = torch.ones_like(routing.weights[:, :1])
                alone = theirs.experts(x, one, weight)  # every row through this expert alone
                gate, up = torch.nn.functional.linear(x, ours.gate_up[expert]).chunk(2, dim=-1)
                mine = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, ours.down[expert])
                assert torch.allclose(mine, alone, atol=1e-6), f"layer {i} expert {expert}"
            assert torch.allclose(ours(x), theirs(x[None])[0], atol=1e-5), f"layer {i}"


def test_the_grouped_experts_equal_a_loop_over_tokens(moe_dir: pathlib.Path) -> None:
    """The oracle for the grouping: each token's chosen experts, weighted, one token at a time."""
    runner = build_runner(load_model(moe_dir, torch.float32), num_pages=32, page_size=4, dtype=torch.float32)
    moe: SparseMoE = runner.model.layers[0].moe
    x = torch.randn(13, moe.router.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        routing = moe.route(x)
        rows = []
        for t in range(x.shape[0]):
            row = torch.zeros(x.shape[1])
            for expert, weight in zip(routing.experts[t].tolist(), routing.weights[t], strict=True):
                gate, up = (moe.gate_up[expert] @ x[t]).chunk(2)
                row += weight * (moe.down[expert] @ (torch.nn.functional.silu(gate) * up))
            rows.append(row)
        assert torch.allclose(moe(x), torch.stack(rows), atol=1e-5)
        assert moe(x[:0]).shape == (0, x.shape[1])  # an empty step routes nothing


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(moe_dir: pathlib.Path) -> None:
    """Each rank holds every expert's share of columns; both route alike (replicated router)."""
    from tests.support.parallel import tensor_parallel_runner

    one = build_runner(load_model(moe_dir, torch.float32), num_pages=32, page_size=4, dtype=torch.float32)
    one_tokens, one_logits = generate(one, PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(moe_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4


def test_more_ranks_than_expert_columns_are_refused(moe_dir: pathlib.Path) -> None:
    config = load_model(moe_dir, torch.float32).config
    with pytest.raises(ValueError, match="more than the model's expert MLP columns"):
        check_shardable(config, config.moe_intermediate_size + 1)


def test_configs_ft_cannot_run_exactly_are_refused(moe_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cfg = json.loads((moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="experts per token"):
        load_model(tmp_path, torch.float32)


@pytest.mark.parametrize(
    ("change", "dense"),
    [
        ({"decoder_sparse_step": 2}, (0, 2)),
        ({"mlp_only_layers": [1]}, (1,)),
        ({"decoder_sparse_step": 3}, (0, 1)),
    ],
)
def test_dense_layers_among_the_expert_layers_match_transformers(
    tmp_path: pathlib.Path, change: dict[str, object], dense: tuple[int, ...]
) -> None:
    """transformers' rule: layer i is routed unless listed in `mlp_only_layers`, and only when
    (i + 1) is a multiple of `decoder_sparse_step`; the others are dense MLPs of
    `intermediate_size`."""
    model = qwen3_moe_model(num_hidden_layers=3, **change)
    path = save_qwen3_dir(tmp_path / "mixed", model)
    loaded = load_model(path, torch.float32)
    assert loaded.config.mlp_only_layers == dense
    runner = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32)
    assert [layer.moe is None for layer in runner.model.layers] == [i in dense for i in range(3)]
    with torch.inference_mode():
        expected = model(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner, PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "change", [{"decoder_sparse_step": 0}, {"mlp_only_layers": [2]}, {"mlp_only_layers": "0"}]
)
def test_a_malformed_dense_layer_list_is_refused(
    moe_dir: pathlib.Path, tmp_path: pathlib.Path, change: dict[str, object]
) -> None:
    cfg = json.loads((moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(ValueError, match="decoder_sparse_step|mlp_only_layers"):
        load_model(tmp_path, torch.float32)


def test_gguf_loads_as_floats_and_matches_transformers_on_its_dequantized_weights(
    hf_model: Any, moe_gguf: pathlib.Path
) -> None:
    """A `qwen3moe` GGUF (Q8_0 experts, stacked per projection) on the float path is
    transformers on its dequantized weights; "auto" runs it packed (`test_moe_packed`)."""
    if not hf_model.config.norm_topk_prob:
        pytest.skip("llama.cpp's qwen3moe always renormalizes the top-k weights")
    assert is_quantized_gguf(moe_gguf)
    loaded = load_model(moe_gguf, torch.float32)
    sd = dict(loaded.state_dict)
    for i in range(hf_model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.cat([sd.pop(p + "gate_proj"), sd.pop(p + "up_proj")], dim=1)
    dequantized = qwen3_moe_model(norm_topk_prob=True)
    dequantized.load_state_dict(sd, strict=True)
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    runner = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32)
    _, logits = generate(runner, PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


def test_an_expert_tensor_of_the_wrong_shape_is_refused_naming_it(
    moe_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    raw = RawGGUF.read(moe_gguf)
    edit = dims("blk.0.ffn_down_exps.weight", 32, 64, 4)  # 4 experts where the metadata says 8
    edit(raw).write(tmp_path / "bad.gguf")
    with pytest.raises(ModelFileError, match=r"blk\.0\.ffn_down_exps\.weight: expected shape \[8, 64, 32\]"):
        load_model(tmp_path / "bad.gguf", torch.float32)


def test_a_gguf_that_says_not_to_renormalize_is_read_so(
    moe_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from tests.support.gguf_files import BOOL, U8, scalar

    raw = RawGGUF.read(moe_gguf)
    raw.set("qwen3moe.expert_weights_norm", BOOL, scalar(BOOL, False)).write(tmp_path / "raw.gguf")
    assert not load_model(tmp_path / "raw.gguf", torch.float32).config.norm_topk_prob
    raw.set("qwen3moe.expert_weights_norm", U8, scalar(U8, 1)).write(tmp_path / "bad.gguf")
    with pytest.raises(ModelFileError, match="expert_weights_norm.*expected a boolean"):
        load_model(tmp_path / "bad.gguf", torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_runs_the_experts_eagerly_with_the_cpu_tokens(moe_dir: pathlib.Path) -> None:
    """On the GPU the expert layers run eagerly (no decode graphs: their sizes come from routing)."""
    loaded = load_model(moe_dir, torch.float32)
    gpu = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, device=torch.device("cuda"))
    assert not isinstance(gpu, GraphedRunner)
    tokens_gpu, logits_gpu = generate(gpu, PROMPT, NEW_TOKENS)
    tokens_cpu, logits_cpu = generate(
        build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32), PROMPT, NEW_TOKENS
    )
    assert tokens_gpu == tokens_cpu
    assert (logits_gpu.cpu() - logits_cpu).abs().max().item() < 1e-3
