"""Hybrid GGUFs written by llama.cpp's own converter, read back into their checkpoints.

Tiny random Qwen3.5, Qwen3.5-MoE, Qwen3-Next, LFM2 and Granite 4.0-H checkpoints
(`tests.support.tiny_hybrids`) are converted by the real `convert_hf_to_gguf.py`
(`tests.support.llama_converter`: skipped saying how to get it when it is not there) and read
back with `ft.model.gguf_hybrid`: the config dict gives transformers the checkpoint's config,
every tensor equals the safetensors' (float32 within 1e-6: a norm's `(w + 1) - 1` rounds;
Q8_0 within a quantization step), transformers runs the read-back checkpoint exactly as the
original, and a file whose numbers or shapes lie is one clean `ModelFileError` naming them.
"""

from __future__ import annotations

import json
import logging
import pathlib
import struct
from typing import Any

import pytest
import torch

from ft.model.gguf_file import GGUFFile, ModelFileError
from ft.model.gguf_hybrid import hf_config_from_gguf, hf_tensors_from_gguf, load_hybrid_gguf
from ft.model.loader import load_model
from tests.support.gguf_files import ARRAY, STRING, U32, RawGGUF, array, scalar, string, tiny_tokens
from tests.support.llama_converter import HOW_TO_GET, Conversion, convert, find_converter
from tests.support.tiny_families import EOS
from tests.support.tiny_hybrids import HYBRIDS, add_mtp_layer, build_hybrid, save_hybrid

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

QUANTIZED = ("qwen35", "qwen35moe", "qwen3next", "lfm2", "granite")
PROMPT = [5, 70, 100, 33, 200, 17, 90, 140, 61, 12]
COMMON_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "tie_word_embeddings", "layer_types", "eos_token_id", "pad_token_id", "bos_token_id",
)  # fmt: skip
QWEN_KEYS = (
    "head_dim", "rms_norm_eps", "rope_parameters", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "attention_bias", "hidden_act",
    "max_position_embeddings",
)  # fmt: skip
QWEN_MOE_KEYS = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
)  # fmt: skip
KEYS = {
    "qwen35": (*QWEN_KEYS, "intermediate_size"),
    "qwen35moe": (*QWEN_KEYS, *QWEN_MOE_KEYS),
    "qwen3next": (
        *QWEN_KEYS, *QWEN_MOE_KEYS, "intermediate_size", "norm_topk_prob", "decoder_sparse_step",
        "mlp_only_layers",
    ),
    "lfm2": ("norm_eps", "conv_L_cache", "conv_bias", "rope_parameters", "max_position_embeddings"),
    "granite": (
        "rms_norm_eps", "rope_parameters", "intermediate_size", "shared_intermediate_size",
        "num_local_experts", "num_experts_per_tok", "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
        "mamba_d_head", "mamba_d_conv", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias",
        "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
        "position_embedding_type", "attention_bias", "hidden_act", "time_step_limit",
    ),
}  # fmt: skip
KEYS |= {"lfm2_tied": KEYS["lfm2"], "granite_dense": KEYS["granite"]}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Each case's checkpoint directory (`name`) and GGUFs (`name.f32`, `name.q8_0`; `mtp.f32`:
    Qwen3.5 with a multi-token prediction layer), all converted in one process."""
    converter = find_converter()
    if converter is None:
        pytest.skip(HOW_TO_GET)
    root = tmp_path_factory.mktemp("hybrids")
    out: dict[str, pathlib.Path] = {}
    jobs = []
    for name, case in HYBRIDS.items():
        out[name] = save_hybrid(root / f"tiny-{name.replace('_', '-')}", build_hybrid(case))
        for outtype in ("f32", "q8_0") if name in QUANTIZED else ("f32",):
            out[f"{name}.{outtype}"] = root / f"{name}.{outtype}.gguf"
            jobs.append(Conversion(out[name], out[f"{name}.{outtype}"], "qwen2", outtype, case.args))
    out["mtp"] = save_hybrid(root / "tiny-mtp", build_hybrid(HYBRIDS["qwen35"]))
    add_mtp_layer(out["mtp"])
    out["mtp.f32"] = root / "mtp.f32.gguf"
    # (first: the converter's --no-mtp sets a class attribute that outlives its job)
    convert(converter, [Conversion(out["mtp"], out["mtp.f32"], "qwen2"), *jobs])
    return out


def original(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, as its safetensors hold them."""
    return dict(safetensors_torch.load_file(str(directory / "model.safetensors")))


def as_transformers_config(cfg: dict[str, Any]) -> Any:
    """transformers' config of a config dict."""
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(cfg["model_type"], **fields)


