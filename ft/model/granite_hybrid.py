"""Granite 4.0-H's `config.json` (transformers' `granitemoehybrid`) as a `LlamaConfig`.

A Granite 4.0-H layer is a Mamba-2 mixer (`ft.model.mamba2`) or attention, then an MLP: routed
experts plus an always-on shared MLP (`LlamaConfig.shared_mlp`; the dense MLP alone when
`num_local_experts` is 0), around them Granite 3's four multipliers. Its attention layers use
no rotary unless `position_embedding_type` is "rope" (the published models: none). The
checkpoint's expert and shared-MLP names are renamed to the Llama family's at load
(`architectures.GRANITE_HYBRID.hf_weight_renames`), so every piece but the mixer loads and runs
as any Llama-family layer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ft.model.llama import ATTENTION, LlamaConfig
from ft.model.mamba2 import Mamba2Config

if TYPE_CHECKING:
    from ft.model.architectures import Architecture

# `layer_types` (or the older `layers_block_type`): "mamba" / "attention" as published,
# "linear_attention" / "full_attention" as transformers 5 writes them
GRANITE_LAYER_KINDS = {
    "mamba": "mamba2",
    "linear_attention": "mamba2",
    "attention": ATTENTION,
    "full_attention": ATTENTION,
}
POSITION_TYPES = (None, "nope", "rope")


def granite_hybrid_config(arch: Architecture, cfg: dict[str, Any]) -> LlamaConfig:
    """Granite 4.0-H (or a dense Granite 4.0 of this model type) from its `config.json`, with
    transformers' `GraniteMoeHybridConfig` defaults for absent keys.

    Raises:
        ValueError: a block ft does not run (an attention bias, which is also an o_proj bias; an
            activation other than SiLU; a position embedding other than none or rope) or
            inconsistent values.
    """
    name = arch.name
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types", cfg.get("layers_block_type"))
    if types is None:
        types = ["mamba"] * num_layers
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or not all(t in GRANITE_LAYER_KINDS for t in types)
    ):
        raise ValueError(
            f"{name}: config.json 'layer_types' {types!r:.120}: expected {num_layers} of "
            f"{sorted(GRANITE_LAYER_KINDS)}"
        )
    kinds = tuple(GRANITE_LAYER_KINDS[t] for t in types)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name} with hidden_act {cfg.get('hidden_act')!r} is not supported (SiLU only)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{name} with attention_bias (q/k/v and o_proj biases) is not supported")
    position = cfg.get("position_embedding_type")
    if position not in POSITION_TYPES:
        raise ValueError(
            f"{name}: position_embedding_type {position!r:.40} is not supported (none, 'nope' or 'rope')"
        )
    rope = (cfg.get("rope_parameters") or {}) if position == "rope" else {}
    num_heads = int(cfg["num_attention_heads"])
    experts = int(cfg.get("num_local_experts", 8) or 0)
    shared = int(cfg.get("shared_intermediate_size", 1024))
    routed: dict[str, Any] = {}
    if experts:
        routed = dict(
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(cfg.get("intermediate_size", 11008)),
            norm_topk_prob=True,  # a softmax over the top-k logits
            shared_mlp=True,
        )
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=shared,  # the shared MLP's: the dense MLP of every layer
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_scaling=dict(rope) if rope.get("rope_type", "default") != "default" else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        architecture=name,
        no_rope_layers=() if position == "rope" else tuple(range(num_layers)),
        embedding_multiplier=_multiplier(cfg, "embedding_multiplier", name),
        residual_multiplier=_multiplier(cfg, "residual_multiplier", name),
        attention_multiplier=_multiplier(cfg, "attention_multiplier", name),
        logits_scaling=_multiplier(cfg, "logits_scaling", name),
        **routed,
        layer_types=kinds,
        mixer_config=Mamba2Config.from_hf(cfg) if "mamba2" in kinds else None,
    )


def _multiplier(cfg: dict[str, Any], key: str, name: str) -> float:
    """One of Granite's multipliers; transformers' default for each is 1 (the attention's too:
    a softmax scale of 1, not 1 / sqrt(head_dim))."""
    value = cfg.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: {key} must be a number, found {value!r:.40}")
    return float(value)
