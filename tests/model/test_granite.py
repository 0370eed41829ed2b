"""Granite (embedding, residual, attention and logit multipliers) against transformers.

The checkpoint is transformers' own `GraniteForCausalLM` with random weights and Granite-3's
kinds of multipliers (`tests.support.tiny_families`): float32 logits match transformers within
1e-4, and each multiplier left out would not; its `granite` GGUF (the multipliers as
`granite.*_scale` keys, q/k permuted) on the packed path stays within int8 tolerance of the float
path.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace
from typing import Any

import pytest
import torch

from ft.model import kernels
from ft.model.gguf_file import ModelFileError
from ft.model.loader import load_model
from tests.support.gguf_files import F32, RawGGUF, scalar
from tests.support.tiny_families import (
    NEW_TOKENS,
    PACKED_RELATIVE_TOLERANCE,
    PROMPT,
    engine_greedy,
    granite_model,
    packed_error,
    runner_of,
    save_dir,
    write_gguf,
)
from tests.support.tiny_qwen3 import generate

transformers = pytest.importorskip("transformers")
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")
MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.015625,
    "logits_scaling": 8.0,
}
NEUTRAL = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 0.0,
    "logits_scaling": 1.0,
}


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return granite_model()


@pytest.fixture(scope="module")
def granite_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_dir(tmp_path_factory.mktemp("granite") / "tiny-granite", hf_model)


@pytest.fixture(scope="module")
def granite_gguf(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_gguf(tmp_path_factory.mktemp("granite-gguf") / "tiny-granite.Q8_0.gguf", hf_model)


def test_config_maps_the_multipliers_from_hf_and_gguf(
    granite_dir: pathlib.Path, granite_gguf: pathlib.Path
) -> None:
    hf = load_model(granite_dir, torch.float32).config
    gguf = load_model(granite_gguf, torch.float32).config
    for config in (hf, gguf):
        assert config.architecture == "granite"
        for name, value in MULTIPLIERS.items():
            assert getattr(config, name) == pytest.approx(value, rel=1e-6), name  # GGUF: float32
    assert replace(hf, rms_norm_eps=0.0, residual_multiplier=1.0) == replace(
        gguf, rms_norm_eps=0.0, residual_multiplier=1.0
    )


def test_float32_logits_and_greedy_tokens_match_transformers(
    hf_model: Any, granite_dir: pathlib.Path
) -> None:
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    tokens, logits = generate(runner_of(load_model(granite_dir, torch.float32)), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    expected_tokens = ref[0, len(PROMPT) :].tolist()
    assert tokens[: len(expected_tokens)] == expected_tokens


@pytest.mark.parametrize("name", list(MULTIPLIERS))
def test_each_multiplier_counts(hf_model: Any, granite_dir: pathlib.Path, name: str) -> None:
    """With any one multiplier left at its Llama value the logits are far from transformers'."""
    loaded = load_model(granite_dir, torch.float32)
    without = replace(loaded, config=replace(loaded.config, **{name: NEUTRAL[name]}))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(without), PROMPT, 1)
    assert (logits - expected).abs().max().item() > 1e-2


@pytest.mark.parametrize(
    ("key", "value"), [("logits_scaling", 0), ("residual_multiplier", -1.0), ("embedding_multiplier", "12")]
)
def test_a_multiplier_out_of_range_is_refused(
    granite_dir: pathlib.Path, tmp_path: pathlib.Path, key: str, value: Any
) -> None:
    cfg = json.loads((granite_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {key: value}))
    with pytest.raises(ValueError, match=key):
        load_model(tmp_path, torch.float32)


def test_gguf_float_path_matches_transformers_on_the_dequantized_weights(
    hf_model: Any, granite_gguf: pathlib.Path
) -> None:
    loaded = load_model(granite_gguf, torch.float32)
    dequantized = granite_model()
    dequantized.load_state_dict(dict(loaded.state_dict), strict=True)
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(loaded), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


def test_a_gguf_scale_out_of_range_is_refused_naming_its_key(
    granite_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    raw = RawGGUF.read(granite_gguf)
    raw.set("granite.logit_scale", F32, scalar(F32, float("nan"))).write(tmp_path / "nan-scale.gguf")
    with pytest.raises(ModelFileError, match="'granite.logit_scale'"):
        load_model(tmp_path / "nan-scale.gguf", torch.float32)


@needs_kernels
@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, kernels.Q8_0_KV], ids=["f32", "f16", "q8_0"]
)
def test_packed_path_agrees_with_the_float_path(granite_gguf: pathlib.Path, kv_dtype: Any) -> None:
    assert packed_error(granite_gguf, kv_dtype) < PACKED_RELATIVE_TOLERANCE


@needs_kernels
@pytest.mark.parametrize("name", ["residual_multiplier", "attention_multiplier"])
def test_packed_path_applies_the_layer_multipliers(granite_gguf: pathlib.Path, name: str) -> None:
    """Against a float model without one of the kernel's multipliers, the packed path is far off."""
    loaded = load_model(granite_gguf, torch.float32)
    without = replace(loaded, config=replace(loaded.config, **{name: NEUTRAL[name]}))
    with pytest.raises(AssertionError):
        assert packed_error(granite_gguf, torch.float32, reference=without) < PACKED_RELATIVE_TOLERANCE


@needs_kernels
def test_packed_layer_refuses_a_scale_that_is_not_finite(granite_gguf: pathlib.Path) -> None:
    from ft.core.batch import SeqWork
    from tests.support.tiny_qwen3 import GREEDY, PAGES

    runner = runner_of(load_model(granite_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[0].args.attn_scale = float("inf")
    with pytest.raises(kernels.KernelError, match="attention scale inf"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


@needs_kernels
async def test_an_engine_serves_the_gguf_on_the_packed_path(granite_gguf: pathlib.Path) -> None:
    packed = runner_of(load_model(granite_gguf, torch.float32, quantized=True), kv_dtype=torch.float16)
    tokens, _ = generate(packed, PROMPT, NEW_TOKENS)
    assert await engine_greedy(granite_gguf, PROMPT, NEW_TOKENS) == tokens


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(granite_dir: pathlib.Path) -> None:
    """The residual multiplier scales each all-reduced branch; the logit scaling each rank's slice."""
    from tests.support.parallel import tensor_parallel_runner

    one_tokens, one_logits = generate(runner_of(load_model(granite_dir, torch.float32)), PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(granite_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_graphed_granite_gives_the_cpu_tokens(granite_dir: pathlib.Path) -> None:
    from tests.support.tiny_families import assert_cuda_graphs_give_the_cpu_tokens

    assert_cuda_graphs_give_the_cpu_tokens(granite_dir)


def test_granite_and_gemma_softmax_scales_together_are_refused(granite_dir: pathlib.Path) -> None:
    """q is scaled by attention_multiplier * sqrt(head_dim), the scores by query_scale: both set
    would be neither's scale, on either path."""
    loaded = load_model(granite_dir, torch.float32)
    with pytest.raises(ValueError, match="two softmax scales"):
        replace(loaded.config, query_scale=0.125)


@needs_kernels
def test_packed_layer_refuses_both_softmax_scales(granite_gguf: pathlib.Path) -> None:
    from ft.core.batch import SeqWork
    from tests.support.tiny_qwen3 import GREEDY, PAGES

    runner = runner_of(load_model(granite_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[0].args.query_scale = 0.125
    with pytest.raises(kernels.KernelError, match="at most one is set"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])