@pytest.mark.parametrize("name", HYBRIDS)
def test_config_reads_back_as_the_checkpoints(name: str, converted: dict[str, pathlib.Path]) -> None:
    cfg = hf_config_from_gguf(GGUFFile(converted[f"{name}.f32"]))
    ours = as_transformers_config(cfg)
    theirs = transformers.AutoConfig.from_pretrained(converted[name])
    assert type(ours) is type(theirs)
    for key in (*COMMON_KEYS, *KEYS[name]):
        assert getattr(ours, key) == getattr(theirs, key), key
    if name.startswith("lfm2"):  # the file holds the adjusted width, said with the adjustment off
        assert theirs.block_auto_adjust_ff_dim and not ours.block_auto_adjust_ff_dim
        width = int(theirs.block_ffn_dim_multiplier * int(2 * theirs.intermediate_size / 3))
        assert ours.intermediate_size == -(-width // theirs.block_multiple_of) * theirs.block_multiple_of
    if name.startswith("granite"):  # dropped by the converter (`GRANITE_LOSSES`)
        assert ours.max_position_embeddings == 1 << 20


@pytest.mark.parametrize("name", HYBRIDS)
def test_every_tensor_reads_back_as_the_checkpoints(name: str, converted: dict[str, pathlib.Path]) -> None:
    meta = GGUFFile(converted[f"{name}.f32"])
    ours = hf_tensors_from_gguf(meta, hf_config_from_gguf(meta))
    theirs = original(converted[name])
    assert ours.keys() == theirs.keys()
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    print(f"{name}: {len(theirs)} tensors, max |difference| {worst:.3g}")
    for key, tensor in theirs.items():
        assert ours[key].shape == tensor.shape, key
        assert torch.allclose(ours[key], tensor, rtol=0, atol=1e-6), key


@pytest.mark.parametrize("name", ["qwen35", "qwen3next", "lfm2", "granite"])
def test_transformers_runs_the_read_back_checkpoint_as_the_original(
    name: str, converted: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    cfg, sd, _ = load_hybrid_gguf(converted[f"{name}.f32"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        load = transformers.AutoModelForCausalLM.from_pretrained
        ours = load(tmp_path, dtype=torch.float32)(ids).logits
        theirs = load(converted[name], dtype=torch.float32)(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_q8_0_file_reads_back_within_its_quantization_error(
    name: str, converted: dict[str, pathlib.Path]
) -> None:
    meta = GGUFFile(converted[f"{name}.q8_0"])
    assert sum(t.tensor_type.name == "Q8_0" for t in meta.tensors) >= 10
    ours = hf_tensors_from_gguf(meta, hf_config_from_gguf(meta))
    theirs = original(converted[name])
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():  # a Q8_0 value is within a step of its block's absmax / 127
        step = tensor.abs().max().item() / 127
        assert (ours[key] - tensor).abs().max().item() <= step + 1e-6, key


def test_the_tokenizer_reads_back_as_the_checkpoints(converted: dict[str, pathlib.Path]) -> None:
    _, _, spec = load_hybrid_gguf(converted["lfm2.f32"])
    tokens, _, _ = tiny_tokens()
    assert spec.eos_token_ids == (tokens.index(EOS),)
    text = "Hello the hello <|im_end|>"
    theirs = transformers.AutoTokenizer.from_pretrained(converted["lfm2"])
    ours = spec.build().encode(text, add_special_tokens=False).ids
    assert ours == theirs.encode(text, add_special_tokens=False)


def test_multi_token_prediction_layers_read_back_when_asked_for(converted: dict[str, pathlib.Path]) -> None:
    meta = GGUFFile(converted["mtp.f32"])
    cfg = hf_config_from_gguf(meta)
    assert (cfg["num_hidden_layers"], cfg["mtp_num_hidden_layers"]) == (4, 1)
    assert cfg["layer_types"] == as_transformers_config(cfg).layer_types
    theirs = original(converted["mtp"])
    everything = hf_tensors_from_gguf(meta, cfg, mtp=True)
    assert everything.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert torch.allclose(everything[key], tensor, rtol=0, atol=1e-6), key
    assert hf_tensors_from_gguf(meta, cfg).keys() == {k for k in theirs if not k.startswith("mtp.")}


def test_the_settings_the_converter_drops_are_logged(
    converted: dict[str, pathlib.Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ft.model"):
        load_hybrid_gguf(converted["granite.f32"])
        load_hybrid_gguf(converted["qwen3next.f32"])
        load_hybrid_gguf(converted["qwen35.f32"])
    said = [r.getMessage() for r in caplog.records if "converter does not write" in r.getMessage()]
    settings = ("position_embedding_type", "max_position_embeddings", "time_step_limit", "norm_topk_prob")
    assert len(said) == len(settings)
    for setting, line in zip(settings, said, strict=True):
        assert repr(setting) in line


def test_a_hybrid_gguf_loads_as_its_checkpoint_under_the_families_names(
    converted: dict[str, pathlib.Path],
) -> None:
    loaded = load_model(converted["qwen35moe.f32"], torch.float32)
    assert loaded.config.architecture == "qwen3_5_moe" and not loaded.config.tie_word_embeddings
    assert loaded.config.layer_types[3] == "attention" and loaded.config.num_experts == 4
    floats = {k: v for k, v in loaded.state_dict.items() if "linear_attn.A_log" in k}
    assert floats and all(v.dtype == torch.float32 for v in floats.values())
    bf16 = load_model(converted["qwen35moe.f32"], torch.bfloat16).state_dict
    assert bf16["model.layers.0.linear_attn.A_log"].dtype == torch.float32  # (`hf_float32_weights`)
    assert bf16["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16


def _u32s(values: list[int]) -> bytes:
    return array(U32, [scalar(U32, v) for v in values])


LIES = {
    "block_count past the layer kinds": (
        "qwen35", lambda r: r.set("qwen35.block_count", U32, scalar(U32, 5)),
        "'qwen35.attention.recurrent_layers'",
    ),
    "block_count past LFM2's kv heads": (
        "lfm2", lambda r: r.set("lfm2.block_count", U32, scalar(U32, 5)), "'lfm2.attention.head_count_kv'"
    ),
    "an inner size the value heads do not divide": (
        "qwen35", lambda r: r.set("qwen35.ssm.inner_size", U32, scalar(U32, 130)), "'qwen35.ssm.inner_size'"
    ),
    "more experts used than there are": (
        "qwen35moe", lambda r: r.set("qwen35moe.expert_used_count", U32, scalar(U32, 9)),
        "'qwen35moe.expert_used_count'",
    ),
    "an expert count the router does not have": (
        "qwen35moe", lambda r: r.set("qwen35moe.expert_count", U32, scalar(U32, 8)),
        r"blk\.0\.ffn_gate_inp\.weight: expected shape \[8, 64\]",
    ),
    "a gate of half its rows": (
        "qwen35", lambda r: r.retensor("blk.0.attn_gate.weight", dims=(64, 64)),
        r"tensor blk\.0\.attn_gate\.weight: expected shape \[128, 64\] .* found \[64, 64\]",
    ),
    "a conv of fewer taps than the kernel": (
        "granite", lambda r: r.retensor("blk.0.ssm_conv1d.weight", dims=(3, 192)),
        r"blk\.0\.ssm_conv1d\.weight: expected shape \[192, 4\]",
    ),
    "layer kinds that hide an attention layer": (
        "granite", lambda r: r.set("granitehybrid.attention.head_count_kv", ARRAY, _u32s([0, 0, 0, 0])),
        r"tensor blk\.1\.ssm_in\.weight is missing \(the metadata describes Granite 4\.0-H: 4 layers "
        r"\(0 attention",
    ),
    "heads of one dimension": (
        "qwen35",
        lambda r: r.drop("qwen35.attention.key_length").set(
            "qwen35.attention.head_count", U32, scalar(U32, 64)
        ),
        "'qwen35.attention.key_length' is absent and hidden / heads is 1",
    ),
    "more tokens than the embedding has rows": (
        "qwen35",
        lambda r: r.set("tokenizer.ggml.tokens", ARRAY, array(STRING, [string(f"t{i}") for i in range(300)])),
        "'tokenizer.ggml.tokens': 300 tokens for an embedding of 266 rows",
    ),
}  # fmt: skip


@pytest.mark.parametrize("lie", LIES)
def test_a_file_whose_numbers_or_shapes_lie_is_a_clean_error(
    lie: str, converted: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    name, edit, message = LIES[lie]
    path = tmp_path / "lying.gguf"
    edit(RawGGUF.read(converted[f"{name}.f32"])).write(path)
    with pytest.raises(ModelFileError, match=message):
        load_hybrid_gguf(path)


@pytest.mark.parametrize(
    ("name", "tensor", "value", "message"),
    [
        ("qwen35", "blk.0.ssm_a", 0.5, r"blk\.0\.ssm_a: A must be negative"),
        ("granite", "blk.2.ssm_a", 0.0, r"blk\.2\.ssm_a: A must be negative"),
        ("lfm2", "blk.1.attn_q_norm.weight", float("nan"), r"blk\.1\.attn_q_norm\.weight holds NaN"),
    ],
)
def test_a_value_no_checkpoint_can_have_is_a_clean_error(
    name: str,
    tensor: str,
    value: float,
    message: str,
    converted: dict[str, pathlib.Path],
    tmp_path: pathlib.Path,
) -> None:
    raw = RawGGUF.read(converted[f"{name}.f32"])
    path = tmp_path / "bad.gguf"
    regions = raw.write(path)
    with path.open("r+b") as f:  # the tensor's first float32
        f.seek(regions.data + raw.tensor(tensor).offset)
        f.write(struct.pack("<f", value))
    with pytest.raises(ModelFileError, match=message):
        load_hybrid_gguf(path)
