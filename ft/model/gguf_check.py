"""What a GGUF's tensors must be, given the config its metadata describes: checked once at load.

The packed kernels (`kernels.cpp`) size every buffer from the config, so a file whose tensors
disagree with its metadata would have them read or write past a buffer. This is the one place
that compares the two, before any tensor reaches native code or torch: each tensor's shape
against the config, its type against what the path can multiply, its scales and float values
for NaN/Inf, and the set of tensors against the one the architecture needs.
"""

from __future__ import annotations

import re

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ft.model.architectures import by_name
from ft.model.gemma4_config import Gemma4Config
from ft.model.gguf_file import GGUFFile, GGUFTensor, ModelFileError
from ft.model.gguf_gemma4 import gemma4_tensor_shapes
from ft.model.llama import LlamaConfig
from ft.model.quant import KERNEL_TYPES

QK = 32  # the packed kernels quantize activations in blocks of 32
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# fp16 scale fields (byte offsets in a block) of the types the kernels multiply as stored
_SCALE_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 14: (208,)}
_SCALE_FIELDS |= {6: (0,), 7: (0, 2), 10: (80, 82), 11: (108,), 13: (0, 2), 20: (0,), 23: (0,)}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `config` needs (or may have), under GGUF names, with its torch shape."""
    c = config
    h, q, kv, ffn = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, h), "output_norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["output.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
            p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
            p + "attn_output.weight": (h, q),
            p + "ffn_gate.weight": (ffn, h), p + "ffn_up.weight": (ffn, h), p + "ffn_down.weight": (h, ffn),
        }  # fmt: skip
        if c.attention_bias:
            shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
        if c.is_moe_layer(i):  # the experts replace the dense MLP
            e, moe = c.num_experts, c.moe_intermediate_size
            for part in ("ffn_gate", "ffn_up", "ffn_down"):
                del shapes[p + part + ".weight"]
            shapes |= {
                p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, moe, h),
                p + "ffn_up_exps.weight": (e, moe, h), p + "ffn_down_exps.weight": (e, h, moe),
            }  # fmt: skip
        if c.qk_norm:
            q_norm, k_norm = (q, kv) if c.qk_norm_whole else (c.head_dim, c.head_dim)  # OLMoE: whole q, k
            shapes |= {p + "attn_q_norm.weight": (q_norm,), p + "attn_k_norm.weight": (k_norm,)}
        if c.post_norms:  # Gemma: the attention's and the MLP's outputs normed
            shapes |= {p + "post_attention_norm.weight": (h,), p + "post_ffw_norm.weight": (h,)}
        if by_name(c.architecture).gguf_fused:  # Phi-3: q|k|v and gate|up as stored
            for part in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
                del shapes[p + part + ".weight"]
            shapes |= {p + "attn_qkv.weight": (q + 2 * kv, h), p + "ffn_up.weight": (2 * ffn, h)}
    return shapes


def check_tensors(reader: GGUFFile, config: LlamaConfig, *, packed: bool) -> None:
    """Every tensor `config` needs is present with its shape, and nothing else is there.

    `packed`: the 2-D weights go to the packed kernels as stored (or requantized to Q8_0), so
    their rows must be whole blocks of 32 too.

    Raises:
        ModelFileError: naming the tensor (or the metadata key), what was expected and found.
    """
    found = {t.name: t for t in reader.tensors}
    if isinstance(config, Gemma4Config):  # layers of their own shapes (`gguf_gemma4` says them)
        expected, optional = gemma4_tensor_shapes(config)
        expected |= {name: shape for name, shape in optional.items() if name in found}
    else:
        expected = expected_shapes(config)
        if "rope_freqs.weight" in found:  # llama3 rotary factors: one per rotary pair
            expected["rope_freqs.weight"] = (config.rotary_width // 2,)
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):  # Phi-3's longrope
        if name in found:
            expected[name] = (config.rotary_width // 2,)
    head = classifier_shapes(reader, config, set(found))
    expected |= head
    for name, shape in expected.items():
        tensor = found.get(name)
        if tensor is None:
            raise ModelFileError(f"tensor {name} is missing (the metadata describes {_summary(config)})")
        if tensor.shape != shape:
            described = _summary(config) + (f", {shape[0]} labels" if name.startswith("cls.output") else "")
            raise ModelFileError(
                f"tensor {name}: expected shape {list(shape)} from the metadata ({described}), "
                f"found {list(tensor.shape)}"
            )
        if packed and len(shape) >= 2 and shape[-1] % QK and name not in head:  # (experts: every expert's
            # rows; the head loads as floats)
            raise ModelFileError(f"tensor {name}: rows of {shape[-1]} are not whole blocks of {QK}")
        _check_finite(tensor)
        reader.release(tensor)
    for name in found.keys() - expected.keys():
        m = _BLOCK.match(name)
        if m and int(m.group(1)) >= config.num_layers:
            raise ModelFileError(f"tensor {name} is past the {config.num_layers} layers of 'block_count'")
        raise ModelFileError(f"unexpected tensor {name} (not part of a {config.architecture} model)")


def num_labels(reader: GGUFFile, arch: str) -> int:
    """The classifier's outputs: `{arch}.classifier.output_labels`' count, else one (llama.cpp's)."""
    key = f"{arch}.classifier.output_labels"
    labels = reader.get(key)
    if labels is None:
        return 1
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        raise ModelFileError(
            f"metadata key {key!r}: expected a non-empty array of strings, found {labels!r:.80}"
        )
    return len(labels)


def classifier_shapes(reader: GGUFFile, config: LlamaConfig, names: set[str]) -> dict[str, tuple[int, ...]]:
    """The classification head's tensors in the file (`cls.*`, llama.cpp's names) with their
    shapes: `cls.output.weight` `[labels, width]` (required for rank pooling) and its bias, and
    the optional dense layer `cls.weight` `[hidden, hidden]` and `cls.bias` before it."""
    present = {n for n in names if n.startswith("cls.")}
    if not present and config.pooling != "rank":
        return {}
    if "cls.output.weight" not in present:
        what = "its pooling_type is rank (4)" if config.pooling == "rank" else f"it has {sorted(present)}"
        raise ModelFileError(
            f"tensor cls.output.weight is missing: {what}, which needs a classification head [labels, hidden]"
        )
    arch = str(reader.text("general.architecture"))
    labels, h = num_labels(reader, arch), config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"cls.output.weight": (labels, h)}
    if "cls.output.bias" in present:
        shapes["cls.output.bias"] = (labels,)
    if "cls.weight" in present:
        shapes["cls.weight"] = (h, h)
    if "cls.bias" in present:
        if "cls.weight" not in present:
            raise ModelFileError("tensor cls.bias without cls.weight (the dense layer it belongs to)")
        shapes["cls.bias"] = (h,)
    return shapes


