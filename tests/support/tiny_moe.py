"""Tiny random mixtures of experts built by transformers (Mixtral, OLMoE), saved as safetensors
and as GGUFs the way llama.cpp's converter writes them, and synthetic MoE GGUFs of any size.

`mixtral_model` / `olmoe_model` are `MixtralForCausalLM` / `OlmoeForCausalLM` from their configs
(2 layers, hidden 128, 4 heads / 2 kv heads of 32, 8 experts of 64), norms and routers randomized
so q/k norms matter and routing is decisive. `write_moe_gguf` writes one of them (or a
`Qwen3MoeForCausalLM`) as a GGUF: Mixtral as a `llama` file with `llama.expert_count` and q/k
rows permuted as llama.cpp's converter does, OLMoE as `olmoe` (q/k norms over the whole
projections), Qwen3-MoE as `qwen3moe`; experts stacked `[experts, rows, cols]` per projection, the
router F32, the other 2-D weights of `qtype`; a config's `sliding_window` as the file's
`{arch}.attention.sliding_window`. `write_synthetic_moe_gguf` writes random Q8_0
blocks of any shape straight to disk (no float model in memory: for memory measurements).
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.support.chat_templates import TEMPLATES
from tests.support.gguf_files import _packed, tiny_tokens
from tests.support.tiny_qwen3 import EOS, _gguf_tensors

HIDDEN, HEADS, KV_HEADS, EXPERTS, EXPERT_FFN, LAYERS = 128, 4, 2, 8, 64, 2
GGUF_ARCH = {"mixtral": "llama", "olmoe": "olmoe", "qwen3_moe": "qwen3moe"}


def _randomized(model: Any, seed: int) -> Any:
    """`model` with random weights: norms near one, routers wide (clear choices), the rest small."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                scale = 0.5 if name.endswith("mlp.gate.weight") else 0.08
                p.copy_(scale * torch.randn(p.shape, generator=generator))
    return model.eval()


def _common(**overrides: Any) -> dict[str, Any]:
    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=tokens.index(EOS),
    )  # fmt: skip
    return fields | overrides


def mixtral_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `MixtralForCausalLM`: 8 experts of 64, 2 per token, rope base 1e6."""
    import transformers

    fields = _common(num_local_experts=EXPERTS, num_experts_per_tok=2, rope_theta=1_000_000.0, **overrides)
    return _randomized(transformers.MixtralForCausalLM(transformers.MixtralConfig(**fields)), seed)


def olmoe_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `OlmoeForCausalLM`: 8 experts of 64, 3 per token, top-k not renormalized."""
    import transformers

    fields = _common(num_experts=EXPERTS, num_experts_per_tok=3, rope_theta=10_000.0, **overrides)
    return _randomized(transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**fields)), seed)


