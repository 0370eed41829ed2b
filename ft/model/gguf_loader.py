"""Load a GGUF file: config from metadata, tokenizer from its vocabulary, dequantized tensors."""

from __future__ import annotations

import pathlib
import re
import struct
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from ft.model.gguf_file import GGUFFile, GGUFTensor
from ft.model.kernels import repacked
from ft.model.llama import LlamaConfig, Progress
from ft.model.quant import KERNEL_TYPES, QuantTensor, to_q8_0
from ft.tokenizer.spec import (
    TokenizerSpec,
    byte_level_bpe_from_gguf,
    sentencepiece_bpe_from_gguf,
    special_token_text,
    tokenizer_json_of,
)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_config(meta: GGUFFile, tensor_names: set[str], vocab_size: int) -> LlamaConfig:
    """A `LlamaConfig` from `{arch}.*` metadata."""
    arch = meta.require("general.architecture")
    name = str(meta.get("general.name", "")).lower()
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or 0)
    rope_scaling: dict[str, Any] | None = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": float(meta.require(f"{arch}.rope.scaling.factor")),
        }
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    return LlamaConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size") or vocab_size),
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim if head_dim else hidden // num_heads,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        architecture="mistral" if arch == "llama" and "mistral" in name else arch,
    )


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs → half-split), as transformers does."""
    rows = w.shape[0]
    dim = rows // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def as_stored(tensor: GGUFTensor) -> QuantTensor:
    """A 2-D GGUF weight as packed blocks: kept as stored when the kernels multiply its type,
    otherwise requantized to Q8_0 once."""
    cols = int(tensor.data.shape[-1]) if tensor.tensor_type in (0, 1) else _cols(tensor)
    if int(tensor.tensor_type) in KERNEL_TYPES:
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
        return QuantTensor(data, int(tensor.tensor_type), cols)
    return to_q8_0(_dequantized(tensor).reshape(-1, cols))


def _dequantized(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values as a float32 array."""
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from exc
    return np.array(array, dtype=np.float32, copy=True)


def _cols(tensor: GGUFTensor) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    return int(tensor.data.shape[-1]) // type_size * block


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
    dequantized to `dtype`.
    """
    sd: dict[str, torch.Tensor | QuantTensor] = {}
    freq_factors: tuple[float, ...] | None = None
    for i, tensor in enumerate(reader.tensors):
        if progress is not None:
            progress(i / len(reader.tensors))
        if quantized and tensor.data.ndim == 2 and tensor.name != "rope_freqs.weight":
            sd[_hf_name(tensor.name)] = repacked(_unpermuted(as_stored(tensor), tensor.name, config, arch))
            continue
        w = torch.from_numpy(_dequantized(tensor))
        if tensor.name == "rope_freqs.weight":
            freq_factors = tuple(float(x) for x in w.flatten().tolist())
            continue
        m = _BLOCK.match(tensor.name)
        if m:
            suffix = _LAYER_NAMES.get(m.group(2))
            if suffix is None:
                raise ValueError(f"unexpected GGUF tensor {tensor.name}")
            if arch == "llama" and m.group(2).startswith("attn_q."):
                w = unpermute_rotary(w, config.num_heads)
            elif arch == "llama" and m.group(2).startswith("attn_k."):
                w = unpermute_rotary(w, config.num_kv_heads)
            name = f"model.layers.{m.group(1)}.{suffix}"
        elif tensor.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[tensor.name]
        else:
            raise ValueError(f"unexpected GGUF tensor {tensor.name}")
        sd[name] = w.to(dtype)
    return sd, freq_factors


def _hf_name(name: str) -> str:
    m = _BLOCK.match(name)
    if m:
        suffix = _LAYER_NAMES.get(m.group(2))
        if suffix is None:
            raise ValueError(f"unexpected GGUF tensor {name}")
        return f"model.layers.{m.group(1)}.{suffix}"
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    raise ValueError(f"unexpected GGUF tensor {name}")


def _unpermuted(w: QuantTensor, name: str, config: LlamaConfig, arch: str) -> QuantTensor:
    """Undo llama.cpp's q/k row permutation on packed rows (each row is whole blocks)."""
    m = _BLOCK.match(name)
    if arch != "llama" or m is None or not m.group(2).startswith(("attn_q.", "attn_k.")):
        return w
    heads = config.num_heads if m.group(2).startswith("attn_q.") else config.num_kv_heads
    return w.permute_rows(unpermute_rotary(torch.arange(w.rows), heads))


def gguf_tokenizer(meta: GGUFFile, context_length: int) -> TokenizerSpec:
    """The tokenizer described by `tokenizer.ggml.*` metadata."""
    kind = meta.require("tokenizer.ggml.model")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    merges: list[str] | None = meta.get("tokenizer.ggml.merges")
    if kind == "gpt2":
        tok = byte_level_bpe_from_gguf(tokens, merges or [], token_types, meta.get("tokenizer.ggml.pre"))
        add_bos_default = False
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        tok = sentencepiece_bpe_from_gguf(tokens, scores, merges, token_types)
        add_bos_default = True
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama); "
            "use a Hugging Face directory with tokenizer.json instead"
        )
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [eos_id] if isinstance(eos_id, int) else []
    eot_id = meta.get("tokenizer.ggml.eot_token_id")
    if isinstance(eot_id, int) and eot_id not in eos_ids:
        eos_ids.append(eot_id)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    return TokenizerSpec(
        tokenizer_json=tokenizer_json_of(tok),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=special_token_text(tokens, meta.get("tokenizer.ggml.bos_token_id")),
        eos_token=special_token_text(tokens, eos_id),
        add_bos_token=bool(add_bos) if add_bos is not None else add_bos_default,
        eos_token_ids=tuple(eos_ids),
        context_length=context_length,
    )


def load_gguf(
    path: pathlib.Path, dtype: torch.dtype, progress: Progress | None = None, quantized: bool = False
) -> tuple[LlamaConfig, dict[str, torch.Tensor | QuantTensor], TokenizerSpec, str]:
    """Config, state dict (HF names), tokenizer and model id of one GGUF file (see `gguf_tensors`)."""
    try:
        reader = GGUFFile(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{path} is not a readable GGUF file ({exc}); if it is the cached default model, "
            "delete it and run `ft pull`"
        ) from exc
    meta = reader
    names = {t.name for t in reader.tensors}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = gguf_config(meta, names, len(tokens))
    arch = meta.require("general.architecture")
    sd, freq_factors = gguf_tensors(reader, config, arch, dtype, progress, quantized)
    if freq_factors is not None:
        config = LlamaConfig(**{**_fields(config), "rope_freq_factors": freq_factors})
    spec = gguf_tokenizer(meta, config.max_position_embeddings)
    return config, sd, spec, path.stem


def _fields(config: LlamaConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}
