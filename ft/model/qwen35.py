"""Qwen3.5's blocks around its Gated DeltaNet (`ft.model.deltanet`): the gated full attention,
its RMSNorm, and what its `config.json` says. Qwen3.5-MoE and Qwen3-Next share all three.

- **Norms** scale by (1 + w): the files store each weight centred on zero, and the product is
  taken in float32 before the one rounding to the activations' dtype (`OffsetRMSNorm`). That is
  every norm of the model but the DeltaNet's gated one (plain w), q/k norms included.
- **Attention** (`GatedAttention`): `q_proj` gives each head its query and then its gate,
  `[heads, 2 * head_dim]`; q and k are RMSNormed per head before the rotary, which turns only
  the leading quarter of each head (`partial_rotary_factor`); the output of the heads is
  multiplied by sigmoid(gate) before `o_proj`. GQA as in Llama. Qwen3.5's rotary is a
  multimodal one (mrope); for text every position has three equal coordinates, and it is the
  plain rotary of `ft.model.llama` (`rope_cos_sin` over `attention_config`'s `rotary_dim`).
- **Layers**: `config.layer_types` names each layer `linear_attention` (DeltaNet) or
  `full_attention`; Qwen3.5's files hold the text model under `model.language_model.`.

`qwen35_config` reads a whole `config.json` as the hybrid decoder's (`ft.model.hybrid`)
`LlamaConfig`: the DeltaNet layers are its "gated_deltanet" mixer (`deltanet_mixer`,
`deltanet_weights`), the attention layers and every norm its "gated" attention kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ft.model.attention import AttentionMetadata, paged_attention, write_kv
from ft.model.deltanet import DeltaNetConfig, GatedDeltaNet, hf_weights
from ft.model.llama import ATTENTION, LlamaConfig, apply_rope, hf_moe

if TYPE_CHECKING:
    from ft.model.architectures import Architecture

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
DELTANET = "gated_deltanet"  # the DeltaNet layers' kind in `LlamaConfig.layer_types` (`hybrid.MIXERS`)


class OffsetRMSNorm(nn.Module):
    """RMSNorm times (offset + w), all in float32, rounded once (transformers' Qwen3.5 and
    Gemma norms). The weight stays as the file stores it (near zero), so a bfloat16 copy keeps
    its precision; folding 1 into it would round it to 1 + 2^-8 steps."""

    def __init__(self, dim: int, eps: float, offset: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.offset + self.weight.float())).to(x.dtype)


def split_gated_query(
    q_and_gate: torch.Tensor, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q_proj`'s output `[T, heads * 2 * head_dim]` (per head: query, then gate) → the queries
    `[T, heads, head_dim]` and the gate `[T, heads * head_dim]` in the attention output's order."""
    num_tokens = q_and_gate.shape[0]
    q, gate = q_and_gate.view(num_tokens, num_heads, 2 * head_dim).split(head_dim, dim=-1)
    return q, gate.reshape(num_tokens, num_heads * head_dim)


