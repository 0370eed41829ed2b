"""Load a GGUF file: config from metadata, tokenizer from its vocabulary, dequantized tensors."""

from __future__ import annotations

import logging
import pathlib
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from ft.model.architectures import GGUF_GLOBAL_NAMES, Architecture, ConverterLoss, by_gguf, by_name
from ft.model.gemma4_config import Gemma4Config
from ft.model.gguf_check import check_tensors, check_vocabulary, num_labels
from ft.model.gguf_file import (  # (the bounds on the metadata's numbers)
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    GGUFFile,
    GGUFTensor,
    ModelFileError,
)
from ft.model.gguf_gemma4 import gemma4_gguf_config, gemma4_state_dict
from ft.model.kernels import expert_views, repacked
from ft.model.llama import LlamaConfig, Progress
from ft.model.quant import KERNEL_TYPES, Q8_0, QuantTensor, to_q8_0
from ft.model.rerank import RankFormat
from ft.tokenizer.spec import (
    TokenizerSpec,
    byte_level_bpe_from_gguf,
    gemma4_from_gguf,
    gemma_from_gguf,
    sentencepiece_bpe_from_gguf,
    special_token_text,
    tokenizer_json_of,
)

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
log = logging.getLogger("ft.model")


# llama.cpp's `llama_pooling_type` values (0 none; 4 rank: the last token through the file's
# classification head, `cls.*`).
GGUF_POOLINGS = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


