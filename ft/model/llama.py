"""The Llama-family decoder over a paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm), the mixtures of experts Qwen3-MoE, Mixtral and OLMoE (whole-q/k
RMSNorm; experts from `moe.py`), Gemma 2/3 (flags: GeGLU, post norms, soft-caps, windows),
Phi-3/Phi-4-mini (partial rotary, longrope), SmolLM3 (layers without rotary) and Granite
(embedding, residual, attention and logit multipliers); which blocks a family uses is its
`architectures` entry. A hybrid model (LFM2, Granite 4.0-H: its experts beside a shared MLP,
`LlamaConfig.shared_mlp`) has recurrent layers among these attention ones: their kinds are
`LlamaConfig.layer_types`, and `ft.model.hybrid` builds the stack."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ft.model.attention import AttentionMetadata, paged_attention, write_kv
from ft.model.moe import SparseMoE, fuse_experts, moe_prefix

if TYPE_CHECKING:
    from ft.core.batch import Heartbeat
    from ft.model.architectures import Architecture

ROPE_SCALING_TYPES = ("linear", "llama3", "longrope")
ATTENTION = "attention"  # a layer kind (`LlamaConfig.layer_types`); the others are recurrent mixers'
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


Progress = Callable[[float], None]  # called with the fraction of weights loaded
Rotary = tuple[torch.Tensor, torch.Tensor]  # cos and sin `[T, 1, rotary_dim]`
Reduce = Callable[[torch.Tensor], torch.Tensor]  # sums a row-parallel output over the ranks
NormFactory = Callable[[int, float], nn.Module]  # (dim, eps) -> a norm module


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Shapes and hyperparameters of one Llama-family model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", "factor", ...}
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs.weight` (llama3 files)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary embedding (Qwen3)
    # mixture of experts (Qwen3-MoE, Mixtral, OLMoE): every layer's MLP is `num_experts` experts of
    # `moe_intermediate_size`, `num_experts_per_tok` of them per token; 0 experts: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones (Qwen3.5-MoE); 0: none
    # the layers whose MLP stays dense (of `intermediate_size`) in a mixture of experts (Qwen3-MoE's
    # `mlp_only_layers` and `decoder_sparse_step`)
    mlp_only_layers: tuple[int, ...] = ()
    qk_norm_whole: bool = False  # OLMoE: q/k RMSNorm over the whole projections, not per head
    # a routed layer also runs the dense MLP (of `intermediate_size`) and adds its output to the
    # experts' (Granite 4.0-H's `shared_mlp`)
    shared_mlp: bool = False
    architecture: str = "llama"
    pooling: str | None = None  # how the file says to pool embeddings (GGUF `{arch}.pooling_type`)
    # Gemma 2/3 and sliding windows (Gemma, Mistral):
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    embed_scale: bool = False  # embeddings times sqrt(hidden), in the embedding's dtype (Gemma)
    post_norms: bool = False  # an RMSNorm on the attention's and on the MLP's output (Gemma)
    # the offset folded into the stored norm weights at load, which scale by (offset + w): 1 in
    # Gemma's HF files (0 for a hybrid family whose norm module adds it: Qwen3.5's `OffsetRMSNorm`)
    norm_offset: float = 0.0
    query_scale: float = 0.0  # the softmax scale of q.k; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # attention scores as tanh(s / cap) * cap (Gemma 2); 0: none
    final_softcap: float = 0.0  # the same on the logits
    sliding_window: int = 0  # positions a windowed layer attends, its own included; 0: none
    sliding_layers: tuple[bool, ...] = ()  # which layers are windowed; empty: all of them
    rope_local_theta: float = 0.0  # rotary base of the windowed layers, unscaled (Gemma 3); 0: as the others
    # Phi-3 / SmolLM3 / Granite blocks; each default is "as Llama"
    rotary_dim: int = 0  # leading dims of each head the rotary turns, the rest pass (0: all of it)
    rope_context: int = 0  # longest sequence served (0: max_position_embeddings): picks longrope's factors
    no_rope_layers: tuple[int, ...] = ()  # layers without the rotary embedding (SmolLM3's NoPE layers)
    embedding_multiplier: float = 1.0  # the embedding scaled (Granite)
    residual_multiplier: float = 1.0  # each residual branch scaled before its add (Granite)
    attention_multiplier: float = 0.0  # the softmax scale, 0: 1 / sqrt(head_dim) (Granite)
    logits_scaling: float = 1.0  # the logits divided by it (Granite)
    # Hybrid models (`ft.model.hybrid`): each layer's kind, "attention" or a recurrent mixer's
    # (`hybrid.MIXERS`: "short_conv", "mamba2"); empty: every layer attends. `mixer_config` is the
    # mixers' own settings, a frozen record of the mixer's module (LFM2: `ShortConvConfig`,
    # Granite 4.0-H: `Mamba2Config`).
    layer_types: tuple[str, ...] = ()
    mixer_config: object | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts and not (
            1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size >= 1
        ):
            raise ValueError(
                f"{self.num_experts_per_tok} experts per token of {self.num_experts} experts of "
                f"{self.moe_intermediate_size}: expected 1 to {self.num_experts} per token, positive sizes"
            )
        if self.shared_mlp and not self.num_experts:
            raise ValueError("a shared MLP beside the experts needs experts")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"hidden activation {self.hidden_act!r} is not supported "
                f"(supported: {', '.join(HIDDEN_ACTS)})"
            )
        if self.sliding_window < 0 or (self.sliding_layers and len(self.sliding_layers) != self.num_layers):
            raise ValueError(
                f"a sliding window of {self.sliding_window} over {len(self.sliding_layers)} layer flags: "
                f"expected a positive window and one flag per layer ({self.num_layers})"
            )
        if min(self.query_scale, self.attn_softcap, self.final_softcap, self.rope_local_theta) < 0:
            raise ValueError("query scale, soft-caps and the local rotary base must not be negative")
        if self.rotary_dim == self.head_dim:
            object.__setattr__(self, "rotary_dim", 0)  # one spelling of "the whole head"
        self._check_phi_smollm_granite()
        if self.layer_types:
            from ft.model.hybrid import check_layer_types

            check_layer_types(self)
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind == "su":  # Phi-3's first name for longrope
                kind = "longrope"
                object.__setattr__(self, "rope_scaling", {**self.rope_scaling, "rope_type": kind})
            if kind == "default":
                object.__setattr__(self, "rope_scaling", None)
            elif kind not in ROPE_SCALING_TYPES:
                raise ValueError(
                    f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)})"
                )
            elif kind == "longrope":
                _check_longrope(self.rope_scaling, self.rotary_width)

    def _check_phi_smollm_granite(self) -> None:
        """The partial rotary, the layers without it and the multipliers are in range."""
        if self.rotary_dim and not (2 <= self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(
                f"a rotary over {self.rotary_dim} dims of heads of {self.head_dim}: expected an even "
                f"number from 2 to {self.head_dim}"
            )
        if any(not 0 <= i < self.num_layers for i in self.no_rope_layers):
            raise ValueError(
                f"layers without rotary {list(self.no_rope_layers)} are not all among the "
                f"{self.num_layers} layers"
            )
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if not (math.isfinite(value) and (value > 0 or (value == 0 and name == "attention_multiplier"))):
                raise ValueError(f"{name} {value!r} is not a positive finite number")
        if self.attention_multiplier and self.query_scale:
            # NOTE: both paths scale q by attention_multiplier * sqrt(head_dim), then the scores by
            # query_scale: the product of the two would be neither family's softmax scale.
            raise ValueError(
                f"attention_multiplier {self.attention_multiplier} and query_scale {self.query_scale}: "
                "two softmax scales (Granite's and Gemma's), at most one may be set"
            )

    @property
    def rotary_width(self) -> int:
        """The dims of each head the rotary turns (the leading ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def is_long_rope(self) -> bool:
        """Whether longrope runs its long factors: the served context passes the trained one
        (llama.cpp's choice; transformers picks per forward by the sequence's length)."""
        scaling = self.rope_scaling
        if scaling is None or scaling.get("rope_type", scaling.get("type")) != "longrope":
            return False
        context = self.rope_context or self.max_position_embeddings
        return context > int(scaling["original_max_position_embeddings"])

    def is_attention_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends (its past in KV pages), rather than being recurrent."""
        return not self.layer_types or self.layer_types[layer] == ATTENTION

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer is recurrent (a per-sequence state instead of KV)."""
        return not all(self.is_attention_layer(i) for i in range(self.num_layers))

    @property
    def num_kv_layers(self) -> int:
        """The layers whose keys and values the KV pages hold (the attention layers)."""
        return sum(self.is_attention_layer(i) for i in range(self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the routed experts."""
        return bool(self.num_experts) and layer not in self.mlp_only_layers

    @property
    def q_size(self) -> int:
        """Width of the query projection."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """`(kv_heads, head_dim)` of each layer that stores keys and values, in layer order
        (`ft.model.kv_layout`): every attention layer (a hybrid's recurrent layers store none),
        of one shape (Gemma 4's differ)."""
        return ((self.num_kv_heads, self.head_dim),) * self.num_kv_layers

    @property
    def score_cost(self) -> float:
        """What scoring a position (its row through the lm_head, for prompt logprobs) costs beside
        feeding a token through the layers, in multiply-adds: 0.27 on the default model."""
        attention = self.hidden_size * (2 * self.q_size + 2 * self.kv_size)  # q, k, v, o
        dense = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        routed = self.num_experts_per_tok * 3 * self.hidden_size * self.moe_intermediate_size
        routed += 3 * self.hidden_size * self.shared_expert_intermediate_size
        moe = routed + (dense if self.shared_mlp else 0)
        layers = sum(attention + (moe if self.is_moe_layer(i) else dense) for i in range(self.num_layers))
        return self.vocab_size * self.hidden_size / layers

    def layer_window(self, layer: int) -> int:
        """The positions layer `layer` attends (its own included), 0 for all of them."""
        if not self.sliding_window or (self.sliding_layers and not self.sliding_layers[layer]):
            return 0
        return self.sliding_window

    @property
    def is_all_windowed(self) -> bool:
        """Every layer attends a window only (pages behind it are never read again)."""
        return bool(self.sliding_window) and all(self.sliding_layers or (True,))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict (any family of `ft.model.architectures`).

        Raises:
            ValueError: the family is not supported, or a value is inconsistent.
        """
        from ft.model.architectures import by_hf

        arch = by_hf(cfg)
        if arch.decoder == "gemma4":
            from ft.model.gemma4_config import gemma4_config

            return gemma4_config(cfg)
        if arch.gemma:
            return cls._from_hf_gemma(cfg)
        if arch.mixer is not None:
            from ft.model.hybrid import hybrid_config

            return hybrid_config(arch, cfg)
        if cfg.get("use_sliding_window"):
            raise ValueError(
                f"{arch.name} with use_sliding_window is not supported (sliding-window attention)"
            )
        moe = hf_moe(arch, cfg) if arch.moe else {}
        num_heads = int(cfg["num_attention_heads"])
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers 5.x spelling
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        head_dim = int(cfg.get("head_dim") or 0) or int(cfg["hidden_size"]) // num_heads
        blocks = _phi_smollm_granite_from_hf(cfg, arch, head_dim, rope_params, rope_scaling)
        if blocks.pop("longrope", None) is not None:
            rope_scaling = dict(rope_scaling or {})
            rope_scaling.setdefault(
                "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
            )
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch.qkv_bias)),
            qk_norm=arch.qk_norm,
            qk_norm_whole=arch.qk_norm_whole,
            architecture=arch.name,
            hidden_act="silu",  # (`_hf_blocks` refuses any other: "swish" is its other name)
            sliding_window=_window(cfg) if arch.windowed else 0,
            **moe,
            **blocks,
        )

    @classmethod
    def _from_hf_gemma(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Gemma 2 / Gemma 3 text from its `config.json`, old spellings (`rope_local_base_freq`,
        `sliding_window_pattern`, `rope_scaling`) and transformers 5's (`layer_types`, a
        `rope_parameters` per layer type) alike."""
        from ft.model.architectures import by_hf

        arch = by_hf(cfg)
        text = cfg.get("text_config")
        if arch.hf_text_defaults and isinstance(text, dict):  # a multimodal checkpoint's text model
            cfg = {**arch.hf_text_defaults, **text, "architectures": []}
            cfg.setdefault("model_type", arch.hf_model_types[0])
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{arch.name} with use_bidirectional_attention (an encoder) is not supported")
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads)
        window = _window(cfg)
        sliding: tuple[bool, ...] = ()
        if window:
            types = cfg.get("layer_types")
            if types is not None:
                if not isinstance(types, list) or len(types) != num_layers or not set(types) <= LAYER_TYPES:
                    raise ValueError(
                        f"config.json 'layer_types': expected {num_layers} of {sorted(LAYER_TYPES)}, "
                        f"found {types!r:.120}"
                    )
                sliding = tuple(t == "sliding_attention" for t in types)
            else:
                period = int(cfg.get("sliding_window_pattern", arch.sliding_period))
                sliding = tuple(i % period < period - 1 for i in range(num_layers))
        # the global layers' rotary base and scaling, and the windowed layers' base
        rope = cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling") or None
        local_theta = cfg.get("rope_local_base_freq", arch.local_rope_theta)
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            full, local = rope["full_attention"], rope.get("sliding_attention") or {}
            rope_theta = full.get("rope_theta", rope_theta)
            rope_scaling = dict(full) if full.get("rope_type", "default") != "default" else None
            local_theta = local.get("rope_theta", local_theta)
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"{arch.name}: rope scaling on the sliding layers is not supported")
        elif isinstance(rope, dict):
            rope_theta = rope.get("rope_theta", rope_theta)
            if rope.get("rope_type", "default") != "default":
                rope_scaling = dict(rope)
        if float(local_theta or 0) == float(rope_theta) and rope_scaling is None:
            local_theta = 0.0  # the windowed layers turn as the others
        # NOTE: Gemma 2/3 read `hidden_activation` only (transformers' default: tanh GELU); a
        # `hidden_act` beside it ("gelu" in older conversions) is never used by their MLP.
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=arch.qk_norm,
            architecture=arch.name,
            hidden_act=str(act),
            embed_scale=True,
            post_norms=True,
            norm_offset=1.0,
            query_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=float(local_theta or 0.0),
        )


LAYER_TYPES = {"sliding_attention", "full_attention"}


def _window(cfg: dict[str, Any]) -> int:
    """`config.json`'s `sliding_window` (null or absent: none).

    Raises:
        ValueError: it is not a positive integer.
    """
    window = cfg.get("sliding_window")
    if window is None:
        return 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"config.json 'sliding_window': expected a positive integer, found {window!r:.40}")
    return window


def hf_moe(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of `config.json` (Qwen3-MoE, Mixtral, OLMoE spellings; a
    shared expert's width, Qwen3.5-MoE's and Qwen3-Next's).

    Raises:
        ValueError: a value is missing or of a kind ft does not run (OLMoE's `clip_qkv` or its
            o_proj bias).
    """
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes the latter
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise ValueError(f"{arch.name}: config.json lacks a positive num_experts, found {experts!r}")
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"{arch.name} with clip_qkv {cfg['clip_qkv']!r} is not supported")
    if arch.qk_norm_whole and cfg.get("attention_bias"):
        raise ValueError(f"{arch.name} with attention_bias (an o_proj bias) is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    step = cfg.get("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{arch.name}: decoder_sparse_step must be a positive integer, found {step!r}")
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise ValueError(
            f"{arch.name}: mlp_only_layers must list layers 0 to {num_layers - 1}, found {dense!r:.80}"
        )
    # transformers' rule (Qwen3-MoE): a layer is routed unless listed, and only every `step`-th
    mlp_only = tuple(i for i in range(num_layers) if i in dense or (i + 1) % step)
    renormalize = arch.router_renormalizes
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if renormalize is None else renormalize,
        mlp_only_layers=mlp_only,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def _phi_smollm_granite_from_hf(
    cfg: dict[str, Any],
    arch: Architecture,
    head_dim: int,
    rope_params: Any,
    rope_scaling: dict[str, Any] | None,
) -> dict[str, Any]:
    """`LlamaConfig` fields of Phi-3's partial rotary, SmolLM3's layers without rotary and
    Granite's multipliers, from `config.json` (absent keys: as Llama); "longrope" is set when
    the rope scaling is Phi-3's longrope (its `original_max_position_embeddings` may sit at the
    top level of older configs).

    Raises:
        ValueError: a block ft does not run (an MLP bias, an activation other than SiLU) or a
            value of the wrong type.
    """
    out: dict[str, Any] = {}
    family = arch.name
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # the decoder's MLP is SwiGLU
        raise ValueError(f"{family} with hidden_act {cfg.get('hidden_act')!r} is not supported (SiLU only)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{family} with mlp_bias is not supported")
    partial = cfg.get("partial_rotary_factor")
    if isinstance(rope_params, dict) and "partial_rotary_factor" in rope_params:
        partial = rope_params["partial_rotary_factor"]
    if partial is not None:
        if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise ValueError(f"partial_rotary_factor {partial!r}: expected a number in (0, 1]")
        out["rotary_dim"] = int(head_dim * partial)
    no_rope = cfg.get("no_rope_layers")  # SmolLM3: 1 = this layer rotates, 0 = it does not
    if no_rope is not None:
        if not isinstance(no_rope, list) or not all(
            v in (0, 1) and not isinstance(v, float) for v in no_rope
        ):
            raise ValueError(f"no_rope_layers must be a list of 0 and 1, found {no_rope!r:.80}")
        if len(no_rope) != int(cfg["num_hidden_layers"]):
            raise ValueError(
                f"no_rope_layers has {len(no_rope)} entries for {cfg['num_hidden_layers']} layers"
            )
        out["no_rope_layers"] = tuple(i for i, uses_rope in enumerate(no_rope) if not uses_rope)
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{key} must be a number, found {value!r:.40}")
        out[key] = float(value)
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
        "longrope",
        "su",
    ):
        out["longrope"] = True
    return out


def _check_longrope(scaling: dict[str, Any], rotary_dim: int) -> None:
    """Phi-3's longrope: a short and a long factor per rotary pair, the trained context."""
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if (
            not isinstance(factors, (list, tuple))
            or len(factors) != rotary_dim // 2
            or not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors)
        ):
            raise ValueError(
                f"longrope {key}: expected {rotary_dim // 2} positive numbers (one per rotary pair), "
                f"found {factors!r:.80}"
            )
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 2:
        raise ValueError(f"longrope needs original_max_position_embeddings of at least 2, found {original!r}")
    for key in ("factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"longrope {key} {value!r} is not a positive number")


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse rotary frequencies `[rotary_dim // 2]` in float32, with the config's scaling applied."""
    dim = config.rotary_width
    scaling = config.rope_scaling
    kind = scaling.get("rope_type", scaling.get("type")) if scaling is not None else None
    if scaling is not None and kind == "longrope":  # Phi-3: one factor per pair, long or short
        ext = scaling["long_factor"] if config.is_long_rope else scaling["short_factor"]
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * config.rope_theta**shape)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_local_inv_freq(config: LlamaConfig) -> torch.Tensor | None:
    """The windowed layers' inverse frequencies (their own base, no scaling), or None when they
    turn as the other layers."""
    if not config.rope_local_theta:
        return None
    local = LlamaConfig(**{**_fields(config), "rope_theta": config.rope_local_theta, "rope_scaling": None})
    return rope_inv_freq(LlamaConfig(**{**_fields(local), "rope_freq_factors": None}))


def _fields(config: LlamaConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}


def rope_attention_scale(config: LlamaConfig) -> float:
    """The factor cos and sin are multiplied by: longrope's sqrt(1 + ln(s) / ln(original)) for a
    context stretched s times (or its `attention_factor`), 1 otherwise."""
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[T, 1, rotary_dim]` for `positions` `[T]`, computed in float32 like
    transformers (times `scale`, longrope's attention factor)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by the half-split (HF) convention; with tables narrower
    than the head (partial rotary) only its leading `rotary_dim` dims turn, the rest pass."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def whole_qk_norm(
    q: torch.Tensor,  # [T, q_size]
    k: torch.Tensor,  # [T, kv_size]
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    reduce: Reduce | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMoE's RMSNorm over the whole q and the whole k projection (float32, as transformers).

    Under tensor parallelism each rank holds some heads: the squares and widths are summed over
    the ranks (one `reduce`), so every rank normalizes by the full projection's mean.
    """
    dtype = q.dtype
    q32, k32 = q.float(), k.float()
    ones = q32.new_ones(q32.shape[0])
    stats = torch.stack(
        [q32.pow(2).sum(-1), k32.pow(2).sum(-1), ones * q.shape[1], ones * k.shape[1]], dim=-1
    )
    if reduce is not None:
        stats = reduce(stats)  # [T, 4]: summed over the ranks
    q32 = q32 * torch.rsqrt(stats[:, :1] / stats[:, 2:3] + q_norm.eps)
    k32 = k32 * torch.rsqrt(stats[:, 1:2] / stats[:, 3:4] + k_norm.eps)
    return q_norm.weight * q32.to(dtype), k_norm.weight * k32.to(dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, with fused qkv and gate/up projections.

    Under tensor parallelism `config` holds this rank's heads and MLP columns, and `reduce`
    sums the row-parallel `o_proj` and `down_proj` outputs over the ranks (and OLMoE's whole-q/k
    norm statistics). `index` is this layer's place in the stack (its MLP, its window).
    `attention` False builds the norms and the MLP only (`feed_forward`): a hybrid's recurrent
    layer puts its mixer where the attention would be (`ft.model.hybrid.MixerLayer`). `norm`
    builds the layer's norms, `(dim, eps)` → a module (a hybrid family's own: `hybrid.AttentionKind`).
    """

    def __init__(
        self,
        config: LlamaConfig,
        reduce: Reduce | None = None,
        index: int = 0,
        *,
        attention: bool = True,
        norm: NormFactory | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.reduce = reduce
        self.window = config.layer_window(index)  # 0: attends every position
        self.uses_rope = index not in config.no_rope_layers
        # Granite's softmax scale, as a scale of q (the attention divides by sqrt(head_dim))
        self.q_scale = (
            config.attention_multiplier * math.sqrt(config.head_dim) if config.attention_multiplier else 1.0
        )
        make_norm = norm or RMSNorm
        self.input_layernorm = make_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = make_norm(config.hidden_size, config.rms_norm_eps)  # before the MLP
        # Gemma's norms of the attention's and the MLP's outputs (its HF names:
        # post_attention_layernorm and post_feedforward_layernorm)
        self.attn_out_norm = make_norm(config.hidden_size, config.rms_norm_eps) if config.post_norms else None
        self.mlp_out_norm = make_norm(config.hidden_size, config.rms_norm_eps) if config.post_norms else None
        if attention:
            qkv_out = config.q_size + 2 * config.kv_size
            self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
            whole = config.qk_norm_whole
            q_width, k_width = (config.q_size, config.kv_size) if whole else (config.head_dim,) * 2
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps) if config.qk_norm else None
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps) if config.qk_norm else None
            self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.moe = SparseMoE(config) if config.is_moe_layer(index) else None
        if self.moe is None or config.shared_mlp:
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        c = self.config
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        if c.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = whole_qk_norm(q, k, self.q_norm, self.k_norm, self.reduce)  # before the rotary
        q = q.reshape(num_tokens, c.num_heads, c.head_dim)  # [T, heads, hd]
        k = k.reshape(num_tokens, c.num_kv_heads, c.head_dim)  # [T, kvh, hd]
        if not c.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, before the rotary
        if self.uses_rope:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)  # [T, kvh, hd]
        write_kv(k_cache, v_cache, k, v, meta)
        attn = paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            windowed=self.window > 0,
            scale=c.query_scale or None,
            softcap=c.attn_softcap,
        )  # [T, heads * hd]
        o = self.o_proj(attn)  # [T, hidden] (this rank's heads' share under TP)
        o = o if self.reduce is None else self.reduce(o)
        h = x + self._residual(o if self.attn_out_norm is None else self.attn_out_norm(o))
        return self.feed_forward(h)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP (or the routed experts) after the mixer, with its norm and residual:
        `h` `[T, hidden]` → the layer's output."""
        c = self.config
        normed = self.post_attention_layernorm(h)
        d = self.moe(normed) if self.moe is not None else None  # [T, hidden]
        if d is None or c.shared_mlp:
            gate, up = self.gate_up_proj(normed).chunk(2, dim=-1)
            act = F.silu(gate) if c.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
            dense = self.down_proj(act * up)  # [T, hidden]
            d = dense if d is None else d + dense  # (under TP both are partial sums: one reduce)
        d = d if self.reduce is None else self.reduce(d)
        out: torch.Tensor = h + self._residual(d if self.mlp_out_norm is None else self.mlp_out_norm(d))
        return out

    def _residual(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch before its residual add, times Granite's residual multiplier."""
        m = self.config.residual_multiplier
        return branch if m == 1.0 else branch * m


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder stack, final norm and (possibly tied) lm_head.

    `lm_head_rows` is this rank's slice of the vocabulary under tensor parallelism.
    """

    def __init__(
        self, config: LlamaConfig, reduce: Reduce | None = None, lm_head_rows: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self._make_layer(config, reduce, i) for i in range(config.num_layers))
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, lm_head_rows or config.vocab_size, bias=False)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.local_inv_freq: torch.Tensor | None = rope_local_inv_freq(config)  # the windowed layers'
        self.rope_scale = rope_attention_scale(config)

    def _make_layer(self, config: LlamaConfig, reduce: Reduce | None, index: int) -> nn.Module:
        """Layer `index` of the stack (a hybrid's model builds its recurrent ones)."""
        return DecoderLayer(config, reduce, index)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rotary, Rotary]:
        """The embeddings `[T, hidden]` of `input_ids` `[T]`, and the rotary tables (cos, sin)
        at `positions` of the global layers and of the windowed ones."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.config.embed_scale:  # NOTE: the factor rounded to the embedding's dtype, as transformers does
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        rotary = rope_cos_sin(self.inv_freq, positions, x.dtype, self.rope_scale)
        local = rotary
        if self.local_inv_freq is not None:
            local = rope_cos_sin(self.local_inv_freq.to(positions.device), positions, x.dtype)
        return x, rotary, local

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        k_caches: torch.Tensor,  # [layers, num_slots, kv_heads, head_dim]
        v_caches: torch.Tensor,
        meta: AttentionMetadata,
        heartbeat: Heartbeat | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`; `heartbeat` beats once a layer."""
        x, (cos, sin), local = self.embed(input_ids, positions)
        for i, layer in enumerate(self.layers):
            layer_cos, layer_sin = local if layer.window else (cos, sin)
            x = layer(x, layer_cos, layer_sin, k_caches[i], v_caches[i], meta)
            if heartbeat is not None:
                heartbeat.beat()
        out: torch.Tensor = self.norm(x)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over `hidden` `[R, hidden]` → `[R, vocab]`."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits


def fuse_hf_state_dict(config: LlamaConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names onto this module's fused layout."""

    def norm(name: str) -> torch.Tensor:  # (1 + w) folded into the weight (Gemma's HF files)
        w = sd[name]
        return w + config.norm_offset if config.norm_offset else w

    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": sd["model.embed_tokens.weight"],
        "norm.weight": norm("model.norm.weight"),
    }
    lm_head = sd.get("lm_head.weight")
    if lm_head is None or config.tie_word_embeddings:
        lm_head = sd["model.embed_tokens.weight"]
    if config.logits_scaling != 1.0:  # Granite's logits divided: folded into the lm_head once
        lm_head = lm_head / config.logits_scaling
    out["lm_head.weight"] = lm_head
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + moe_prefix(sd, p)
        o = f"layers.{i}."
        out[o + "input_layernorm.weight"] = norm(p + "input_layernorm.weight")
        if config.post_norms:  # Gemma's names: the pre-MLP norm is pre_feedforward_layernorm
            out[o + "post_attention_layernorm.weight"] = norm(p + "pre_feedforward_layernorm.weight")
            out[o + "attn_out_norm.weight"] = norm(p + "post_attention_layernorm.weight")
            out[o + "mlp_out_norm.weight"] = norm(p + "post_feedforward_layernorm.weight")
        else:
            out[o + "post_attention_layernorm.weight"] = norm(p + "post_attention_layernorm.weight")
        own = None
        if config.is_hybrid:  # a recurrent layer's mixer, or a hybrid family's own attention
            from ft.model.hybrid import layer_weights

            own = layer_weights(config, sd, i)
        out |= _fuse_attention(config, sd, attn, o, norm) if own is None else own
        if config.is_moe_layer(i):
            out |= {o + "moe." + k: w for k, w in fuse_experts(sd, mlp, config.num_experts).items()}
            if not config.shared_mlp:
                continue
        fused_gate_up = sd.get(mlp + "gate_up_proj.weight")  # Phi-3 stores gate|up fused
        out[o + "gate_up_proj.weight"] = (
            fused_gate_up
            if fused_gate_up is not None
            else torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
        )
        out[o + "down_proj.weight"] = sd[mlp + "down_proj.weight"]
    return out


