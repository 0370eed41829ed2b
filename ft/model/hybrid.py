"""Hybrid decoders: attention layers and recurrent layers in one stack (LFM2's short
convolutions, Granite 4.0-H's Mamba-2, and Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's Gated
DeltaNet).

Each layer's kind is `LlamaConfig.layer_types[i]`: "attention" attends over the KV pages, any
other names a row of `MIXERS`, a recurrent mixer (`ft.model.recurrent.RecurrentMixer`) that
takes the attention's place in a `MixerLayer`, between the same input norm, residual and MLP.
What the attention layers and the norms are is the family's `AttentionKind` (its entry's
`hybrid_attention`, a row of `ATTENTIONS`): the Llama family's `DecoderLayer` and RMSNorm
(LFM2, Granite 4.0-H), or a module of its own in an `AttentionLayer` and a norm of its own
(Qwen3.5's gated attention and (1 + w) norms). A mixer's past is a fixed-size state per
sequence, which the runner holds in slots (`recurrent.StateTensors`) and passes in with the
step's spans; the model returns the new states and the runner writes them once the whole step
has succeeded.

Adding a mixer is one `MixerKind` row: its layer-kind name, how to build it from the config
(its own settings are one record, `LlamaConfig.mixer_config`), its module's name in Hugging
Face checkpoints and, if they need renaming or fusing, the map of its weights.
A family whose `config.json` lists its layers its own way adds its parser to `HF_CONFIGS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ft.model.attention import AttentionMetadata
from ft.model.granite_hybrid import granite_hybrid_config
from ft.model.llama import (
    ATTENTION,
    DecoderLayer,
    LlamaConfig,
    LlamaForCausalLM,
    NormFactory,
    Reduce,
    RMSNorm,
)
from ft.model.mamba2 import Mamba2Config, Mamba2Mixer, mamba2_weights_from_hf
from ft.model.qwen35 import (
    DELTANET,
    GatedAttention,
    OffsetRMSNorm,
    deltanet_mixer,
    deltanet_weights,
    hf_attention_weights,
    qwen35_config,
)
from ft.model.recurrent import RecurrentMixer, StateSpan
from ft.model.short_conv import ShortConv, ShortConvConfig

if TYPE_CHECKING:
    from ft.core.batch import Heartbeat
    from ft.model.architectures import Architecture

StateList = list[tuple[torch.Tensor, ...]]  # one entry per span: a layer's state tensors after it


HfWeights = Callable[[LlamaConfig, Mapping[str, torch.Tensor], str], dict[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class MixerKind:
    """One kind of recurrent layer: its name in `LlamaConfig.layer_types`; how its mixer is
    built (`build(config, layer index)`: an `nn.Module` that is a `RecurrentMixer`, its own
    settings read from `config.mixer_config`); the name of its module under `model.layers.N.`
    in Hugging Face checkpoints; and `hf_weights(config, state dict, "model.layers.N.<module>.")`
    → the mixer's own state dict, None when its weights keep their names below the module
    (`model.layers.N.<hf_module>.X` is the mixer's `X`)."""

    name: str
    build: Callable[[LlamaConfig, int], nn.Module]
    hf_module: str
    hf_weights: HfWeights | None = None


def _mamba2(config: LlamaConfig, index: int) -> nn.Module:
    """Granite 4.0-H's Mamba-2 mixer, of the shapes `config.mixer_config` holds."""
    settings = config.mixer_config
    if not isinstance(settings, Mamba2Config):
        raise ValueError(
            f"layer {index}: a Mamba-2 layer's settings are not a Mamba2Config: {settings!r:.80}"
        )
    return Mamba2Mixer(settings)


def _mamba2_weights(
    config: LlamaConfig, sd: Mapping[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    """A Mamba-2 layer's checkpoint weights as its mixer's (`conv1d.weight` squeezed, `A_log` as A)."""
    return mamba2_weights_from_hf(sd, prefix)


MIXERS: dict[str, MixerKind] = {
    kind.name: kind
    for kind in (
        MixerKind("short_conv", ShortConv, "conv"),  # LFM2
        MixerKind("mamba2", _mamba2, "mamba", _mamba2_weights),  # Granite 4.0-H
        MixerKind(DELTANET, deltanet_mixer, "linear_attn", deltanet_weights),  # Qwen3.5, Qwen3-Next
    )
}


@dataclass(frozen=True, slots=True)
class AttentionKind:
    """What a hybrid family's attention layers and norms are: `norm(dim, eps)` builds every norm
    of the stack (each layer's two and the final one); `build(config)` the attention module of
    an attention layer (`AttentionLayer`: called with the normed rows, the rotary tables, the
    layer's KV caches and the metadata, it returns the attention's output before the
    residual), None for the Llama family's `DecoderLayer`; `hf_weights(state dict,
    "model.layers.N.self_attn.")` → that module's weights (None: as the Llama family's)."""

    name: str
    norm: NormFactory
    build: Callable[[LlamaConfig], nn.Module] | None = None
    hf_weights: Callable[[Mapping[str, torch.Tensor], str], dict[str, torch.Tensor]] | None = None


ATTENTIONS: dict[str, AttentionKind] = {
    kind.name: kind
    for kind in (
        AttentionKind("llama", RMSNorm),  # LFM2, Granite 4.0-H
        # Qwen3.5, Qwen3.5-MoE, Qwen3-Next: a gated query, (1 + w) norms in float32
        AttentionKind("gated", OffsetRMSNorm, GatedAttention, hf_attention_weights),
    )
}


def attention_kind(config: LlamaConfig) -> AttentionKind:
    """The attention kind of `config`'s family (its entry's `hybrid_attention`)."""
    from ft.model.architectures import by_name

    return ATTENTIONS[by_name(config.architecture).hybrid_attention]


def check_layer_types(config: LlamaConfig) -> None:
    """`config.layer_types` has one known kind per layer, and at least one attention layer.

    Raises:
        ValueError: it does not (with no attention layer no page would hold a byte: the KV
            cache's layout and budget need one).
    """
    kinds = {ATTENTION, *MIXERS}
    if len(config.layer_types) != config.num_layers or not set(config.layer_types) <= kinds:
        raise ValueError(
            f"layer types {list(config.layer_types)!r:.120}: expected {config.num_layers} of {sorted(kinds)}"
        )
    if ATTENTION not in config.layer_types:
        raise ValueError(
            f"{config.architecture}: {config.num_layers} recurrent layers and no attention layer; "
            "a model without attention layers is not supported yet"
        )


class MixerLayer(DecoderLayer):
    """A recurrent layer: the input norm, its mixer where attention would be, the residual, and
    the same MLP (or experts) after it as an attention layer's (`DecoderLayer.feed_forward`)."""

    def __init__(self, config: LlamaConfig, reduce: Reduce | None, index: int, norm: NormFactory) -> None:
        super().__init__(config, reduce, index, attention=False, norm=norm)
        self.mixer = MIXERS[config.layer_types[index]].build(config, index)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, spans: Sequence[StateSpan], states: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, StateList]:
        """`x` `[T, hidden]` → the layer's output, and each span's new states (`states`: this
        layer's slot tensors, read only)."""
        mixed, new = self.mixer(self.input_layernorm(x), spans, states)  # [T, hidden]
        h = x + self._residual(mixed if self.attn_out_norm is None else self.attn_out_norm(mixed))
        return self.feed_forward(h), new


class AttentionLayer(DecoderLayer):
    """An attention layer whose attention is its family's own module (`AttentionKind.build`'s,
    `attention`): the input norm, that attention over the layer's KV caches, the residual, and
    the MLP (or experts) as any layer's."""

    def __init__(
        self, config: LlamaConfig, reduce: Reduce | None, index: int, norm: NormFactory, attention: nn.Module
    ) -> None:
        super().__init__(config, reduce, index, attention=False, norm=norm)
        self.attention = attention

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)  # [T, hidden]
        h = x + self._residual(attn if self.attn_out_norm is None else self.attn_out_norm(attn))
        return self.feed_forward(h)


class HybridForCausalLM(LlamaForCausalLM):
    """A decoder whose layers are attention (`DecoderLayer`, or the family's `AttentionLayer`)
    or recurrent (`MixerLayer`), chosen per layer by `config.layer_types`, with the family's
    norms (`AttentionKind`); the KV caches hold the attention layers only."""

    def __init__(
        self, config: LlamaConfig, reduce: Reduce | None = None, lm_head_rows: int | None = None
    ) -> None:
        super().__init__(config, reduce, lm_head_rows)
        self.norm = attention_kind(config).norm(config.hidden_size, config.rms_norm_eps)

    def _make_layer(self, config: LlamaConfig, reduce: Reduce | None, index: int) -> nn.Module:
        kind = attention_kind(config)
        if not config.is_attention_layer(index):
            return MixerLayer(config, reduce, index, kind.norm)
        if kind.build is None:
            return DecoderLayer(config, reduce, index, norm=kind.norm)
        return AttentionLayer(config, reduce, index, kind.norm, kind.build(config))

    def state_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """Each recurrent layer's state shapes for one sequence, in layer order."""
        return [_mixer(layer.mixer).state_shapes() for layer in self.layers if isinstance(layer, MixerLayer)]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        k_caches: torch.Tensor,  # [attention layers, num_slots, kv_heads, head_dim]
        v_caches: torch.Tensor,
        meta: AttentionMetadata,
        spans: Sequence[StateSpan],
        states: Sequence[Sequence[torch.Tensor]],  # per recurrent layer, its slot tensors
        heartbeat: Heartbeat | None = None,
    ) -> tuple[torch.Tensor, list[StateList]]:
        """Hidden states after the final norm `[T, hidden]`, and per recurrent layer the new
        states of each span (nothing is written: the runner does, once the step succeeded)."""
        x, (cos, sin), local = self.embed(input_ids, positions)
        new_states: list[StateList] = []
        kv = 0
        for layer in self.layers:
            if isinstance(layer, MixerLayer):
                x, new = layer(x, spans, states[len(new_states)])
                new_states.append(new)
            else:
                layer_cos, layer_sin = local if layer.window else (cos, sin)
                x = layer(x, layer_cos, layer_sin, k_caches[kv], v_caches[kv], meta)
                kv += 1
            if heartbeat is not None:
                heartbeat.beat()
        out: torch.Tensor = self.norm(x)
        return out, new_states