def gguf_config(meta: GGUFFile, tensor_names: set[str], vocab_size: int) -> LlamaConfig:
    """A `LlamaConfig` from `{arch}.*` metadata, each number type- and range-checked.

    Raises:
        ModelFileError: a key is missing, of the wrong type, out of range, or inconsistent with
            another (the heads do not divide, the rotary dimensions differ from the head's).
    """
    arch = meta.text("general.architecture")
    if arch is None:
        raise ModelFileError("GGUF file lacks required metadata key 'general.architecture'")
    from ft.model import gguf_hybrid  # (here, not at the top: it imports this module)

    if arch in gguf_hybrid.FAMILIES:  # read as its Hugging Face checkpoint would be
        return gguf_hybrid.llama_config(meta)
    try:
        family = by_gguf(
            arch, str(meta.text("general.name", "") or ""), f"{arch}.expert_count" in meta.fields
        )
    except ValueError as e:
        raise ModelFileError(str(e)) from None
    if family.decoder == "gemma4":  # layers of their own shapes (`gguf_gemma4` reads them)
        return gemma4_gguf_config(meta, tensor_names, vocab_size)
    num_layers = meta.integer(f"{arch}.block_count", 1, MAX_LAYERS)
    num_heads = _per_layer(meta, f"{arch}.attention.head_count", 1, MAX_HEADS, num_layers)
    hidden = meta.integer(f"{arch}.embedding_length", 1, MAX_WIDTH)
    num_kv_heads = _per_layer(
        meta, f"{arch}.attention.head_count_kv", 1, num_heads, num_layers, default=num_heads
    )
    if num_heads % num_kv_heads:
        raise ModelFileError(
            f"metadata key '{arch}.attention.head_count_kv': {num_kv_heads} does not divide the "
            f"{num_heads} heads of '{arch}.attention.head_count'"
        )
    half_split = arch not in family.gguf_permuted_qk  # partial rotary: the leading dims of each head
    head_dim, rotary_dim = _head_dim(meta, arch, hidden, num_heads, partial_rotary=half_split)
    moe: dict[str, Any] = {}
    if family.moe:
        num_experts = meta.integer(f"{arch}.expert_count", 1, MAX_EXPERTS)
        # Mixtral's and OLMoE's experts are `feed_forward_length` wide (llama.cpp's n_ff)
        expert_ffn = meta.integer(
            f"{arch}.expert_feed_forward_length", 1, MAX_WIDTH, default=0
        ) or _per_layer(meta, f"{arch}.feed_forward_length", 1, MAX_WIDTH, num_layers)
        renormalize = family.router_renormalizes
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=meta.integer(f"{arch}.expert_used_count", 1, num_experts),
            moe_intermediate_size=expert_ffn,
            norm_topk_prob=_flag(meta, f"{arch}.expert_weights_norm", default=family.gguf_expert_weights_norm)
            if renormalize is None
            else renormalize,
        )  # llama.cpp renormalizes qwen3moe's top-k unless the file says otherwise, olmoe's never
    gemma = _gemma_fields(meta, arch, family, num_layers, hidden, num_heads, head_dim) if family.gemma else {}
    window = _window_fields(meta, arch, family, num_layers) if family.windowed else {}
    rope_scaling: dict[str, Any] | None = None
    scaling_type = meta.text(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor_key = f"{arch}.rope.scaling.factor"
        meta.require(factor_key)
        rope_scaling = {"rope_type": scaling_type, "factor": meta.number(factor_key, 1e-6, 1e6, default=1.0)}
        original_key = f"{arch}.rope.scaling.original_context_length"
        if original_key in meta.fields:
            rope_scaling["original_max_position_embeddings"] = meta.integer(original_key, 1, MAX_CONTEXT)
    blocks = _phi_smollm_granite(meta, arch, family, num_layers, rotary_dim)
    if "rope_scaling" in blocks:
        rope_scaling = blocks.pop("rope_scaling")
    try:
        return LlamaConfig(
            vocab_size=meta.integer(f"{arch}.vocab_size", 1, MAX_VOCAB, default=vocab_size or 1),
            hidden_size=hidden,
            intermediate_size=_per_layer(
                meta,
                f"{arch}.feed_forward_length",
                1,
                MAX_WIDTH,
                num_layers,
                default=moe.get("moe_intermediate_size"),
            ),  # fmt: skip
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 0.0, 1.0, 1e-5),
            rope_theta=meta.number(f"{arch}.rope.freq_base", 1e-3, 1e12, 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=meta.integer(f"{arch}.context_length", 1, MAX_CONTEXT, default=2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm=family.qk_norm,
            qk_norm_whole=family.qk_norm_whole,
            architecture=family.name,
            pooling=GGUF_POOLINGS.get(meta.integer(f"{arch}.pooling_type", 0, 1 << 16, default=0)),
            **moe,
            **gemma,
            **window,
            **blocks,
        )
    except ModelFileError:
        raise
    except ValueError as e:  # LlamaConfig's own checks (rope scaling type)
        raise ModelFileError(f"metadata of architecture {arch!r}: {e}") from None


def _gemma_fields(
    meta: GGUFFile,
    arch: str,
    family: Architecture,
    num_layers: int,
    hidden: int,
    num_heads: int,
    head_dim: int,
) -> dict[str, Any]:
    """Gemma's blocks as llama.cpp reads them from a GGUF: its norms already hold the 1 of
    `(1 + w)` (the converter added it), the query scale is the head size's (hidden / heads for
    the 27B layer counts: the file has no `query_pre_attn_scalar`), soft-caps from the file or
    llama.cpp's defaults, and llama.cpp's rotary base for the windowed layers."""
    attn_cap, final_cap = family.gguf_softcaps
    scale_width = hidden / num_heads if num_layers in family.gguf_wide_query_scale_layers else head_dim
    return dict(
        hidden_act="gelu_pytorch_tanh",
        embed_scale=True,
        post_norms=True,
        query_scale=scale_width**-0.5,
        attn_softcap=meta.number(f"{arch}.attn_logit_softcapping", 0.0, 1e6, attn_cap),
        final_softcap=meta.number(f"{arch}.final_logit_softcapping", 0.0, 1e6, final_cap),
        rope_local_theta=family.local_rope_theta,
    )


def _window_fields(meta: GGUFFile, arch: str, family: Architecture, num_layers: int) -> dict[str, Any]:
    """The sliding window (`{arch}.attention.sliding_window`, else the family's `gguf_window`)
    and which layers it applies to (`{arch}.attention.sliding_window_pattern`: a
    period n — every nth layer global — or one boolean per layer; else the family's period)."""
    key = f"{arch}.attention.sliding_window"
    if family.gguf_window < 0:
        meta.require(key)
    window = meta.integer(key, 0, MAX_CONTEXT, default=max(family.gguf_window, 0))
    if not window:
        return {}
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(pattern_key)
    period = family.sliding_period
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(v, bool) for v in pattern):
            raise ModelFileError(
                f"metadata key {pattern_key!r}: expected a period or {num_layers} booleans (one per layer)"
            )
        return dict(sliding_window=window, sliding_layers=tuple(pattern))
    if pattern is not None:
        period = meta.integer(pattern_key, 1, MAX_LAYERS)
    if not period:
        return dict(sliding_window=window)
    return dict(
        sliding_window=window, sliding_layers=tuple(i % period < period - 1 for i in range(num_layers))
    )


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi_smollm_granite(
    meta: GGUFFile, arch: str, family: Architecture, num_layers: int, rotary_dim: int
) -> dict[str, Any]:
    """`LlamaConfig` fields of Phi-3's rotary (its width, longrope from the `rope_factors_*`
    tensors), SmolLM3's layers without rotary and Granite's multipliers, as llama.cpp reads them.

    Raises:
        ModelFileError: a value out of range, or one longrope tensor without the other.
    """
    out: dict[str, Any] = {"rotary_dim": rotary_dim}
    if family.gguf_no_rope_interval:
        step = family.gguf_no_rope_interval
        out["no_rope_layers"] = tuple(i for i in range(num_layers) if (i + 1) % step == 0)
    factors = {t.name: t for t in meta.tensors if t.name in LONGROPE_TENSORS}
    if factors:
        if len(factors) != 2:
            missing = next(n for n in LONGROPE_TENSORS if n not in factors)
            raise ModelFileError(f"tensor {missing} is missing (longrope needs both factor tensors)")
        original_key = f"{arch}.rope.scaling.original_context_length"
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "original_max_position_embeddings": meta.integer(original_key, 2, MAX_CONTEXT),
        }
        for name, key in zip(LONGROPE_TENSORS, ("long_factor", "short_factor"), strict=True):
            tensor = factors[name]
            if tensor.shape != (rotary_dim // 2,):
                raise ModelFileError(
                    f"tensor {name}: expected shape [{rotary_dim // 2}] (one per rotary pair), "
                    f"found {list(tensor.shape)}"
                )
            scaling[key] = [float(v) for v in dequantized(tensor).flatten().tolist()]
        attn_factor_key = f"{arch}.rope.scaling.attn_factor"
        if attn_factor_key in meta.fields:  # else computed from the context, as the converter does
            scaling["attention_factor"] = meta.number(attn_factor_key, 1e-6, 1e6, 1.0)
        out["rope_scaling"] = scaling
    # Granite's multipliers; llama.cpp reads 0 (or no key) as "none"
    for key, name in (
        (f"{arch}.embedding_scale", "embedding_multiplier"),
        (f"{arch}.residual_scale", "residual_multiplier"),
        (f"{arch}.attention.scale", "attention_multiplier"),
        (f"{arch}.logit_scale", "logits_scaling"),
    ):
        value = meta.number(key, 0.0, 1e6, 0.0)
        if value != 0.0:
            out[name] = value
    return out


def _flag(meta: GGUFFile, key: str, *, default: bool) -> bool:
    """A boolean metadata value, or `default` when absent."""
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise ModelFileError(f"metadata key {key!r}: expected a boolean, found {type(value).__name__}")
    return value


def _per_layer(
    meta: GGUFFile, key: str, low: int, high: int, num_layers: int, default: int | None = None
) -> int:
    """An integer in [low, high], or (as llama.cpp reads head counts and ffn lengths) an array of
    one per layer; every layer must have the same value (ft runs uniform layers only)."""
    value = meta.get(key)
    if not isinstance(value, list):
        return meta.integer(key, low, high, default)
    if len(value) != num_layers or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ModelFileError(
            f"metadata key {key!r}: expected an integer or an array of {num_layers} integers (one per "
            f"layer of 'block_count'), found {len(value)} items"
        )
    if any(v != value[0] for v in value):
        raise ModelFileError(
            f"metadata key {key!r}: layers of different sizes ({sorted(set(value))[:8]}) are not supported"
        )
    if not low <= value[0] <= high:
        raise ModelFileError(
            f"metadata key {key!r}: expected integers from {low} to {high}, found {value[0]}"
        )
    return int(value[0])


def _head_dim(
    meta: GGUFFile, arch: str, hidden: int, num_heads: int, *, partial_rotary: bool = False
) -> tuple[int, int]:
    """The head size, as llama.cpp reads it (`key_length`, else hidden / heads), and the rotary
    width: `value_length` must equal the head size, and so must the rotary dimensions unless
    `partial_rotary` (a half-split family, Phi-3: the leading dims of each head turn)."""
    head_dim = meta.integer(f"{arch}.attention.key_length", 1, MAX_HEAD_DIM, default=0)
    source = f"'{arch}.attention.key_length'"
    if not head_dim:
        if hidden % num_heads:
            raise ModelFileError(
                f"metadata key '{arch}.embedding_length': {hidden} is not a multiple of the "
                f"{num_heads} heads of '{arch}.attention.head_count'"
            )
        head_dim = hidden // num_heads
        source = f"'{arch}.embedding_length' {hidden} / '{arch}.attention.head_count' {num_heads}"
    rope_dims = meta.integer(f"{arch}.rope.dimension_count", 1, MAX_HEAD_DIM, default=head_dim)
    if partial_rotary and rope_dims < head_dim and rope_dims % 2 == 0:
        pass  # checked as a `LlamaConfig` (even, at least 2)
    elif rope_dims != head_dim:
        raise ModelFileError(
            f"metadata key '{arch}.rope.dimension_count': {rope_dims}, but the head size is {head_dim} "
            f"({source}); partial rotary embeddings are not supported"
        )
    value_length = meta.integer(f"{arch}.attention.value_length", 1, MAX_HEAD_DIM, default=head_dim)
    if value_length != head_dim:
        raise ModelFileError(
            f"metadata key '{arch}.attention.value_length': {value_length}, expected the key size {head_dim}"
        )
    if head_dim % 2:
        raise ModelFileError(f"the head size {head_dim} ({source}) is odd (the rotary embedding turns pairs)")
    return head_dim, rope_dims


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs → half-split), as transformers does."""
    rows = w.shape[0]
    dim = rows // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def as_stored(tensor: GGUFTensor) -> QuantTensor:
    """A 2-D GGUF weight as packed blocks: kept as stored when the kernels multiply its type
    (`KERNEL_TYPES`), otherwise (F32 weights, IQ1/IQ2/IQ3, TQ, MXFP4, ...) requantized to Q8_0
    once (`gguf_tensors` logs which)."""
    cols = tensor.shape[-1]
    if int(tensor.tensor_type) in KERNEL_TYPES:  # (F16 comes as float16 values: their bytes)
        raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(tensor.data.shape[0], -1)
        data = torch.from_numpy(np.array(raw, copy=True))
        return QuantTensor(data, int(tensor.tensor_type), cols)
    return to_q8_0(dequantized(tensor).reshape(-1, cols))


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values as a float32 array.

    Raises:
        ModelFileError: its type cannot be dequantized, or (for a type `check_tensors` does not
            scan) its values are not all finite.
    """
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelFileError(
            f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from exc
    out = np.array(array, dtype=np.float32, copy=True)
    if int(tensor.tensor_type) not in (*KERNEL_TYPES, 0, 1, 30) and not np.isfinite(out).all():
        raise ModelFileError(f"tensor {tensor.name} holds NaN or Inf values")
    return out


def gguf_tensors(
    reader: GGUFFile,
    config: LlamaConfig,
    arch: str,
    dtype: torch.dtype,
    progress: Progress | None = None,
    quantized: bool = False,
) -> tuple[dict[str, torch.Tensor | QuantTensor], tuple[float, ...] | None]:
    """Tensors under Hugging Face names, and llama3 `rope_freqs` factors if present.

    With `quantized`, 2-D weights stay packed (`QuantTensor`); otherwise every tensor is
    dequantized to `dtype` (Gemma 4's always: its decoder runs floats).
    """
    if isinstance(config, Gemma4Config):
        floats: dict[str, torch.Tensor | QuantTensor] = dict(
            gemma4_state_dict(config, _float_tensors(reader, dtype, progress))
        )
        return floats, None
    family = by_name(config.architecture)
    permuted = arch in family.gguf_permuted_qk
    sd: dict[str, torch.Tensor | QuantTensor] = {}
    freq_factors: tuple[float, ...] | None = None
    requantized: Counter[str] = Counter()
    for i, tensor in enumerate(reader.tensors):
        if progress is not None:
            progress(i / len(reader.tensors))
        if tensor.name in LONGROPE_TENSORS:  # read into the config (`gguf_config`)
            continue
        heads = _permuted_heads(tensor.name, config) if permuted else None
        if tensor.name.startswith("cls."):  # a reranker's head: float32, under its GGUF name
            sd[tensor.name] = torch.from_numpy(dequantized(tensor))
            reader.release(tensor)
            continue
        if quantized and len(tensor.shape) == 3:  # an expert stack: one packed view per expert
            if int(tensor.tensor_type) not in KERNEL_TYPES:
                requantized[tensor.tensor_type.name] += 1
            sd |= _expert_views(tensor, _hf_name(tensor.name, family))
            reader.release(tensor)
            continue
        is_router = tensor.name.endswith(".ffn_gate_inp.weight")  # floats: the router runs in torch
        if quantized and tensor.data.ndim == 2 and tensor.name != "rope_freqs.weight" and not is_router:
            if int(tensor.tensor_type) not in KERNEL_TYPES:
                requantized[tensor.tensor_type.name] += 1
            packed = as_stored(tensor)
            if heads is not None:  # each row is whole blocks: permute the rows
                packed = packed.permute_rows(unpermute_rotary(torch.arange(packed.rows), heads))
            for name, part in split_fused(_hf_name(tensor.name, family), packed, config):
                assert isinstance(part, QuantTensor)
                sd[name] = repacked(part)
            reader.release(tensor)
            continue
        w = torch.from_numpy(dequantized(tensor))
        if tensor.name == "rope_freqs.weight":
            freq_factors = tuple(float(x) for x in w.flatten().tolist())
            continue
        if heads is not None:
            w = unpermute_rotary(w, heads)
        for name, part in split_fused(_hf_name(tensor.name, family), w, config):
            assert isinstance(part, torch.Tensor)
            sd[name] = part.to(dtype)
        reader.release(tensor)
    if requantized:
        log.warning(
            "requantized to Q8_0 at load (no kernel multiplies them as stored): %s",
            ", ".join(f"{n} tensors of {t}" for t, n in sorted(requantized.items())),
        )
    return sd, freq_factors


def _float_tensors(
    reader: GGUFFile, dtype: torch.dtype, progress: Progress | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `reader` dequantized to `dtype`, under its GGUF name, released once read."""
    for i, tensor in enumerate(reader.tensors):
        if progress is not None:
            progress(i / len(reader.tensors))
        yield tensor.name, torch.from_numpy(dequantized(tensor)).to(dtype)
        reader.release(tensor)


def _expert_views(tensor: GGUFTensor, stacked_name: str) -> dict[str, QuantTensor]:
    """A GGUF expert stack `[experts, rows, cols]` (`...mlp.experts.gate_proj`) as one packed
    `QuantTensor` per expert under its per-expert name (`...mlp.experts.E.gate_proj.weight`),
    views into one buffer; a type the kernels do not multiply is requantized to Q8_0 expert by
    expert (never the whole stack in floats)."""
    experts, rows, cols = tensor.shape
    qtype = int(tensor.tensor_type)
    if qtype in KERNEL_TYPES:  # (F16 comes as float16 values: their bytes)
        stack = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(experts, rows, -1)
    else:
        per_expert = [
            to_q8_0(_dequantized_part(tensor, e).reshape(rows, cols)).data.numpy() for e in range(experts)
        ]
        stack, qtype = np.stack(per_expert), Q8_0
    prefix, _, projection = stacked_name.rpartition(".")
    return {
        f"{prefix}.{e}.{projection}.weight": view for e, view in enumerate(expert_views(stack, qtype, cols))
    }


def _dequantized_part(tensor: GGUFTensor, expert: int) -> np.ndarray:
    """Expert `expert` of a stack of a type the kernels do not multiply, as float32."""
    part = GGUFTensor(tensor.name, tensor.tensor_type, tensor.shape[1:], tensor.data[expert])
    return dequantized(part)


def split_fused(
    name: str, weight: torch.Tensor | QuantTensor, config: LlamaConfig
) -> list[tuple[str, torch.Tensor | QuantTensor]]:
    """A fused projection (Phi-3's `qkv_proj` [q + 2 kv, hidden], `gate_up_proj` [2 ffn, hidden])
    as its parts under Llama's names, split by rows (each packed row is whole blocks); any other
    tensor as it is."""
    if name.endswith("self_attn.qkv_proj.weight"):
        stem = name.removesuffix("qkv_proj.weight")
        sizes = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size}
    elif name.endswith("mlp.gate_up_proj.weight"):
        stem = name.removesuffix("gate_up_proj.weight")
        sizes = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    else:
        return [(name, weight)]
    parts: list[tuple[str, torch.Tensor | QuantTensor]] = []
    start = 0
    for part, rows in sizes.items():
        piece = (
            QuantTensor(weight.data[start : start + rows].contiguous(), weight.qtype, weight.cols)
            if isinstance(weight, QuantTensor)
            else weight[start : start + rows]
        )
        parts.append((f"{stem}{part}.weight", piece))
        start += rows
    return parts


def _hf_name(name: str, family: Architecture) -> str:
    """The Hugging Face name of GGUF tensor `name` in `family`."""
    m = _BLOCK.match(name)
    if m:
        suffix = family.gguf_layer_names.get(m.group(2))
        if suffix is None:
            raise ValueError(f"unexpected GGUF tensor {name}")
        return f"model.layers.{m.group(1)}.{suffix}"
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    raise ValueError(f"unexpected GGUF tensor {name}")


def _permuted_heads(name: str, config: LlamaConfig) -> int | None:
    """The head count to undo llama.cpp's q/k row permutation with, for a q or k projection."""
    m = _BLOCK.match(name)
    if m is None or not m.group(2).startswith(("attn_q.", "attn_k.")):
        return None
    return config.num_heads if m.group(2).startswith("attn_q.") else config.num_kv_heads


def gguf_tokenizer(meta: GGUFFile, context_length: int) -> TokenizerSpec:
    """The tokenizer described by `tokenizer.ggml.*` metadata.

    Raises:
        ModelFileError: a tokenizer key has the wrong type or length, or names a token that is
            not in the vocabulary.
    """
    kind = meta.text("tokenizer.ggml.model")
    try:
        family: Architecture | None = by_gguf(
            str(meta.text("general.architecture", "") or ""), str(meta.text("general.name", "") or "")
        )
    except ValueError:
        family = None  # a tokenizer alone (the model's family was checked where it mattered)
    if kind is None:
        raise ModelFileError("GGUF file lacks required metadata key 'tokenizer.ggml.model'")
    tokens = _list_of(meta, "tokenizer.ggml.tokens", str)
    if tokens is None:
        raise ModelFileError("GGUF file lacks required metadata key 'tokenizer.ggml.tokens'")
    token_types = _list_of(meta, "tokenizer.ggml.token_type", int, len(tokens)) or []
    merges = _list_of(meta, "tokenizer.ggml.merges", str)
    # a merge is "left right", split at its first space as the tokenizer builders do
    bad_merge = next((m for m in merges or () if not all(m.partition(" ")[::2]) or " " not in m), None)
    if bad_merge is not None:
        raise ModelFileError(f"metadata key 'tokenizer.ggml.merges': {bad_merge!r:.80} is not two tokens")
    special = {}
    for key in ("bos_token_id", "eos_token_id", "eot_token_id"):
        if f"tokenizer.ggml.{key}" in meta.fields:
            special[key] = meta.integer(f"tokenizer.ggml.{key}", 0, len(tokens) - 1)
    try:
        if kind == "gpt2":
            tok = byte_level_bpe_from_gguf(tokens, merges or [], token_types, meta.text("tokenizer.ggml.pre"))
            add_bos_default = False
        elif kind == "gemma4":  # (llama.cpp requires its merges and always adds BOS)
            if merges is None:
                raise ModelFileError("GGUF file lacks required metadata key 'tokenizer.ggml.merges'")
            tok = gemma4_from_gguf(tokens, merges, token_types)
            add_bos_default = True
        elif kind == "llama" and family is not None and family.gemma and not merges:
            tok = gemma_from_gguf(tokens, token_types)  # no prefix space, merges in file order
            add_bos_default = True
        elif kind == "llama":
            scores = _list_of(meta, "tokenizer.ggml.scores", float, len(tokens)) or [0.0] * len(tokens)
            tok = sentencepiece_bpe_from_gguf(tokens, scores, merges, token_types)
            add_bos_default = True
        else:
            raise ModelFileError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama, gemma4); "
                "use a Hugging Face directory with tokenizer.json instead"
            )
        tokenizer_json = tokenizer_json_of(tok)
    except ModelFileError:
        raise
    except Exception as e:  # the tokenizers library refusing the vocabulary or merges
        raise ModelFileError(f"metadata keys 'tokenizer.ggml.*' do not make a tokenizer: {e}") from e
    eos_id = special.get("eos_token_id")
    eos_ids = [eos_id] if eos_id is not None else []
    eot_id = special.get("eot_token_id")
    if eot_id is None and family is not None and family.end_of_turn in tokens:
        eot_id = tokens.index(family.end_of_turn)  # llama.cpp finds Gemma's EOT by its text too
    stops = [eot_id] + [tokens.index(t) for t in (family.gguf_stop_texts if family else ()) if t in tokens]
    eos_ids += [s for s in dict.fromkeys(stops) if s is not None and s not in eos_ids]
    add_bos = True if kind == "gemma4" else meta.get("tokenizer.ggml.add_bos_token")
    return TokenizerSpec(
        tokenizer_json=tokenizer_json,
        chat_template=meta.text("tokenizer.chat_template"),
        bos_token=special_token_text(tokens, special.get("bos_token_id")),
        eos_token=special_token_text(tokens, eos_id),
        add_bos_token=bool(add_bos) if add_bos is not None else add_bos_default,
        eos_token_ids=tuple(eos_ids),
        context_length=context_length,
    )


def _list_of(meta: GGUFFile, key: str, item: type, length: int | None = None) -> list[Any] | None:
    """The array value of `key` whose items are all `item` (and `length` of them), or None."""
    value = meta.get(key)
    if value is None:
        return None
    types = (int, float) if item is float else (item,)
    if (
        not isinstance(value, list)
        or not all(isinstance(v, types) and not isinstance(v, bool) for v in value)
        or (length is not None and len(value) != length)
    ):
        size = f"{len(value)} " if isinstance(value, list) else ""
        want = f"{length} " if length is not None else ""
        raise ModelFileError(
            f"metadata key {key!r}: expected an array of {want}{item.__name__} values, found {size}"
            f"{type(value).__name__}"
        )
    return value


def open_gguf(path: pathlib.Path) -> GGUFFile:
    """`path` read as a GGUF (header, metadata and tensor table checked against the file).

    Raises:
        ModelFileError: the file is not a well-formed GGUF (the message says where).
    """
    try:
        return GGUFFile(path)
    except (ModelFileError, OSError) as exc:
        raise ModelFileError(
            f"{path} is not a readable GGUF file ({exc}); if it is the cached default model, "
            "delete it and run `ft pull`"
        ) from exc


def load_gguf(
    path: pathlib.Path, dtype: torch.dtype, progress: Progress | None = None, quantized: bool = False
) -> tuple[LlamaConfig, dict[str, torch.Tensor | QuantTensor], TokenizerSpec, str]:
    """Config, state dict (HF names), tokenizer and model id of one GGUF file (see `gguf_tensors`).

    Every tensor is checked against the config its metadata describes before any is converted
    (`gguf_check`), so nothing inconsistent reaches torch or the packed kernels.

    Raises:
        ModelFileError: the file is malformed, or its tensors disagree with its metadata.
    """
    reader = open_gguf(path)
    from ft.model import gguf_hybrid

    if gguf_hybrid.family_of(reader) is not None:  # dequantized, as its checkpoint would load
        config, floats, spec = gguf_hybrid.load_runnable(path, dtype, progress)
        return config, dict(floats), spec, path.stem
    try:
        tokens = token_list(reader)
        config = gguf_config(reader, {t.name for t in reader.tensors}, len(tokens))
        check_tensors(reader, config, packed=quantized)
        check_vocabulary(config, len(tokens))
        for loss in converter_losses(reader, by_name(config.architecture)):
            log.log(
                logging.WARNING if loss.warns else logging.INFO,
                "%s: the checkpoint's %r is not in this GGUF (llama.cpp's converter does not write it): "
                "%s, as llama.cpp runs it; converted from a checkpoint with another %r, it differs from it",
                path.name, loss.setting, loss.assumed, loss.setting,
            )  # fmt: skip
        spec = gguf_tokenizer(reader, config.max_position_embeddings)
        sd, freq_factors = gguf_tensors(
            reader, config, str(reader.text("general.architecture")), dtype, progress, quantized
        )
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None
    if freq_factors is not None:
        config = LlamaConfig(**{**_fields(config), "rope_freq_factors": freq_factors})
    return config, sd, spec, path.stem


def converter_losses(meta: GGUFFile, family: Architecture) -> list[ConverterLoss]:
    """The settings of `family`'s checkpoints that `meta` does not say (`ConverterLoss`), which
    run as llama.cpp assumes them."""
    arch = meta.text("general.architecture")
    return [
        loss
        for loss in family.gguf_converter_losses
        if loss.key is None or f"{arch}.{loss.key}" not in meta.fields
    ]


def token_list(meta: GGUFFile) -> list[str]:
    """The GGUF's `tokenizer.ggml.tokens` (empty when it has none)."""
    return _list_of(meta, "tokenizer.ggml.tokens", str) or []


def gguf_rank_format(path: pathlib.Path, spec: TokenizerSpec, labels: int) -> RankFormat:
    """A reranker GGUF's pair format (`ft.model.rerank`): its `tokenizer.chat_template.rerank`,
    else the special tokens llama.cpp adds around the query and the document (BOS where the
    tokenizer adds it; EOS and SEP only where `tokenizer.ggml.add_eos_token` /
    `add_sep_token` say so, as for the byte-level and SentencePiece vocabularies ft reads).

    Raises:
        ModelFileError: a key has the wrong type, or the labels disagree with the head's rows.
    """
    meta = open_gguf(path)
    arch = str(meta.text("general.architecture"))
    if num_labels(meta, arch) != labels:
        raise ModelFileError(f"the classification head has {labels} rows for {num_labels(meta, arch)} labels")
    names = meta.get(f"{arch}.classifier.output_labels") or []
    tokens = _list_of(meta, "tokenizer.ggml.tokens", str) or []

    def token(key: str) -> int | None:
        full = f"tokenizer.ggml.{key}"
        return meta.integer(full, 0, len(tokens) - 1) if full in meta.fields else None

    eos, sep = token("eos_token_id"), token("seperator_token_id")  # (gguf-py's spelling)
    return RankFormat(
        num_labels=labels,
        labels=tuple(str(n) for n in names),
        template=meta.text("tokenizer.chat_template.rerank"),
        bos_id=token("bos_token_id"),
        eos_id=eos if eos is not None else sep,
        sep_id=sep,
        add_bos=spec.add_bos_token,
        add_eos=_flag(meta, "tokenizer.ggml.add_eos_token", default=False),
        add_sep=_flag(meta, "tokenizer.ggml.add_sep_token", default=False),
    )


def _fields(config: LlamaConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}