def _fuse_attention(
    config: LlamaConfig,
    sd: dict[str, torch.Tensor],
    attn: str,
    o: str,
    norm: Callable[[str], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One layer's attention weights (Hugging Face names under `attn`) in the fused layout
    (module names under `o`)."""
    out: dict[str, torch.Tensor] = {}
    fused_qkv = sd.get(attn + "qkv_proj.weight")  # Phi-3 stores q|k|v fused
    out[o + "qkv_proj.weight"] = (
        fused_qkv
        if fused_qkv is not None
        else torch.cat([sd[attn + "q_proj.weight"], sd[attn + "k_proj.weight"], sd[attn + "v_proj.weight"]])
    )
    if config.attention_bias:
        out[o + "qkv_proj.bias"] = torch.cat(
            [sd[attn + "q_proj.bias"], sd[attn + "k_proj.bias"], sd[attn + "v_proj.bias"]]
        )
    if config.qk_norm:
        out[o + "q_norm.weight"] = norm(attn + "q_norm.weight")
        out[o + "k_norm.weight"] = norm(attn + "k_norm.weight")
    out[o + "o_proj.weight"] = sd[attn + "o_proj.weight"]
    return out


def build_model(
    config: LlamaConfig,
    hf_state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    device: torch.device | None = None,
) -> LlamaForCausalLM:
    """Build on the meta device, then assign the (fused, cast) weights on `device`. (One rank's
    slice under tensor parallelism: `ft.model.parallel.shard.build_rank_model`.)"""
    return assemble_model(config, fuse_hf_state_dict(config, hf_state_dict), dtype, device=device)


def assemble_model(
    config: LlamaConfig,
    fused: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    device: torch.device | None = None,
    local: LlamaConfig | None = None,
    reduce: Reduce | None = None,
    lm_head_rows: int | None = None,
) -> LlamaForCausalLM:
    """The model of `fused` (`fuse_hf_state_dict` names) built on the meta device, its weights
    assigned on `device` in `dtype`.

    `local`: the shapes the weights have when they are one rank's slice (default `config`);
    `reduce` sums the row-parallel outputs over the ranks; `lm_head_rows`: the vocabulary rows
    a rank holds. The rotary tables are `config`'s (every rank's are the whole model's).
    """
    device = device or torch.device("cpu")
    model_class = LlamaForCausalLM
    if config.is_hybrid:
        from ft.model.hybrid import HybridForCausalLM

        model_class = HybridForCausalLM
    with torch.device("meta"):
        model = model_class(local or config, reduce, lm_head_rows)
    keep = float32_parameters(model)
    weights = {k: v.to(device=device, dtype=torch.float32 if k in keep else dtype) for k, v in fused.items()}
    model.load_state_dict({k: v.contiguous() for k, v in weights.items()}, assign=True, strict=True)
    model.inv_freq = rope_inv_freq(config).to(device)  # buffers made on meta are not in the state dict
    local_freq = rope_local_inv_freq(config)
    model.local_inv_freq = local_freq.to(device) if local_freq is not None else None
    return model.eval()


def float32_parameters(model: nn.Module) -> set[str]:
    """The parameters kept in float32 whatever the model's dtype: those each module names in its
    `float32_parameters` (a recurrent mixer's decays, convolution and norm)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in getattr(module, "float32_parameters", ())
    }