def check_vocabulary(config: LlamaConfig, num_tokens: int) -> None:
    """The tokenizer can only produce ids the embedding has rows for."""
    if not 0 < num_tokens <= config.vocab_size:
        raise ModelFileError(
            f"metadata key 'tokenizer.ggml.tokens': {num_tokens} tokens for an embedding of "
            f"{config.vocab_size} rows (expected 1 to {config.vocab_size})"
        )


def _summary(c: LlamaConfig) -> str:
    return (
        f"hidden {c.hidden_size}, {c.num_heads} heads / {c.num_kv_heads} kv heads of {c.head_dim}, "
        f"ffn {c.intermediate_size}, vocab {c.vocab_size}, {c.num_layers} layers"
        + (f", {c.num_experts} experts of {c.moe_intermediate_size}" if c.num_experts else "")
        + (
            f", heads of {sorted(set(c.layer_head_dims))} by layer type"
            if isinstance(c, Gemma4Config)
            else ""
        )
    )


def _check_finite(tensor: GGUFTensor) -> None:
    """No NaN or Inf in a float tensor's values, or in a packed tensor's fp16 scales."""
    data = tensor.data
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        bad = not np.isfinite(data).all()
    elif tensor.tensor_type == GGMLQuantizationType.BF16:
        bits = np.ascontiguousarray(data).view(np.uint16)
        bad = bool(((bits & 0x7F80) == 0x7F80).any())
    elif int(tensor.tensor_type) in KERNEL_TYPES:
        _, size = GGML_QUANT_SIZES[tensor.tensor_type]
        blocks = data.reshape(-1, size)
        bad = False
        for at in _SCALE_FIELDS[int(tensor.tensor_type)]:
            bits = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.uint16)
            bad = bad or bool(((bits & 0x7C00) == 0x7C00).any())
    else:
        return  # dequantized at load; `gguf_loader` checks the floats it gets
    if bad:
        raise ModelFileError(f"tensor {tensor.name} holds NaN or Inf values")
