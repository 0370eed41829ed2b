"""Gemma 4's text model as a config: `Gemma4Config`, read from a Hugging Face `config.json`
(`Gemma4ForCausalLM`'s, or the `text_config` of a `Gemma4ForConditionalGeneration`), with
transformers' defaults (`Gemma4TextConfig`) for what a config leaves out.

What the layers make differ from Gemma 3, read as transformers 5 reads it:

- The global (`full_attention`) layers have heads of their own size and their own kv head
  count: `per_layer_config` (what transformers 5 writes), else the hub's `global_head_dim` and,
  only with `attention_k_eq_v`, `num_global_key_value_heads`. With `attention_k_eq_v` a global
  layer has no v projection: its values are its raw keys (before the k norm and the rotary).
- Each layer type turns by its own rotary (`rope_parameters[type]`): "default", or
  "proportional" (`Rotary`).
- The last `num_kv_shared_layers` layers store no KV: each attends the KV of the last earlier
  layer of its type (transformers' `kv_sharing_modes`), so `kv_shapes` omits them and their
  pages hold nothing for them. With `use_double_wide_mlp` their MLP is twice as wide.
- The E models add per-layer embeddings (`hidden_size_per_layer_input`, from a table of
  `vocab_size_per_layer_input` rows); `enable_moe_block` adds routed experts beside the MLP.
- The softmax scale is 1 (the q and k norms take its place); norms scale by their weight as
  stored (no `1 + w`); no attention soft-cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ft.model.llama import LAYER_TYPES, LlamaConfig

# transformers' `Gemma4TextConfig` defaults, for the keys a config.json may leave out
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 512,
    "final_logit_softcapping": None, "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
    "enable_moe_block": False, "use_double_wide_mlp": False, "global_head_dim": 512,
}  # fmt: skip
ROPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # the per_layer_config overrides ft runs


@dataclass(frozen=True, slots=True)
class Rotary:
    """One layer type's rotary embedding over heads of `head_dim`: the first `fraction` of the
    head's `head_dim / 2` rotary pairs (pair j: dims j and j + head_dim / 2) turn at
    `theta ** (-2j / head_dim) / factor`, the others not at all (transformers' "proportional";
    "default" is fraction 1, factor 1). `pair_factors`, when given (a GGUF's `rope_freqs`: one
    per pair, as llama.cpp reads them), divide each pair's frequency further: llama.cpp's
    converter writes the proportional rotary as fraction 1 with factors of 1 for the pairs that
    turn and 1e30 for the others."""

    theta: float
    fraction: float = 1.0
    factor: float = 1.0
    pair_factors: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Gemma4Config(LlamaConfig):
    """A Gemma 4 text model. The `LlamaConfig` fields hold what all layers share, and for the
    per-layer ones (`head_dim`, `num_kv_heads`) the sliding layers' values; the fields here say
    what differs per layer. (The MoE fields of `LlamaConfig` say the experts beside the MLP.)"""

    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()  # the layer whose KV each layer attends: itself, or a producer
    k_eq_v: bool = False  # the global layers' values are their raw keys (no v projection)
    sliding_rope: Rotary = Rotary(10_000.0)
    full_rope: Rotary = Rotary(1_000_000.0, 0.25)
    per_layer_input_size: int = 0  # PLE width per layer; 0: no per-layer embeddings
    per_layer_vocab_size: int = 0  # rows of the PLE table
    double_wide_mlp: bool = False  # the KV-sharing layers' MLPs are twice as wide

    def __post_init__(self) -> None:
        LlamaConfig.__post_init__(self)
        n = self.num_layers
        if not (len(self.layer_head_dims) == len(self.layer_kv_heads) == len(self.kv_sources) == n):
            raise ValueError(
                f"Gemma 4: expected a head size, kv head count and KV source for each of {n} layers"
            )
        for i, (head_dim, kv_heads, source) in enumerate(
            zip(self.layer_head_dims, self.layer_kv_heads, self.kv_sources, strict=True)
        ):
            if head_dim < 2 or head_dim % 2 or kv_heads < 1 or self.num_heads % kv_heads:
                raise ValueError(
                    f"Gemma 4 layer {i}: {self.num_heads} heads of {head_dim} over {kv_heads} kv heads: "
                    "expected an even head size and kv heads that divide the heads"
                )
            if (
                not 0 <= source <= i
                or self.kv_sources[source] != source
                or self.is_sliding(source) != self.is_sliding(i)
                or (self.layer_head_dims[source], self.layer_kv_heads[source]) != (head_dim, kv_heads)
            ):
                raise ValueError(
                    f"Gemma 4 layer {i}: its KV source {source} is not an earlier layer of its type and shape"
                )
        if self.per_layer_input_size < 0 or (
            self.per_layer_input_size and self.per_layer_vocab_size < self.vocab_size
        ):
            raise ValueError(
                f"Gemma 4: per-layer embeddings need a positive width and a row for each of the "
                f"{self.vocab_size} tokens, got {self.per_layer_vocab_size} rows"
            )
        for sliding, rope in ((True, self.sliding_rope), (False, self.full_rope)):
            dims = {self.layer_head_dims[i] for i in range(n) if self.is_sliding(i) == sliding}
            factors = rope.pair_factors
            if factors and (dims - {2 * len(factors)} or not all(0 < f < math.inf for f in factors)):
                raise ValueError(
                    f"Gemma 4: {len(factors)} rotary pair factors for heads of {sorted(dims)}: expected "
                    "one positive finite factor per pair"
                )

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends a sliding window (else every position)."""
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def stores_kv(self, layer: int) -> bool:
        """Whether layer `layer` computes and stores its own keys and values."""
        return self.kv_sources[layer] == layer

    @property
    def num_kv_shared_layers(self) -> int:
        """The layers that attend an earlier layer's KV and store none."""
        return sum(not self.stores_kv(i) for i in range(self.num_layers))

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """`(kv_heads, head_dim)` of each layer that stores KV (the KV-sharing layers: none)."""
        return tuple(
            (self.layer_kv_heads[i], self.layer_head_dims[i])
            for i in range(self.num_layers)
            if self.stores_kv(i)
        )

    def kv_cache_index(self, layer: int) -> int:
        """The cache (among `kv_shapes`) layer `layer` attends."""
        source = self.kv_sources[layer]
        return sum(self.stores_kv(i) for i in range(source))

    def has_values(self, layer: int) -> bool:
        """Whether layer `layer` projects values of its own (not its keys, `attention_k_eq_v`)."""
        return not (self.k_eq_v and not self.is_sliding(layer))

    def rope(self, layer: int) -> Rotary:
        """Layer `layer`'s rotary (its type's)."""
        return self.sliding_rope if self.is_sliding(layer) else self.full_rope

    def mlp_size(self, layer: int) -> int:
        """Layer `layer`'s dense MLP width."""
        return self.intermediate_size * (2 if self.double_wide_mlp and not self.stores_kv(layer) else 1)

    @property
    def score_cost(self) -> float:
        """Scoring a position beside feeding a token, in multiply-adds (see `LlamaConfig`)."""
        h = self.hidden_size
        total = h * self.num_layers * self.per_layer_input_size  # the per-layer inputs' projection
        for i in range(self.num_layers):
            q = self.num_heads * self.layer_head_dims[i]
            kv = self.layer_kv_heads[i] * self.layer_head_dims[i] * (1 + self.has_values(i))
            total += h * (2 * q + (kv if self.stores_kv(i) else 0)) + 3 * h * self.mlp_size(i)
            total += 2 * h * self.per_layer_input_size
            if self.num_experts:
                total += h * self.num_experts + self.num_experts_per_tok * 3 * h * self.moe_intermediate_size
        return self.vocab_size * h / total


