"""Gemma 4 from a GGUF as llama.cpp's converter writes it (`general.architecture` "gemma4"), read
as llama.cpp reads it, into the `Gemma4Config` and Hugging Face weight names that
`ft.model.gemma4` runs (on the float path: every tensor dequantized).

What the converter (`Gemma4Model` in its `conversion/gemma.py`) writes, and where it lands:

- Per-layer shapes: `attention.key_length` / `key_length_swa` are the global and the sliding
  layers' head sizes, `attention.head_count_kv` one count per layer when they differ (the global
  layers' `num_global_key_value_heads`), `attention.sliding_window_pattern` one boolean per layer
  (true: sliding), `feed_forward_length` one width per layer with `use_double_wide_mlp`.
- `attention_k_eq_v` is no key: the global layers have no `attn_v` (llama.cpp then takes the
  keys as values). KV sharing is `attention.shared_kv_layers`: llama.cpp's rule (its KV cache's
  `reuse` callback) has a shared sliding layer read layer `n - shared - 2`, a shared global one
  layer `n - shared - 1`, which is transformers' rule when those two are a sliding then a
  global layer; a file where they are not is refused (llama.cpp asserts on it).
- The rotary: `rope.freq_base` (global) and `rope.freq_base_swa` (sliding) over the whole head
  (`rope.dimension_count` / `_swa`); the "proportional" partial rotary is `rope_freqs.weight`,
  one frequency divisor per pair of the global heads (1 for the pairs that turn, 1e30 for the
  others), which ft applies as llama.cpp does (`Rotary.pair_factors`).
- Norms as stored (Gemma 4 scales by `w`, the converter adds nothing), no q/k permutation, the
  embedding cut to the tokenizer's tokens, `layer_output_scale` (`layer_scalar`), the per-layer
  embeddings (`per_layer_token_embd` [vocab, layers * ple], `per_layer_model_proj`, `inp_gate`,
  `proj`, `post_norm`), the experts' router (`ffn_gate_inp`, its `.scale`), `ffn_gate_up_exps`
  [experts, 2 * moe, hidden], `ffn_down_exps` and its `.scale` (`per_expert_scale`), their
  norms `pre_ffw_norm_2`, `post_ffw_norm_1` (the MLP's), `post_ffw_norm_2` (the experts').

What it drops is the registry's `GEMMA4.gguf_converter_losses`: those run as llama.cpp runs them
(GELU, the final soft-cap 30 when the file has none, unscaled rotaries, the sliding rotary over
every pair).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from gguf.quants import dequantize

from ft.model.gemma4_config import Gemma4Config, Rotary
from ft.model.gguf_file import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    GGUFFile,
    ModelFileError,
)

ARCH = "gemma4"
LLAMA_CPP_FINAL_SOFTCAP = 30.0  # llama.cpp's `f_final_logit_softcapping` when the file has none
# GGUF tensor names of a Gemma 4 layer (after `blk.N.`) → Hugging Face names (after
# `model.layers.N.`)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
ROPE_FREQS = "rope_freqs.weight"


def gemma4_gguf_config(meta: GGUFFile, tensor_names: set[str], vocab_size: int) -> Gemma4Config:
    """The `Gemma4Config` a Gemma 4 GGUF's metadata (and which tensors it has) describes.

    Raises:
        ModelFileError: a key is missing, of the wrong type or out of range, or the layers it
            describes are not a Gemma 4 ft runs (the message names the key or tensor).
    """
    n = meta.integer(_key("block_count"), 1, MAX_LAYERS)
    hidden = meta.integer(_key("embedding_length"), 1, MAX_WIDTH)
    heads = _uniform(meta, "attention.head_count", 1, MAX_HEADS, n)
    sliding = _sliding_pattern(meta, n)
    kv_heads = _layer_ints(meta, "attention.head_count_kv", 1, heads, n, default=heads)
    full_dim, full_rotary = _head_size(meta, "", hidden // heads or None, None)
    swa_dim, _ = _head_size(meta, "_swa", None, full_rotary)  # (llama.cpp requires the sliding size)
    head_dims = tuple(swa_dim if s else full_dim for s in sliding)
    for i, h in enumerate(kv_heads):
        if heads % h:
            raise ModelFileError(
                f"metadata key '{_key('attention.head_count_kv')}': layer {i}'s {h} kv heads do not "
                f"divide the {heads} heads of '{_key('attention.head_count')}'"
            )
    kv_sources = _kv_sources(meta, sliding)
    ffn, double_wide = _mlp_widths(meta, n, kv_sources)
    theta = meta.number(_key("rope.freq_base"), 1e-3, 1e12, 10000.0)
    full_rope = Rotary(
        theta, factor=_linear_factor(meta), pair_factors=_pair_factors(meta, sliding, full_dim)
    )
    window = meta.integer(_key("attention.sliding_window"), 1 if any(sliding) else 0, MAX_CONTEXT)
    meta.require(_key("attention.layer_norm_rms_epsilon"))
    ple = meta.integer(_key("embedding_length_per_layer_input"), 0, MAX_WIDTH)
    vocab = meta.integer(_key("vocab_size"), 1, MAX_VOCAB, default=vocab_size or 1)
    try:
        return Gemma4Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=kv_heads[sliding.index(True)] if any(sliding) else kv_heads[0],
            head_dim=swa_dim if any(sliding) else full_dim,
            rms_norm_eps=meta.number(_key("attention.layer_norm_rms_epsilon"), 0.0, 1.0, 1e-6),
            rope_theta=theta,
            max_position_embeddings=meta.integer(_key("context_length"), 1, MAX_CONTEXT),
            tie_word_embeddings="output.weight" not in tensor_names,
            qk_norm=True,
            architecture=ARCH,
            hidden_act="gelu_pytorch_tanh",  # llama.cpp's Gemma 4 graph: GELU everywhere
            embed_scale=True,
            post_norms=True,
            query_scale=1.0,
            final_softcap=meta.number(_key("final_logit_softcapping"), 0.0, 1e6, LLAMA_CPP_FINAL_SOFTCAP),
            sliding_window=window,
            sliding_layers=sliding,
            layer_head_dims=head_dims,
            layer_kv_heads=kv_heads,
            kv_sources=kv_sources,
            k_eq_v=_keys_as_values(tensor_names, sliding, kv_sources),
            sliding_rope=Rotary(meta.number(_key("rope.freq_base_swa"), 1e-3, 1e12, 10000.0)),
            full_rope=full_rope,
            per_layer_input_size=ple,
            per_layer_vocab_size=vocab if ple else 0,  # (llama.cpp's table has a row per token)
            double_wide_mlp=double_wide,
            **_experts(meta, tensor_names, n),
        )
    except ValueError as e:  # Gemma4Config's own checks
        raise ModelFileError(f"metadata of architecture {ARCH!r}: {e}") from None


def gemma4_tensor_shapes(
    config: Gemma4Config,
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The tensors a Gemma 4 GGUF of `config` must have, and those it may have, under their
    GGUF names with their torch shapes (as llama.cpp's loader creates them)."""
    c = config
    h, v = c.hidden_size, c.vocab_size
    need: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    may: dict[str, tuple[int, ...]] = {}
    if not c.tie_word_embeddings:
        need["output.weight"] = (v, h)
    full = [i for i in range(c.num_layers) if not c.is_sliding(i)]
    if full:
        need[ROPE_FREQS] = (c.layer_head_dims[full[0]] // 2,)
    ple = c.per_layer_input_size
    if ple:
        width = c.num_layers * ple
        need |= {
            "per_layer_token_embd.weight": (c.per_layer_vocab_size, width),
            "per_layer_model_proj.weight": (width, h),
            "per_layer_proj_norm.weight": (ple,),
        }
    for i in range(c.num_layers):
        p, d = f"blk.{i}.", c.layer_head_dims[i]
        q, kv, ffn = c.num_heads * d, c.layer_kv_heads[i] * d, c.mlp_size(i)
        need |= {
            p + "attn_norm.weight": (h,), p + "attn_q.weight": (q, h), p + "attn_q_norm.weight": (d,),
            p + "attn_output.weight": (h, q), p + "post_attention_norm.weight": (h,),
            p + "ffn_norm.weight": (h,), p + "ffn_gate.weight": (ffn, h), p + "ffn_up.weight": (ffn, h),
            p + "ffn_down.weight": (h, ffn), p + "post_ffw_norm.weight": (h,),
        }  # fmt: skip
        kv_part = {p + "attn_k.weight": (kv, h), p + "attn_k_norm.weight": (d,)}
        value = {p + "attn_v.weight": (kv, h)}
        if c.stores_kv(i):
            need |= kv_part | (value if c.has_values(i) else {})
        else:  # a KV-sharing layer's own k and v, if a checkpoint had them, are not used
            may |= kv_part | value
        may[p + "layer_output_scale.weight"] = (1,)
        if ple:
            need |= {
                p + "inp_gate.weight": (ple, h),
                p + "proj.weight": (h, ple),
                p + "post_norm.weight": (h,),
            }
        if c.num_experts:
            e, m = c.num_experts, c.moe_intermediate_size
            need |= {
                p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_inp.scale": (h,),
                p + "pre_ffw_norm_2.weight": (h,), p + "post_ffw_norm_1.weight": (h,),
                p + "post_ffw_norm_2.weight": (h,), p + "ffn_down_exps.weight": (e, h, m),
            }  # fmt: skip
            need[p + "ffn_gate_up_exps.weight"] = (e, 2 * m, h)  # gate | up, as the converter joins them
            may[p + "ffn_down_exps.scale"] = (e,)
    return need, may


def gemma4_state_dict(
    config: Gemma4Config, tensors: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The float tensors of a (checked) Gemma 4 GGUF, `(GGUF name, tensor)`, under transformers'
    names (`gemma4.fuse_hf_state_dict` reads them): a per-expert scale the file lacks is 1 (as
    llama.cpp runs it), `rope_freqs` left out (the config has it)."""
    sd: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name == ROPE_FREQS:
            continue
        sd[_hf_name(name)] = tensor
    for i in range(config.num_layers if config.num_experts else 0):
        p = f"model.layers.{i}."
        if p + "router.per_expert_scale" not in sd:
            sd[p + "router.per_expert_scale"] = torch.ones(
                config.num_experts, dtype=sd[p + "router.scale"].dtype
            )
    return sd


def _hf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    layer, _, rest = name.removeprefix("blk.").partition(".")
    if not name.startswith("blk.") or rest not in LAYER_NAMES:
        raise ModelFileError(f"unexpected tensor {name} (not part of a {ARCH} model)")
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def _key(name: str) -> str:
    return f"{ARCH}.{name}"


def _layer_ints(
    meta: GGUFFile, name: str, low: int, high: int, n: int, default: int | None = None
) -> tuple[int, ...]:
    """An integer in [low, high] for every layer, or an array of one per layer (llama.cpp's
    `get_key_or_arr`)."""
    key = _key(name)
    value = meta.get(key)
    if not isinstance(value, list):
        return (meta.integer(key, low, high, default),) * n
    if len(value) != n or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ModelFileError(
            f"metadata key {key!r}: expected an integer or an array of {n} integers (one per layer of "
            f"'{_key('block_count')}'), found {len(value)} items"
        )
    if not all(low <= v <= high for v in value):
        raise ModelFileError(
            f"metadata key {key!r}: expected integers from {low} to {high}, found {value[:8]}"
        )
    return tuple(value)


def _uniform(meta: GGUFFile, name: str, low: int, high: int, n: int) -> int:
    """An integer every layer shares (a per-layer array of one value too)."""
    values = _layer_ints(meta, name, low, high, n)
    if len(set(values)) > 1:
        raise ModelFileError(
            f"metadata key '{_key(name)}': layers of different values ({sorted(set(values))[:8]}) "
            "are not supported"
        )
    return values[0]


def _sliding_pattern(meta: GGUFFile, n: int) -> tuple[bool, ...]:
    """Which layers are sliding: `attention.sliding_window_pattern`, one boolean per layer (the
    array llama.cpp requires)."""
    key = _key("attention.sliding_window_pattern")
    pattern = meta.require(key)
    if not isinstance(pattern, list) or len(pattern) != n or not all(isinstance(v, bool) for v in pattern):
        raise ModelFileError(f"metadata key {key!r}: expected {n} booleans (one per layer of 'block_count')")
    return tuple(pattern)


def _head_size(
    meta: GGUFFile, suffix: str, default: int | None, rotary_default: int | None
) -> tuple[int, int]:
    """The full (`suffix` "") or sliding ("_swa") layers' head size (`key_length`, `default`
    when absent; None: required), equal to `value_length` and to the rotary's
    `dimension_count` (`rotary_default` when absent, None: the head size), as its rotary spans
    the whole head. Returns the size and the rotary's dims."""
    key = _key(f"attention.key_length{suffix}")
    size = meta.integer(
        key, 2, MAX_HEAD_DIM, default=default if default is not None and default >= 2 else None
    )
    if size % 2:
        raise ModelFileError(f"metadata key {key!r}: the head size {size} is odd (the rotary turns pairs)")
    value_key = _key(f"attention.value_length{suffix}")
    if meta.integer(value_key, 1, MAX_HEAD_DIM, default=size) != size:
        raise ModelFileError(f"metadata key {value_key!r}: expected the key size {size} (llama.cpp's)")
    rope_key = _key(f"rope.dimension_count{suffix}")
    rotary = meta.integer(rope_key, 1, MAX_HEAD_DIM, default=rotary_default or size)
    if rotary != size:
        raise ModelFileError(
            f"metadata key {rope_key!r}: a rotary over {rotary} of the head's {size} dims is not "
            "supported (Gemma 4's turns the whole head, its partial rotary is `rope_freqs`)"
        )
    return size, rotary


def _kv_sources(meta: GGUFFile, sliding: tuple[bool, ...]) -> tuple[int, ...]:
    """Each layer's KV source under llama.cpp's rule (see the module's docstring).

    Raises:
        ModelFileError: the shared layers' sources are not a sliding then a global layer.
    """
    n = len(sliding)
    key = _key("attention.shared_kv_layers")
    shared = meta.integer(key, 0, n - 1, default=0)
    start = n - shared
    sources = tuple(range(start)) + tuple(start - 2 if s else start - 1 for s in sliding[start:])
    if shared and (
        (any(sliding[start:]) and (start < 2 or not sliding[start - 2]))
        or (not all(sliding[start:]) and sliding[start - 1])
    ):
        kinds = " and ".join("sliding" if sliding[i] else "global" for i in range(max(start - 2, 0), start))
        raise ModelFileError(
            f"metadata key {key!r}: {shared} layers share the KV of layers {start - 2} (sliding) and "
            f"{start - 1} (global), as llama.cpp reads it, but those layers are {kinds}"
        )
    return sources


def _mlp_widths(meta: GGUFFile, n: int, kv_sources: tuple[int, ...]) -> tuple[int, bool]:
    """The MLP width and whether the KV-sharing layers' are twice it (`use_double_wide_mlp`,
    written as one width per layer)."""
    key = _key("feed_forward_length")
    widths = _layer_ints(meta, "feed_forward_length", 1, MAX_WIDTH, n)
    base = widths[0]
    shared = [i for i in range(n) if kv_sources[i] != i]
    storing = [i for i in range(n) if kv_sources[i] == i]
    if all(widths[i] == base for i in storing):
        if all(widths[i] == base for i in shared):
            return base, False
        if all(widths[i] == 2 * base for i in shared):
            return base, True
    raise ModelFileError(
        f"metadata key {key!r}: widths {list(widths)[:12]} per layer; ft runs one width, or "
        "twice it on the KV-sharing layers (use_double_wide_mlp)"
    )


def _linear_factor(meta: GGUFFile) -> float:
    """The global layers' rotary scaling: none, or llama.cpp's linear `rope.scaling.factor`."""
    kind = meta.text(_key("rope.scaling.type"), "linear")
    if kind == "none":
        return 1.0
    if kind != "linear":
        raise ModelFileError(
            f"metadata key '{_key('rope.scaling.type')}': {kind!r} is not supported for gemma4"
        )
    return meta.number(_key("rope.scaling.factor"), 1e-6, 1e6, 1.0) or 1.0


def _pair_factors(meta: GGUFFile, sliding: tuple[bool, ...], full_dim: int) -> tuple[float, ...]:
    """`rope_freqs.weight`: the global heads' frequency divisors, one per rotary pair.

    Raises:
        ModelFileError: missing while the model has a global layer, of another shape, or not
            positive finite numbers.
    """
    tensor = next((t for t in meta.tensors if t.name == ROPE_FREQS), None)
    if all(sliding):
        return ()
    if tensor is None:
        raise ModelFileError(f"tensor {ROPE_FREQS} is missing (the global layers' rotary factors)")
    if tensor.shape != (full_dim // 2,):
        raise ModelFileError(
            f"tensor {ROPE_FREQS}: expected shape [{full_dim // 2}] (one per rotary pair of the global "
            f"layers' heads of {full_dim}), found {list(tensor.shape)}"
        )
    try:
        values = [float(v) for v in dequantize(tensor.data, tensor.tensor_type).flatten().tolist()]
    except NotImplementedError:
        raise ModelFileError(
            f"tensor {ROPE_FREQS} has type {tensor.tensor_type.name}, which cannot be read"
        ) from None
    if not all(0 < v < math.inf for v in values):
        raise ModelFileError(f"tensor {ROPE_FREQS}: expected positive finite factors")
    return tuple(values)


def _keys_as_values(names: set[str], sliding: tuple[bool, ...], kv_sources: tuple[int, ...]) -> bool:
    """Whether the global layers take their keys as values (they have no `attn_v`, the
    checkpoint's `attention_k_eq_v`; llama.cpp does so for any layer without one).

    Raises:
        ModelFileError: a sliding layer lacks it, or only some global layers do.
    """
    storing = [i for i in range(len(sliding)) if kv_sources[i] == i]
    missing = {i for i in storing if f"blk.{i}.attn_v.weight" not in names}
    if any(sliding[i] for i in missing):
        layer = min(i for i in missing if sliding[i])
        raise ModelFileError(f"tensor blk.{layer}.attn_v.weight is missing (a sliding layer's values)")
    full = {i for i in storing if not sliding[i]}
    if missing and missing != full:
        raise ModelFileError(
            f"tensor blk.{min(full - missing)}.attn_v.weight: some global layers take their keys as "
            "values and others do not (ft runs all or none)"
        )
    return bool(missing)


def _experts(meta: GGUFFile, names: set[str], n: int) -> dict[str, Any]:
    """The experts beside every layer's MLP (the layers with a router, `ffn_gate_inp`): always
    renormalized top-k of a softmax, as llama.cpp's Gemma 4 graph routes."""
    routed = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not routed:
        return {}
    if len(routed) != n:
        missing = next(i for i in range(n) if i not in routed)
        raise ModelFileError(
            f"tensor blk.{missing}.ffn_gate_inp.weight is missing (ft runs experts on every layer)"
        )
    experts = meta.integer(_key("expert_count"), 1, MAX_EXPERTS)
    return dict(
        num_experts=experts,
        num_experts_per_tok=meta.integer(_key("expert_used_count"), 1, experts),
        moe_intermediate_size=_uniform(meta, "expert_feed_forward_length", 1, MAX_WIDTH, n),
        norm_topk_prob=True,
    )