def gate_output(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The heads' output `[T, heads * head_dim]` times sigmoid(gate), before `o_proj`."""
    return attn * torch.sigmoid(gate)


class GatedAttention(nn.Module):
    """Qwen3.5's full-attention mixer over ft's paged KV cache: `x` (after the layer's input
    norm) → the attention's output `[T, hidden]`, before the residual add.

    `qkv_proj` is `q_proj | k_proj | v_proj` fused as stored (`q_proj`'s rows keep their per-head
    query/gate order); `config` is `attention_config`'s (heads, head size, `rotary_dim`, eps).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = self.config = config
        self.qkv_proj = nn.Linear(c.hidden_size, 2 * c.q_size + 2 * c.kv_size, bias=False)
        self.q_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, rotary_dim]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        c = self.config
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, 2 * q_size + 2 * kv_size]
        q_and_gate, k, v = qkv.split([2 * c.q_size, c.kv_size, c.kv_size], dim=-1)
        q, gate = split_gated_query(q_and_gate, c.num_heads, c.head_dim)  # [T, heads, hd], [T, q_size]
        q = apply_rope(self.q_norm(q), cos, sin)  # per head, before the rotary
        k = apply_rope(self.k_norm(k.view(num_tokens, c.num_kv_heads, c.head_dim)), cos, sin)
        v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)  # [T, kvh, hd]
        write_kv(k_cache, v_cache, k, v, meta)
        attn = paged_attention(q, k_cache, v_cache, meta)  # [T, heads * hd]
        out: torch.Tensor = self.o_proj(gate_output(attn, gate))
        return out


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a `config.json` (Qwen3.5's files nest it in `text_config`)."""
    nested = cfg.get("text_config")
    return nested if isinstance(nested, Mapping) else cfg


def layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """Each layer's mixer, `linear_attention` or `full_attention` (transformers' default when
    the file lists none: every `full_attention_interval`-th layer, 4, is attention).

    Raises:
        ValueError: the list has another kind, or not one entry per layer.
    """
    text = text_config(cfg)
    num_layers = int(text["num_hidden_layers"])
    kinds = text.get("layer_types")
    if kinds is None:
        interval = int(text.get("full_attention_interval", 4))
        kinds = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise ValueError(
            f"layer_types {kinds!r}: expected {num_layers} of {LINEAR_ATTENTION}/{FULL_ATTENTION}"
        )
    return tuple(kinds)


def attention_config(cfg: Mapping[str, Any]) -> LlamaConfig:
    """The attention layers' shapes and rotary as a `LlamaConfig` (so `rope_inv_freq` and
    `rope_cos_sin` give their tables): per-head q/k norms, norms offset by 1, a partial rotary.

    Raises:
        ValueError: attention biases or a rotary scaling (neither is in Qwen3.5's files).
    """
    text = text_config(cfg)
    rope = dict(text.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default" or text.get("rope_scaling"):
        raise ValueError(f"Qwen3.5 attention with rotary scaling {rope or text.get('rope_scaling')!r}")
    if text.get("attention_bias"):
        raise ValueError("Qwen3.5 attention with biases is not supported")
    num_heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // num_heads)
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    return LlamaConfig(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text.get("intermediate_size") or 0),
        num_layers=int(text["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qk_norm=True,
        norm_offset=1.0,
        rotary_dim=int(head_dim * factor),
        architecture=str(text.get("model_type", "qwen3_5")),
    )


def deltanet_from_hf(cfg: Mapping[str, Any]) -> GatedDeltaNet:
    """An (unloaded) Gated DeltaNet mixer of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next `config.json`."""
    return GatedDeltaNet(DeltaNetConfig.from_hf(text_config(cfg)))


def hf_attention_weights(sd: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """One attention layer's Hugging Face weights under `prefix` (e.g. `model.layers.3.self_attn.`)
    → `GatedAttention`'s names (the norms' weights as stored: the module adds the 1)."""
    return {
        "qkv_proj.weight": torch.cat([sd[prefix + f"{name}_proj.weight"] for name in ("q", "k", "v")]),
        "q_norm.weight": sd[prefix + "q_norm.weight"],
        "k_norm.weight": sd[prefix + "k_norm.weight"],
        "o_proj.weight": sd[prefix + "o_proj.weight"],
    }


def qwen35_config(arch: Architecture, cfg: Mapping[str, Any]) -> LlamaConfig:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next `config.json` (a multimodal checkpoint's
    `text_config`) as the hybrid decoder's `LlamaConfig`: `attention_config`'s shapes and rotary,
    each layer's kind (`DELTANET` or attention), the DeltaNet's shapes as `mixer_config`, and
    the MoE families' experts with their shared expert. `norm_offset` stays 0: the norms add
    their 1 themselves (`OffsetRMSNorm`), nothing is folded into the weights at load.

    Raises:
        ValueError: a value ft does not run, or an inconsistent one.
    """
    text = dict(text_config(cfg))
    moe: dict[str, Any] = {}
    if arch.moe:
        # Qwen3-Next's transformers default (Qwen3.5-MoE always renormalizes: `router_renormalizes`)
        moe = hf_moe(arch, {"norm_topk_prob": True, **text})
    config = dataclasses.replace(
        attention_config(cfg),
        architecture=arch.name,
        norm_offset=0.0,
        layer_types=tuple(ATTENTION if kind == FULL_ATTENTION else DELTANET for kind in layer_types(cfg)),
        mixer_config=DeltaNetConfig.from_hf(text),
        **moe,
    )
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if dense and config.intermediate_size < 1:
        raise ValueError(f"{arch.name}: dense MLP layers {dense[:8]} but no positive intermediate_size")
    return config


def _deltanet_config(config: LlamaConfig, index: int = -1) -> DeltaNetConfig:
    """`config.mixer_config`, which `qwen35_config` made a `DeltaNetConfig`.

    Raises:
        ValueError: it is not one.
    """
    settings = config.mixer_config
    if not isinstance(settings, DeltaNetConfig):
        raise ValueError(
            f"layer {index}: a Gated DeltaNet's settings are not a DeltaNetConfig: {settings!r:.80}"
        )
    return settings


def deltanet_mixer(config: LlamaConfig, index: int) -> GatedDeltaNet:
    """Layer `index`'s Gated DeltaNet (the `hybrid.MIXERS` row's build)."""
    return GatedDeltaNet(_deltanet_config(config, index))


def deltanet_weights(
    config: LlamaConfig, sd: Mapping[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    """A DeltaNet layer's Hugging Face weights under `prefix` → `GatedDeltaNet`'s names (either
    layout, `deltanet.hf_weights`)."""
    return hf_weights(_deltanet_config(config), sd, prefix)