def gemma4_config(cfg: dict[str, Any]) -> Gemma4Config:
    """A `Gemma4Config` from a `config.json` dict (a multimodal one's `text_config`).

    Raises:
        ValueError: a value ft does not run (bidirectional attention, a rotary type other than
            "default" or "proportional", a per-layer override other than the head size and kv
            heads) or an inconsistent one, naming the key.
    """
    text = cfg.get("text_config")
    if cfg.get("model_type") == "gemma4" or isinstance(text, dict):
        if not isinstance(text, dict):
            raise ValueError("a Gemma 4 multimodal config.json needs its text model's 'text_config'")
        cfg = text
    c = {**TEXT_DEFAULTS, **cfg}
    if c.get("use_bidirectional_attention") == "all":
        raise ValueError("gemma4 with use_bidirectional_attention 'all' (an encoder) is not supported")
    if c.get("attention_bias"):
        raise ValueError("gemma4 with attention_bias is not supported")
    num_layers = _positive(c, "num_hidden_layers")
    types = c.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)
    ]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= LAYER_TYPES:
        raise ValueError(
            f"config.json 'layer_types': expected {num_layers} of {sorted(LAYER_TYPES)}, found {types!r:.120}"
        )
    types = [*types[:-1], "full_attention"]  # transformers forces the last layer global
    sliding = tuple(t == "sliding_attention" for t in types)
    head_dims, kv_heads = _layer_shapes(c, types)
    ropes = c.get("rope_parameters") or ROPE_DEFAULTS
    if not isinstance(ropes, dict):
        raise ValueError(f"config.json 'rope_parameters': expected one per layer type, found {ropes!r:.80}")
    experts = _experts(c) if c.get("enable_moe_block") else {}
    ple = int(c.get("hidden_size_per_layer_input") or 0)
    softcap = c.get("final_logit_softcapping")
    return Gemma4Config(
        vocab_size=_positive(c, "vocab_size"),
        hidden_size=_positive(c, "hidden_size"),
        intermediate_size=_positive(c, "intermediate_size"),
        num_layers=num_layers,
        num_heads=_positive(c, "num_attention_heads"),
        num_kv_heads=kv_heads[sliding.index(True)] if any(sliding) else kv_heads[0],
        head_dim=head_dims[sliding.index(True)] if any(sliding) else head_dims[0],
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope_theta=_rotary(ropes, "full_attention").theta,
        max_position_embeddings=_positive(c, "max_position_embeddings"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        qk_norm=True,
        architecture="gemma4",
        hidden_act=str(c["hidden_activation"]),
        embed_scale=True,
        post_norms=True,
        query_scale=1.0,
        final_softcap=float(softcap or 0.0),
        sliding_window=_positive(c, "sliding_window"),
        sliding_layers=sliding,
        layer_head_dims=head_dims,
        layer_kv_heads=kv_heads,
        kv_sources=_kv_sources(types, int(c["num_kv_shared_layers"])),
        k_eq_v=bool(c["attention_k_eq_v"]),
        sliding_rope=_rotary(ropes, "sliding_attention") if any(sliding) else Rotary(10_000.0),
        full_rope=_rotary(ropes, "full_attention"),
        per_layer_input_size=ple,
        per_layer_vocab_size=_positive(c, "vocab_size_per_layer_input") if ple else 0,
        double_wide_mlp=bool(c["use_double_wide_mlp"]),
        **experts,
    )


def _positive(c: dict[str, Any], key: str) -> int:
    value = c.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"gemma4 config.json '{key}': expected a positive integer, found {value!r:.40}")
    return value


