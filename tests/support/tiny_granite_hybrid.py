"""Tiny random Granite 4.0-H models (Mamba-2 and attention layers), built by transformers itself.

The checkpoint is transformers' own `GraniteMoeHybridForCausalLM` from
`AutoConfig.for_model("granitemoehybrid", ...)`: hidden 64, 4 layers mixing Mamba-2 and
attention (4 heads / 2 kv heads of 16), Mamba-2 heads of 16 with a state of 16 and a scan chunk
of 8, Granite 4.0-H's multipliers, and either routed experts (4, top 2) beside the shared MLP
with rotary attention, or the shared MLP alone with attention without rotary (as published).
Every weight is random, the Mamba-2 decays, time-step biases, skips and norms spread as
`tests/model/test_mamba2.py` spreads them; saved with `save_pretrained` beside the tests'
byte-level BPE tokenizer.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import torch

from tests.support.gguf_files import tiny_tokens
from tests.support.tiny_families import EOS, save_dir

VARIANTS: dict[str, dict[str, Any]] = {
    # experts beside the shared MLP, rotary attention, B and C in 2 groups
    "moe": dict(
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4,
        num_experts_per_tok=2, position_embedding_type="rope", mamba_n_heads=8, mamba_n_groups=2,
    ),
    # the shared MLP alone (num_local_experts 0), attention without rotary, one group
    "dense": dict(
        layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
        position_embedding_type=None, mamba_n_heads=4, mamba_n_groups=1,
    ),
}  # fmt: skip


def granite_hybrid_model(variant: str = "moe", seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `GraniteMoeHybridForCausalLM` (`overrides`: config fields)."""
    import transformers

    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=8, mamba_d_conv=4,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
        logits_scaling=6.0, tie_word_embeddings=False, eos_token_id=tokens.index(EOS), pad_token_id=0,
        bos_token_id=None,
    )  # fmt: skip
    fields.update(VARIANTS[variant])
    fields.update(overrides)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("granitemoehybrid", **fields)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):  # decays from nearly none to fast: A in [-6, -0.02]
                p.uniform_(math.log(0.02), math.log(6.0))
            elif name.endswith("dt_bias"):  # time steps around 0.1-1
                p.copy_(torch.randn_like(p) * 0.7 - 1.0)
            elif name.endswith(".D"):
                p.normal_(0.0, 1.0)
            elif "conv1d" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.1)
        model.model.embed_tokens.weight.mul_(0.1)  # so that 12x it keeps the activations sane
    return model.eval()


def save_granite_hybrid_dir(directory: pathlib.Path, model: Any) -> pathlib.Path:
    """`model` as a Hugging Face directory (config.json, safetensors, tokenizer)."""
    return save_dir(directory, model)
