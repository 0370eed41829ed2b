"""Tiny random Qwen3.5 / Qwen3-Next layers built by transformers itself, for layer-level tests.

The configs come from `AutoConfig.for_model` (hidden 64; Gated DeltaNet with 2 key heads of 16
and 4 value heads of 32, so key heads serve two value heads each; attention with 4 heads of 32
over 2 kv heads, a quarter of each head rotated). Every parameter is redrawn — A_log over
transformers' own range, dt_bias, the norms' weights — so no term of the layer is trivially
zero or one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HIDDEN = 64
DELTANET = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
}
ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def text_config(model_type: str = "qwen3_5", **overrides: Any) -> Any:
    """transformers' text config of a 4-layer model (3 DeltaNet layers, then attention)."""
    from transformers import AutoConfig

    fields: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        **DELTANET,
        **ATTENTION,
        **overrides,
    }
    if model_type == "qwen3_5":
        return AutoConfig.for_model("qwen3_5", text_config=fields).text_config
    return AutoConfig.for_model(model_type, **fields)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Redraw every parameter of `module` (in place) so that nothing is trivially 0 or 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1] if "." in name else name
            if leaf == "A_log":  # A over transformers' init range
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:  # norm weights around their neutral value (1, or 0 for 1 + w)
                base = 0.0 if torch.all(p == 0) else 1.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return module.eval()


def deltanet_layer(model_type: str = "qwen3_5", seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """transformers' text config and its Gated DeltaNet layer (layer 0), random weights."""
    config = text_config(model_type, **overrides)
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        return config, randomize(Qwen3NextGatedDeltaNet(config, 0), seed)
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    return config, randomize(Qwen3_5GatedDeltaNet(config, 0), seed)


def attention_layer(seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """transformers' text config and its gated attention layer (layer 3), random weights."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    config = text_config("qwen3_5", **overrides)
    config._attn_implementation = "eager"
    return config, randomize(Qwen3_5Attention(config, 3), seed)
