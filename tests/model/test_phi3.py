"""Phi-3 / Phi-4-mini (fused qkv and gate|up, partial rotary, longrope) against transformers.

The checkpoint is transformers' own `Phi3ForCausalLM` with random weights and Phi-4-mini's
shape of rotary (`tests.support.tiny_families`): float32 logits match transformers within 1e-4
with the long factors and with the short ones; its `phi3` GGUF (fused tensors as stored, the
factors as tensors) on the packed path stays within int8 tolerance of the float path.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from ft.model import kernels
from ft.model.gguf_file import ModelFileError
from ft.model.loader import load_model
from tests.support.gguf_files import RawGGUF
from tests.support.tiny_families import (
    HEAD_DIM,
    NEW_TOKENS,
    PACKED_RELATIVE_TOLERANCE,
    PHI_ORIGINAL_CONTEXT,
    PHI_ROTARY,
    PROMPT,
    engine_greedy,
    gguf_tensors,
    packed_error,
    phi3_model,
    runner_of,
    save_dir,
    write_gguf,
)
from tests.support.tiny_qwen3 import generate

transformers = pytest.importorskip("transformers")
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")
SHORT_PROMPT = PROMPT[:20]  # within the trained context: transformers takes the short factors


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return phi3_model()


@pytest.fixture(scope="module")
def phi3_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_dir(tmp_path_factory.mktemp("phi3") / "tiny-phi3", hf_model, template="phi-4-mini")


@pytest.fixture(scope="module")
def phi3_gguf(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_gguf(tmp_path_factory.mktemp("phi3-gguf") / "tiny-phi3.Q8_0.gguf", hf_model)


def test_config_maps_partial_rotary_and_longrope_from_hf_and_gguf(
    phi3_dir: pathlib.Path, phi3_gguf: pathlib.Path
) -> None:
    hf = load_model(phi3_dir, torch.float32).config
    gguf = load_model(phi3_gguf, torch.float32).config
    for config in (hf, gguf):
        assert config.architecture == "phi3" and config.rotary_dim == PHI_ROTARY < HEAD_DIM
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["original_max_position_embeddings"] == PHI_ORIGINAL_CONTEXT
        assert config.is_long_rope  # a context of 512 passes the trained 32
    assert gguf.rope_scaling is not None and hf.rope_scaling is not None
    for key in ("short_factor", "long_factor"):  # float32 in the GGUF
        np.testing.assert_allclose(gguf.rope_scaling[key], hf.rope_scaling[key], rtol=1e-6)
    assert replace(hf, rms_norm_eps=0.0, rope_scaling=None) == replace(
        gguf, rms_norm_eps=0.0, rope_scaling=None
    )
    assert not replace(hf, rope_context=PHI_ORIGINAL_CONTEXT).is_long_rope


def test_float32_logits_and_greedy_tokens_match_transformers_with_the_long_factors(
    hf_model: Any, phi3_dir: pathlib.Path
) -> None:
    """A 44-token prompt passes the trained context of 32: transformers takes the long factors,
    as ft does for a served context of 512."""
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    tokens, logits = generate(runner_of(load_model(phi3_dir, torch.float32)), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    expected_tokens = ref[0, len(PROMPT) :].tolist()
    assert tokens[: len(expected_tokens)] == expected_tokens


def test_a_context_within_the_trained_one_takes_the_short_factors(
    hf_model: Any, phi3_dir: pathlib.Path
) -> None:
    """Served with a context of 32 (`--max-model-len`), ft rotates by the short factors: it
    matches transformers on a short prompt, and differs from the long factors' logits there."""
    loaded = load_model(phi3_dir, torch.float32)
    short = replace(loaded, config=replace(loaded.config, rope_context=PHI_ORIGINAL_CONTEXT))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([SHORT_PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(short), SHORT_PROMPT, 1)
    _, long_logits = generate(runner_of(loaded), SHORT_PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4
    assert (long_logits - expected).abs().max().item() > 1e-2


def test_the_partial_rotary_leaves_the_other_dims_unturned(hf_model: Any, phi3_dir: pathlib.Path) -> None:
    """A rotary over the whole head would not be transformers' model: the check can fail."""
    loaded = load_model(phi3_dir, torch.float32)
    scaling = dict(loaded.config.rope_scaling or {})
    for key in ("short_factor", "long_factor"):
        scaling[key] = [*scaling[key], *[1.0] * ((HEAD_DIM - PHI_ROTARY) // 2)]
    whole = replace(loaded, config=replace(loaded.config, rotary_dim=HEAD_DIM, rope_scaling=scaling))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(whole), PROMPT, 1)
    assert (logits - expected).abs().max().item() > 1e-2


def _fused(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Split GGUF weights (Llama names) fused back into Phi-3's qkv_proj and gate_up_proj."""
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")) and "gate" not in name:
            continue
        if name.endswith("q_proj.weight"):
            stem = name.removesuffix("q_proj.weight")
            out[stem + "qkv_proj.weight"] = torch.cat(
                [w, sd[stem + "k_proj.weight"], sd[stem + "v_proj.weight"]]
            )
        elif name.endswith("gate_proj.weight"):
            stem = name.removesuffix("gate_proj.weight")
            out[stem + "gate_up_proj.weight"] = torch.cat([w, sd[stem + "up_proj.weight"]])
        else:
            out[name] = w
    return out


def test_gguf_float_path_matches_transformers_on_the_dequantized_weights(
    hf_model: Any, phi3_gguf: pathlib.Path
) -> None:
    """The fused tensors split by rows at load, the factors read from their tensors: the GGUF's
    float weights, fused again into transformers' model, give its logits."""
    loaded = load_model(phi3_gguf, torch.float32)
    assert "model.layers.0.self_attn.q_proj.weight" in loaded.state_dict
    dequantized = phi3_model()
    dequantized.load_state_dict(_fused(loaded.state_dict), strict=True)
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(loaded), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


@needs_kernels
@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, kernels.Q8_0_KV], ids=["f32", "f16", "q8_0"]
)
def test_packed_path_agrees_with_the_float_path(phi3_gguf: pathlib.Path, kv_dtype: Any) -> None:
    assert packed_error(phi3_gguf, kv_dtype) < PACKED_RELATIVE_TOLERANCE


@needs_kernels
def test_packed_path_turns_only_the_rotary_dims(phi3_gguf: pathlib.Path) -> None:
    """Against a float model whose rotary turns the whole head, the packed path is far off: the
    agreement above says the kernel's partial rotary is the float path's."""
    loaded = load_model(phi3_gguf, torch.float32)
    scaling = dict(loaded.config.rope_scaling or {})
    for key in ("short_factor", "long_factor"):
        scaling[key] = [*scaling[key], *[1.0] * ((HEAD_DIM - PHI_ROTARY) // 2)]
    whole = replace(loaded, config=replace(loaded.config, rotary_dim=HEAD_DIM, rope_scaling=scaling))
    with pytest.raises(AssertionError):
        assert packed_error(phi3_gguf, torch.float32, reference=whole) < PACKED_RELATIVE_TOLERANCE


@needs_kernels
def test_packed_layer_refuses_rotary_tables_of_another_width(phi3_gguf: pathlib.Path) -> None:
    from ft.core.batch import SeqWork
    from tests.support.tiny_qwen3 import GREEDY, PAGES

    runner = runner_of(load_model(phi3_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[1].args.rotary_dim = HEAD_DIM
    with pytest.raises(kernels.KernelError, match="rotary tables of 12 for a rotary over 32"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])
    runner.packed.layers[1].args.rotary_dim = 3
    with pytest.raises(kernels.KernelError, match="a rotary over 3 dims"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


@needs_kernels
async def test_an_engine_serves_the_gguf_on_the_packed_path(phi3_gguf: pathlib.Path) -> None:
    packed = runner_of(load_model(phi3_gguf, torch.float32, quantized=True), kv_dtype=torch.float16)
    tokens, _ = generate(packed, PROMPT, NEW_TOKENS)
    assert await engine_greedy(phi3_gguf, PROMPT, NEW_TOKENS) == tokens


def test_a_fused_qkv_of_the_wrong_shape_is_refused_naming_it(hf_model: Any, tmp_path: pathlib.Path) -> None:
    tensors = gguf_tensors(hf_model, permuted=False)
    tensors["blk.2.attn_qkv.weight"] = tensors["blk.2.attn_qkv.weight"][:-HEAD_DIM]  # one kv head short
    write_gguf(tmp_path / "short-qkv.gguf", hf_model, tensors=tensors)
    with pytest.raises(ModelFileError, match=r"tensor blk\.2\.attn_qkv\.weight: expected shape \[256, 128\]"):
        load_model(tmp_path / "short-qkv.gguf", torch.float32, quantized=True)


def test_an_unfused_gate_is_refused_naming_the_fused_tensor(hf_model: Any, tmp_path: pathlib.Path) -> None:
    tensors = gguf_tensors(hf_model, permuted=False)
    gate, up = np.split(tensors.pop("blk.0.ffn_up.weight"), 2)
    tensors |= {"blk.0.ffn_gate.weight": gate, "blk.0.ffn_up.weight": up}
    write_gguf(tmp_path / "split-gate.gguf", hf_model, tensors=tensors)
    with pytest.raises(ModelFileError, match=r"tensor blk\.0\.ffn_up\.weight: expected shape \[512, 128\]"):
        load_model(tmp_path / "split-gate.gguf", torch.float32)


def test_one_longrope_tensor_without_the_other_is_refused(
    phi3_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    raw = RawGGUF.read(phi3_gguf)
    raw.tensors = [t for t in raw.tensors if t.name != "rope_factors_short.weight"]
    raw.write(tmp_path / "one-factor.gguf")
    with pytest.raises(ModelFileError, match=r"rope_factors_short\.weight is missing"):
        load_model(tmp_path / "one-factor.gguf", torch.float32)


def test_longrope_factors_of_the_wrong_length_are_refused(
    phi3_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    cfg = json.loads((phi3_dir / "config.json").read_text())
    cfg["rope_parameters"]["long_factor"] = cfg["rope_parameters"]["long_factor"][:-1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="long_factor: expected 12 positive numbers"):
        load_model(tmp_path, torch.float32)


WINDOW = 13  # shorter than PROMPT (44): every prompt row past the 13th and every decode step drop keys


@pytest.fixture(scope="module")
def windowed_model(hf_model: Any) -> Any:
    """`hf_model`'s weights with a sliding window of WINDOW (as Phi-3-mini-4k's 2047 of 4096)."""
    windowed = phi3_model(sliding_window=WINDOW)
    windowed.load_state_dict(hf_model.state_dict())
    return windowed


def _with_config(src: pathlib.Path, dst: pathlib.Path, **fields: Any) -> pathlib.Path:
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).symlink_to(src / name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | fields))
    return dst


def test_a_sliding_window_shorter_than_the_prompt_matches_transformers(
    hf_model: Any, windowed_model: Any, phi3_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Phi-3's `sliding_window` masks as Mistral's (a row attends its last WINDOW positions, its
    own included): the prompt's last logits and the greedy tokens decoded past the window are
    transformers', and differ from the unwindowed model's (the window is not ignored)."""
    loaded = load_model(_with_config(phi3_dir, tmp_path, sliding_window=WINDOW), torch.float32)
    assert loaded.config.sliding_window == WINDOW and loaded.config.is_all_windowed
    with torch.inference_mode():
        expected = windowed_model(torch.tensor([PROMPT])).logits[0, -1]
        unwindowed = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        ref = windowed_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    assert (expected - unwindowed).abs().max().item() > 1e-2
    tokens, logits = generate(runner_of(loaded), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    expected_tokens = ref[0, len(PROMPT) :].tolist()
    assert tokens[: len(expected_tokens)] == expected_tokens


@pytest.mark.parametrize("window", [512, None])
def test_a_window_at_least_the_context_or_none_is_no_window(
    phi3_dir: pathlib.Path, tmp_path: pathlib.Path, window: int | None
) -> None:
    """Phi-3.5 / Phi-4-mini (a window of the whole context, or none) run as before."""
    loaded = load_model(_with_config(phi3_dir, tmp_path, sliding_window=window), torch.float32)
    assert loaded.config.sliding_window == (window or 0)
    _, logits = generate(runner_of(loaded), PROMPT, 1)
    _, plain = generate(runner_of(load_model(phi3_dir, torch.float32)), PROMPT, 1)
    assert (logits - plain).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def windowed_gguf(windowed_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_gguf(tmp_path_factory.mktemp("phi3-swa") / "swa.Q8_0.gguf", windowed_model)


def test_a_gguf_sliding_window_is_kept_as_transformers_does(windowed_gguf: pathlib.Path) -> None:
    """llama.cpp drops Phi-3's window; ft keeps it (the model was trained with it): the GGUF's
    float weights in transformers' windowed model give its logits."""
    loaded = load_model(windowed_gguf, torch.float32)
    assert loaded.config.sliding_window == WINDOW and loaded.config.is_all_windowed
    dequantized = phi3_model(sliding_window=WINDOW)
    dequantized.load_state_dict(_fused(loaded.state_dict), strict=True)
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(loaded), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, kernels.Q8_0_KV], ids=["f32", "q8_0"])
def test_the_packed_path_windows_as_the_float_path(windowed_gguf: pathlib.Path, kv_dtype: Any) -> None:
    assert packed_error(windowed_gguf, kv_dtype) < PACKED_RELATIVE_TOLERANCE
    # and the windowed float path is not the unwindowed one's: the agreement is the window's
    loaded = load_model(windowed_gguf, torch.float32)
    unwindowed = replace(loaded, config=replace(loaded.config, sliding_window=0))
    try:
        error = packed_error(windowed_gguf, kv_dtype, reference=unwindowed)
    except AssertionError:  # (its greedy tokens fall behind the unwindowed model's)
        error = float("inf")
    assert error > PACKED_RELATIVE_TOLERANCE


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(phi3_dir: pathlib.Path) -> None:
    """The fused qkv is split by heads per rank (each rank's kv heads with their query heads)."""
    from tests.support.parallel import tensor_parallel_runner

    one_tokens, one_logits = generate(runner_of(load_model(phi3_dir, torch.float32)), PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(phi3_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_graphed_phi3_gives_the_cpu_tokens(phi3_dir: pathlib.Path) -> None:
    from tests.support.tiny_families import assert_cuda_graphs_give_the_cpu_tokens

    assert_cuda_graphs_give_the_cpu_tokens(phi3_dir)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_graphed_windowed_phi3_gives_the_cpu_tokens(
    phi3_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from tests.support.tiny_families import assert_cuda_graphs_give_the_cpu_tokens

    assert_cuda_graphs_give_the_cpu_tokens(_with_config(phi3_dir, tmp_path, sliding_window=WINDOW))


@pytest.mark.parametrize(
    ("max_model_len", "is_long"), [(PHI_ORIGINAL_CONTEXT, False), (None, True), (64, True)]
)
def test_the_served_context_picks_the_factors(
    phi3_dir: pathlib.Path, max_model_len: int | None, is_long: bool
) -> None:
    """`--max-model-len` within the trained context runs the short factors (llama.cpp's choice
    by its context); the model's own 512, or any longer length, the long ones."""
    from ft.config import EngineConfig
    from ft.engine.loading import load_torch_model

    config = EngineConfig(
        model=str(phi3_dir), dtype="float32", max_model_len=max_model_len, compute_threads=1
    )
    runner = load_torch_model(config).make_runner(8, 16)
    assert runner.config.is_long_rope is is_long  # type: ignore[attr-defined]