def _mixer(module: object) -> RecurrentMixer:
    """A mixer module, as the contract it keeps (`MixerKind.build` makes only those)."""
    return cast("RecurrentMixer", module)


def layer_weights(
    config: LlamaConfig, sd: dict[str, torch.Tensor], layer: int
) -> dict[str, torch.Tensor] | None:
    """Layer `layer`'s weights that are its hybrid family's own, under the fused layout's names:
    a recurrent layer's mixer's (`mixer_weights`), or an attention layer's own attention's
    (`layers.N.attention.X`); None when they are the Llama family's attention's."""
    if not config.is_attention_layer(layer):
        return mixer_weights(config, sd, layer)
    kind = attention_kind(config)
    if kind.hf_weights is None:
        return None
    own = kind.hf_weights(sd, f"model.layers.{layer}.self_attn.")
    return {f"layers.{layer}.attention.{k}": w for k, w in own.items()}


def mixer_weights(config: LlamaConfig, sd: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Recurrent layer `layer`'s mixer weights from a Hugging Face state dict, under the fused
    layout's names (`layers.N.mixer.X`)."""
    kind = MIXERS[config.layer_types[layer]]
    prefix = f"model.layers.{layer}.{kind.hf_module}."
    own = (
        kind.hf_weights(config, sd, prefix)
        if kind.hf_weights is not None
        else {k.removeprefix(prefix): w for k, w in sd.items() if k.startswith(prefix)}
    )
    return {f"layers.{layer}.mixer.{k}": w for k, w in own.items()}


def state_shapes(config: LlamaConfig) -> list[tuple[tuple[int, ...], ...]]:
    """Each recurrent layer's state shapes, from the config alone (mixers built on meta)."""
    with torch.device("meta"):
        return [
            _mixer(MIXERS[kind].build(config, i)).state_shapes()
            for i, kind in enumerate(config.layer_types)
            if kind != ATTENTION
        ]


def state_slot_bytes(config: LlamaConfig) -> int:
    """The bytes one sequence's recurrent state takes over all layers (float32)."""
    return 4 * sum(math.prod(shape) for layer in state_shapes(config) for shape in layer)


# --- config.json ------------------------------------------------------------------------------


def hybrid_config(arch: Architecture, cfg: dict[str, Any]) -> LlamaConfig:
    """A hybrid family's `config.json` as a `LlamaConfig` (its parser in `HF_CONFIGS`).

    Raises:
        ValueError: a value ft does not run, or an inconsistent one.
    """
    return HF_CONFIGS[arch.name](arch, cfg)


LFM2_LAYER_KINDS = {"full_attention": ATTENTION, "conv": "short_conv"}


def _lfm2_config(arch: Architecture, cfg: dict[str, Any]) -> LlamaConfig:
    """LFM2 (transformers' `Lfm2Config`): `layer_types` ("conv" / "full_attention"), or
    `full_attn_idxs`; the MLP width adjusted as `Lfm2MLP` does; older spellings
    (`block_ff_dim`, `tie_embedding`, a top-level `rope_theta`) read as transformers reads them."""
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        attends = cfg.get("full_attn_idxs")
        attends = range(num_layers) if attends is None else attends
        types = ["full_attention" if i in attends else "conv" for i in range(num_layers)]
    if not isinstance(types, list) or not all(t in LFM2_LAYER_KINDS for t in types):
        raise ValueError(
            f"{arch.name}: config.json 'layer_types' {types!r:.120}: expected {sorted(LFM2_LAYER_KINDS)}"
        )
    ffn = cfg.get("block_ff_dim", cfg.get("intermediate_size"))
    if not isinstance(ffn, int) or isinstance(ffn, bool) or ffn < 1:
        raise ValueError(f"{arch.name}: config.json lacks a positive intermediate_size, found {ffn!r:.40}")
    if cfg.get("block_auto_adjust_ff_dim", True):
        ffn = int(2 * ffn / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            ffn = multiple * -(-int(float(multiplier) * ffn) // multiple)
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    num_heads = int(cfg["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=ffn,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or 0),
        rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling=dict(rope) if rope.get("rope_type", "default") != "default" else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128_000)),
        tie_word_embeddings=bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))),
        qk_norm=arch.qk_norm,
        architecture=arch.name,
        layer_types=tuple(LFM2_LAYER_KINDS[t] for t in types),
        mixer_config=ShortConvConfig(int(cfg.get("conv_L_cache", 3)), bool(cfg.get("conv_bias", False))),
    )


HF_CONFIGS: dict[str, Callable[[Architecture, dict[str, Any]], LlamaConfig]] = {
    "lfm2": _lfm2_config,
    "granite_hybrid": granite_hybrid_config,
    "qwen3_5": qwen35_config,
    "qwen3_5_moe": qwen35_config,
    "qwen3_next": qwen35_config,
}