def _llama_permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for `llama` files: rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_k_blocks(data: np.ndarray) -> np.ndarray:
    """`data` `[..., cols]` (cols a multiple of 256) as real Q4_K blocks, which gguf-py cannot
    write: every sub-block's 6-bit scale and min 32, so a value is `32 * d * (q - 7.5)` with one
    `d` per block of 256 (`dmin = 7.5 d`); coarser than llama.cpp's quantizer, the same format."""
    *lead, cols = data.shape
    x = data.reshape(-1, 256).astype(np.float32)  # [blocks, 256]
    d = (np.abs(x).max(axis=1) / (32 * 7.5)).astype(np.float16)
    d = np.where(d == 0, np.float16(1e-7), d)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    step = 32 * d.astype(np.float32)[:, None]
    q = np.clip(np.rint((x + 32 * dmin.astype(np.float32)[:, None]) / step), 0, 15).astype(np.uint8)
    blocks = np.zeros((x.shape[0], 144), dtype=np.uint8)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    blocks[:, 4:12] = 32 | (2 << 6)  # scales and mins of sub-blocks 0-3, high bits of 4-7
    blocks[:, 12:16] = 0  # low bits of sub-blocks 4-7's scales and mins (32: all in the high bits)
    chunks = q.reshape(-1, 4, 2, 32)  # 64 values per chunk: its two sub-blocks, low then high nibbles
    blocks[:, 16:] = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    return blocks.reshape(*lead, cols // 256 * 144)


def _expert_blocks(name: str, data: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """An expert stack `[experts, rows, cols]` as blocks of `qtype`: quantized from `data` (Q4_K
    by `q4_k_blocks`), or (another K-quant gguf-py cannot write) random blocks with sane scales
    of the same shape."""
    experts, rows, cols = data.shape
    if qtype == GGMLQuantizationType.Q4_K:
        return q4_k_blocks(data)
    try:
        return np.asarray(quantize(data.reshape(-1, cols), qtype)).reshape(experts, rows, -1)
    except NotImplementedError:
        rng = np.random.default_rng([seed, len(name), *name.encode()])
        return _packed(qtype, experts * rows, cols, rng).reshape(experts, rows, -1)


def write_moe_gguf(
    path: pathlib.Path,
    model: Any,
    *,
    qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    expert_type: GGMLQuantizationType | None = None,
    seed: int = 0,
) -> pathlib.Path:
    """`model` (Mixtral, OLMoE or Qwen3-MoE) as its llama.cpp GGUF: 2-D weights of `qtype`, the
    experts of `expert_type` (default `qtype`; a K-quant gguf-py cannot write becomes random
    blocks of that type, so only packed-against-float checks apply), router and norms F32."""
    c = model.config
    arch = GGUF_ARCH[c.model_type]
    expert_type = expert_type or qtype
    tokens, merges, types = tiny_tokens()
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{c.model_type}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if c.model_type == "mixtral" and c.sliding_window:
        w.add_sliding_window(c.sliding_window)  # `llama.attention.sliding_window`, as Mistral's
    if c.model_type == "qwen3_moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index(EOS))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATES["qwen-3"])
    for name, data in _gguf_tensors(model).items():
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if name.endswith("attn_q.weight") else c.num_key_value_heads
            data = _llama_permuted(data, heads)
        if data.ndim == 3:
            w.add_tensor(name, _expert_blocks(name, data, expert_type, seed), raw_dtype=expert_type)
        elif data.ndim == 2 and not name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, np.asarray(quantize(data, qtype)), raw_dtype=qtype)
        else:
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _q8_0_blocks(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks of a float shape `[..., cols]`: uint8 `[..., cols // 32 * 34]`."""
    *lead, cols = shape
    blocks = rng.integers(-127, 128, size=(*lead, cols // 32, 34), dtype=np.int8).view(np.uint8)
    scales = rng.uniform(0.0002, 0.0006, size=(*lead, cols // 32)).astype(np.float16)
    blocks[..., :2] = scales.view(np.uint8).reshape(*lead, cols // 32, 2)
    return blocks.reshape(*lead, -1)


def write_synthetic_moe_gguf(
    path: pathlib.Path,
    *,
    hidden: int = 1024,
    expert_ffn: int = 2816,
    experts: int = 8,
    used: int = 2,
    layers: int = 8,
    heads: int = 8,
    kv_heads: int = 4,
    seed: int = 0,
) -> pathlib.Path:
    """A random `qwen3moe` GGUF of any size, every 2-D/3-D weight random Q8_0 blocks, one tensor
    in memory at a time (for load-memory measurements; its tokens mean nothing)."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = tiny_tokens()
    head_dim = hidden // heads
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_name("synthetic-moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(expert_ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(expert_ffn)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index(EOS))

    def add(name: str, *shape: int) -> None:
        w.add_tensor(name, _q8_0_blocks(shape, rng), raw_dtype=GGMLQuantizationType.Q8_0)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q, kv = heads * head_dim, kv_heads * head_dim
    add("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", hidden)
        norm(p + "ffn_norm.weight", hidden)
        norm(p + "attn_q_norm.weight", head_dim)
        norm(p + "attn_k_norm.weight", head_dim)
        add(p + "attn_q.weight", q, hidden)
        add(p + "attn_k.weight", kv, hidden)
        add(p + "attn_v.weight", kv, hidden)
        add(p + "attn_output.weight", hidden, q)
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((experts, hidden)).astype(np.float32))
        add(p + "ffn_gate_exps.weight", experts, expert_ffn, hidden)
        add(p + "ffn_up_exps.weight", experts, expert_ffn, hidden)
        add(p + "ffn_down_exps.weight", experts, hidden, expert_ffn)
    norm("output_norm.weight", hidden)
    add("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