def _layer_shapes(c: dict[str, Any], types: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's head size and kv heads: the global values over `per_layer_config` (or, in
    hub configs without it, the global layers' `global_head_dim` / `num_global_key_value_heads`,
    as transformers' `Gemma4TextConfig.__post_init__` builds it)."""
    _positive(c, "head_dim"), _positive(c, "num_key_value_heads")  # the global values are sound
    per_layer = c.get("per_layer_config")
    if isinstance(per_layer, dict):
        overrides = {int(k): v for k, v in per_layer.items()}
    elif per_layer is None:
        full: dict[str, Any] = {"head_dim": c["global_head_dim"]}
        if c["attention_k_eq_v"] and c.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = c["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == "full_attention"}
    else:
        raise ValueError(f"config.json 'per_layer_config': expected an object, found {per_layer!r:.80}")
    head_dims, heads = [], []
    for i in range(len(types)):
        layer = overrides.get(i, {})
        if not isinstance(layer, dict) or set(layer) - set(PER_LAYER_KEYS):
            raise ValueError(
                f"config.json 'per_layer_config' of layer {i}: only {', '.join(PER_LAYER_KEYS)} may differ "
                f"per layer, found {layer!r:.80}"
            )
        head_dims.append(_positive({**c, **layer}, "head_dim"))
        heads.append(_positive({**c, **layer}, "num_key_value_heads"))
    for kind in set(types):  # one rotary per type, so one head size per type (transformers asks the same)
        if len({(head_dims[i], heads[i]) for i, t in enumerate(types) if t == kind}) > 1:
            raise ValueError(f"gemma4: the {kind} layers differ in head size or kv heads")
    return tuple(head_dims), tuple(heads)


def _rotary(ropes: dict[str, Any], kind: str) -> Rotary:
    rope = ropes.get(kind)
    if not isinstance(rope, dict) or not isinstance(rope.get("rope_theta"), (int, float)):
        raise ValueError(f"config.json 'rope_parameters.{kind}': expected a rope_theta, found {rope!r:.80}")
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return Rotary(float(rope["rope_theta"]))
    if rope_type != "proportional":
        raise ValueError(f"gemma4 rope_type {rope_type!r} ({kind}) is not supported (default, proportional)")
    fraction, factor = rope.get("partial_rotary_factor", 1.0), rope.get("factor", 1.0)
    if not (
        isinstance(fraction, (int, float))
        and 0 <= fraction <= 1
        and isinstance(factor, (int, float))
        and factor > 0
    ):
        raise ValueError(f"config.json 'rope_parameters.{kind}': a fraction in [0, 1] and a positive factor")
    return Rotary(float(rope["rope_theta"]), float(fraction), float(factor))


def _kv_sources(types: list[str], num_shared: int) -> tuple[int, ...]:
    """Each layer's KV source: itself, or for the last `num_shared` layers the last earlier
    layer of their type before them (transformers' `kv_sharing_modes`)."""
    first_shared = len(types) - num_shared
    if not 0 <= num_shared < len(types):
        raise ValueError(
            f"gemma4 num_kv_shared_layers {num_shared}: expected 0 to {len(types) - 1} of {len(types)} layers"
        )
    producer = {t: i for i, t in enumerate(types[:first_shared])}  # the last of each type
    if set(producer) != set(types):
        raise ValueError("gemma4: a layer type that shares KV has no earlier layer of its type storing it")
    return tuple(i if i < first_shared else producer[t] for i, t in enumerate(types))


def _experts(c: dict[str, Any]) -> dict[str, Any]:
    """The experts beside the MLP (`enable_moe_block`): always renormalized top-k."""
    return dict(
        num_experts=_positive(c, "num_experts"),
        num_experts_per_tok=_positive(c, "top_k_experts"),
        moe_intermediate_size=_positive(c, "moe_intermediate_size"),
        norm_topk_prob=True,
    )
