"""LFM2 (`lfm2`) GGUFs back into their checkpoints' `config.json` and tensors.

llama.cpp's converter (`conversion/lfm2.py`, `LFM2Model`) renames, squeezes the short conv's
`[hidden, 1, L]` weight to `[hidden, L]` (undone here) and writes the layer kinds as
`attention.head_count_kv`, 0 for a conv layer. It writes the MLP's width after LFM2's
adjustment (`block_auto_adjust_ff_dim`: two thirds, times `block_ffn_dim_multiplier`, rounded up
to `block_multiple_of`), which no longer says the checkpoint's `intermediate_size`: the config
says that width with the adjustment off, the same model. No norm offset (LFM2's norms are
`x * w`) and no q/k permutation. A checkpoint with `conv_bias` does not convert (the converter
fails on the bias), so a file with conv biases is refused as unexpected tensors.
"""

from __future__ import annotations

from ft.model.gguf_file import MAX_WIDTH, GGUFFile, ModelFileError
from ft.model.gguf_hybrid.common import (
    MAX_CONV_KERNEL,
    Config,
    Keys,
    Piece,
    attention_kv_heads,
    common_config,
    conv_weight,
    f32,
    global_pieces,
    heads,
    layer_count,
    rope_theta,
    same,
)


def lfm2_config(meta: GGUFFile, arch: str) -> Config:
    """The `config.json` of an `lfm2` GGUF."""
    keys = Keys(meta, arch)
    num_layers = layer_count(keys)
    cfg = common_config(meta, keys, num_layers)
    num_heads = heads(keys)
    attends, num_kv = attention_kv_heads(keys, num_layers, num_heads)
    head_dim = keys.quotient("embedding_length", cfg["hidden_size"], num_heads, "the heads")
    if head_dim % 2:
        raise ModelFileError(
            f"the head size {head_dim} (hidden / heads) is odd (the rotary embedding turns pairs)"
        )
    return cfg | {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv,
        "layer_types": ["full_attention" if a else "conv" for a in attends],
        "intermediate_size": keys.integer("feed_forward_length", 1, MAX_WIDTH),
        "block_auto_adjust_ff_dim": False,  # (the file's width is the adjusted one)
        "conv_L_cache": keys.integer("shortconv.l_cache", 1, MAX_CONV_KERNEL),
        "conv_bias": False,
        "norm_eps": f32(keys.number("attention.layer_norm_rms_epsilon", 0.0, 1.0, 1e-5)),
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta(keys, 1_000_000.0)},
    }


def lfm2_pieces(cfg: Config) -> list[Piece]:
    """The Hugging Face tensors of an LFM2 config, from its GGUF (`token_embd_norm` is LFM2's
    final norm, `embedding_norm` in its checkpoints)."""
    h, ff = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = h, cfg["num_key_value_heads"] * d
    pieces = global_pieces(cfg, "model.embedding_norm.weight", gguf_final_norm="token_embd_norm.weight")
    for i, kind in enumerate(cfg["layer_types"]):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        pieces += [
            same(p + "attn_norm.weight", (h,), hf + "operator_norm.weight"),
            same(p + "ffn_norm.weight", (h,), hf + "ffn_norm.weight"),
            same(p + "ffn_gate.weight", (ff, h), hf + "feed_forward.w1.weight"),
            same(p + "ffn_up.weight", (ff, h), hf + "feed_forward.w3.weight"),
            same(p + "ffn_down.weight", (h, ff), hf + "feed_forward.w2.weight"),
        ]
        if kind == "conv":
            c = p + "shortconv."
            pieces += [
                same(c + "conv.weight", (h, cfg["conv_L_cache"]), hf + "conv.conv.weight", conv_weight),
                same(c + "in_proj.weight", (3 * h, h), hf + "conv.in_proj.weight"),
                same(c + "out_proj.weight", (h, h), hf + "conv.out_proj.weight"),
            ]
            continue
        a = hf + "self_attn."
        pieces += [
            same(p + "attn_q.weight", (q, h), a + "q_proj.weight"),
            same(p + "attn_k.weight", (kv, h), a + "k_proj.weight"),
            same(p + "attn_v.weight", (kv, h), a + "v_proj.weight"),
            same(p + "attn_output.weight", (h, q), a + "out_proj.weight"),
            same(p + "attn_q_norm.weight", (d,), a + "q_layernorm.weight"),
            same(p + "attn_k_norm.weight", (d,), a + "k_layernorm.weight"),
        ]
    return pieces
