"""Tiny random hybrid checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, LFM2, Granite 4.0-H) built
by transformers itself and saved as Hugging Face directories, for llama.cpp's converter.

Each is transformers' own `*ForCausalLM` from `AutoConfig.for_model` (hidden 64, 4 layers, the
tiny byte-level vocabulary of `tests.support.gguf_files`), every parameter redrawn
(`tiny_qwen35.randomize`: A_log over transformers' range, dt_bias, norms around their neutral
value) so no transform the converter applies is invisible, saved with `save_pretrained`
beside a `tokenizer.json`. Granite's `layer_types` are written as the published checkpoints
name them ("mamba" / "attention": the converter looks for those; transformers 5 saves
"linear_attention" / "full_attention").
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.gguf_files import tiny_tokens
from tests.support.tiny_families import EOS, save_dir
from tests.support.tiny_qwen35 import randomize

DELTANET = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
)  # fmt: skip
QWEN_MOE = dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2
)
GRANITE = dict(
    intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, num_local_experts=4, num_experts_per_tok=2,
    shared_intermediate_size=48, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
    logits_scaling=3.0, position_embedding_type="nope",
    vocab_size=272,  # (a multiple of 8: else the converter pads the vocabulary past the embedding)
)  # fmt: skip
_PUBLISHED_GRANITE_KINDS = {"linear_attention": "mamba", "full_attention": "attention"}


@dataclass(frozen=True)
class Hybrid:
    """A tiny checkpoint to build: its `model_type` and config fields, the GGUF architecture
    llama.cpp's converter writes it as, and the converter's extra arguments."""

    model_type: str
    fields: dict[str, Any]
    gguf_arch: str
    args: tuple[str, ...] = field(default=())


NO_MTP = ("--no-mtp",)  # (transformers saves no multi-token prediction layer for the converter to count)
HYBRIDS = {
    "qwen35": Hybrid("qwen3_5_text", dict(DELTANET, intermediate_size=128), "qwen35", NO_MTP),
    "qwen35moe": Hybrid("qwen3_5_moe_text", dict(DELTANET, **QWEN_MOE), "qwen35moe", NO_MTP),
    "qwen3next": Hybrid("qwen3_next", dict(DELTANET, **QWEN_MOE, intermediate_size=96), "qwen3next", NO_MTP),
    "lfm2": Hybrid(
        "lfm2",
        dict(
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            block_multiple_of=16,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
        ),
        "lfm2",
    ),  # fmt: skip
    "lfm2_tied": Hybrid(
        "lfm2",
        dict(
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            layer_types=["full_attention", "conv", "conv", "full_attention"],
        ),
        "lfm2",
    ),  # fmt: skip
    "granite": Hybrid("granitemoehybrid", GRANITE, "granitehybrid"),
    "granite_dense": Hybrid(
        "granitemoehybrid", dict(GRANITE, num_local_experts=0, shared_intermediate_size=40), "granitehybrid"
    ),
}


def build_hybrid(case: Hybrid, seed: int = 1) -> Any:
    """`case`'s random float32 model (transformers')."""
    import transformers

    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=64, num_hidden_layers=4, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=tokens.index(EOS), pad_token_id=0,
        bos_token_id=None,
    )  # fmt: skip
    fields |= case.fields
    if case.model_type == "lfm2":
        fields["norm_eps"] = fields.pop("rms_norm_eps")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(case.model_type, **fields)
    return randomize(transformers.AutoModelForCausalLM.from_config(config).float(), seed)


def save_hybrid(directory: pathlib.Path, model: Any) -> pathlib.Path:
    """`model` as a Hugging Face directory the converter reads as the hub's checkpoints."""
    save_dir(directory, model)
    tokenizer_config = directory / "tokenizer_config.json"
    tokenizer_config.write_text(
        json.dumps(json.loads(tokenizer_config.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    config = json.loads((directory / "config.json").read_text())
    if config["model_type"] == "granitemoehybrid":
        config["layer_types"] = [_PUBLISHED_GRANITE_KINDS[k] for k in config["layer_types"]]
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def add_mtp_layer(directory: pathlib.Path, seed: int = 2) -> None:
    """Give a saved Qwen3.5 checkpoint one multi-token prediction layer (`mtp.*`, as the hub's
    have: `fc`, its three norms and an attention decoder layer shaped as the model's last)."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    hidden = config["hidden_size"]
    extra = {f"mtp.layers.0.{k.removeprefix(last)}": torch.randn(v.shape, generator=gen) * 0.1
             for k, v in weights.items() if k.startswith(last)}  # fmt: skip
    extra["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.3
    save_file(weights | extra, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
