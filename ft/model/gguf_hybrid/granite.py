"""Granite 4.0-H (`granitehybrid`) GGUFs back into their checkpoints' `config.json` and tensors.

What llama.cpp's converter (`conversion/granite.py` `GraniteHybridModel`, over `Mamba2Model`
and `GraniteMoeModel`) did, undone here: the attention layers' q/k rows interleaved by rotary
pairs (`LlamaModel.permute`, though Granite 4.0-H has no rotary embedding); the experts'
fused `input_linear` split into `ffn_gate_exps` / `ffn_up_exps` and the shared MLP's into
`ffn_gate_shexp` / `ffn_up_shexp` (`ffn_gate` / `ffn_up` in a model without experts);
`A_log` stored as `A = -exp(A_log)` of shape `[heads, 1]`, `D` as `[heads, 1]`, the conv
squeezed to `[channels, kernel]`, the grouped norm reshaped to `[groups, inner / groups]`. The
layer kinds are `attention.head_count_kv`: 0 for a Mamba-2 layer, as llama.cpp reads them.

What the converter does not write (`GRANITE_LOSSES`): the checkpoint's
`position_embedding_type` (`rope.scaling.finetuned` is set for Bamba only, so every Granite
4.0-H file says no rotary embedding), its `max_position_embeddings` (2^20 without rotary) and
`time_step_limit` (llama.cpp clamps nothing). Published Granite 4.0-H checkpoints have no
rotary and no clamp. A multiplier the file leaves out is llama.cpp's default: 1, and the
attention's 1/sqrt(head size).

NOTE: the converter finds the attention layers by `layer_types` "attention" (the published
configs' name). A config that transformers 5 rewrote ("full_attention") converts to a file
whose every layer reads as Mamba-2 while its attention layers hold attention tensors:
refused here (an attention layer's Mamba-2 tensors are missing).
"""

from __future__ import annotations

from ft.model.architectures import ConverterLoss
from ft.model.gguf_file import MAX_EXPERTS, MAX_HEADS, MAX_WIDTH, GGUFFile, ModelFileError
from ft.model.gguf_hybrid.common import (
    MAX_CONV_KERNEL,
    MAX_STATE,
    Config,
    Keys,
    Piece,
    a_log,
    attention_kv_heads,
    common_config,
    conv_weight,
    f32,
    global_pieces,
    heads,
    joined,
    layer_count,
    rope_theta,
    same,
)
from ft.model.gguf_loader import unpermute_rotary

GRANITE_LOSSES = (
    ConverterLoss("position_embedding_type", None, "no rotary embedding, as in Granite 4.0-H"),
    ConverterLoss(
        "max_position_embeddings", None, "2^20 positions (the converter's for a model without rotary)"
    ),
    ConverterLoss("time_step_limit", None, "dt unclamped, (0, inf), as in Granite 4.0-H"),
)


def granite_config(meta: GGUFFile, arch: str) -> Config:
    """The `config.json` of a `granitehybrid` GGUF."""
    keys = Keys(meta, arch)
    num_layers = layer_count(keys)
    cfg = common_config(meta, keys, num_layers)
    hidden, num_heads = cfg["hidden_size"], heads(keys)
    attends, num_kv = attention_kv_heads(keys, num_layers, num_heads)
    head_dim = keys.quotient("embedding_length", hidden, num_heads, "the heads")
    uses_rope = keys.flag("rope.scaling.finetuned", False)
    if uses_rope and keys.integer("rope.dimension_count", 1, head_dim, default=head_dim) != head_dim:
        raise ModelFileError(
            f"metadata key {keys.key('rope.dimension_count')!r}: partial rotary embeddings (Bamba's) "
            "are not supported"
        )
    inner = keys.integer("ssm.inner_size", 1, MAX_WIDTH)
    num_ssm_heads = keys.integer("ssm.time_step_rank", 1, MAX_HEADS)
    num_groups = keys.integer("ssm.group_count", 1, MAX_HEADS)
    keys.quotient("ssm.inner_size", inner, num_groups, "the groups of 'ssm.group_count'")
    num_experts = keys.integer("expert_count", 0, MAX_EXPERTS, default=0)
    cfg |= {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "num_attention_heads": num_heads,
        "hidden_act": "silu",  # (llama.cpp's graph hard-codes it)
        "num_key_value_heads": num_kv,
        "layer_types": ["attention" if a else "mamba" for a in attends],  # (the published configs' names)
        "intermediate_size": keys.integer("feed_forward_length", 1, MAX_WIDTH),
        "shared_intermediate_size": keys.integer("expert_shared_feed_forward_length", 1, MAX_WIDTH),
        "num_local_experts": num_experts,
        "num_experts_per_tok": keys.integer("expert_used_count", 1, num_experts)
        if num_experts
        else keys.integer("expert_used_count", 0, MAX_EXPERTS, default=0),  # (unused: the file's value)
        "mamba_n_heads": num_ssm_heads,
        "mamba_n_groups": num_groups,
        "mamba_d_state": keys.integer("ssm.state_size", 1, MAX_STATE),
        "mamba_d_head": keys.quotient(
            "ssm.inner_size", inner, num_ssm_heads, "the heads of 'ssm.time_step_rank'"
        ),
        "mamba_d_conv": keys.integer("ssm.conv_kernel", 1, MAX_CONV_KERNEL),
        "mamba_expand": keys.quotient("ssm.inner_size", inner, hidden, "the hidden size"),
        "rms_norm_eps": f32(keys.number("attention.layer_norm_rms_epsilon", 0.0, 1.0, 1e-5)),
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta(keys)},
        "position_embedding_type": "rope" if uses_rope else "nope",
        # llama.cpp reads a missing (or 0) multiplier as none: 1, and the attention's usual scale
        "embedding_multiplier": f32(keys.number("embedding_scale", 0.0, 1e6, 0.0)) or 1.0,
        "residual_multiplier": f32(keys.number("residual_scale", 0.0, 1e6, 0.0)) or 1.0,
        "attention_multiplier": f32(keys.number("attention.scale", 0.0, 1e6, 0.0)) or head_dim**-0.5,
        "logits_scaling": f32(keys.number("logit_scale", 0.0, 1e6, 0.0)) or 1.0,
    }
    names = {t.name for t in meta.tensors}
    first_ssm = next((i for i, a in enumerate(attends) if not a), None)
    first_attention = next((i for i, a in enumerate(attends) if a), None)
    cfg["mamba_conv_bias"] = first_ssm is not None and f"blk.{first_ssm}.ssm_conv1d.bias" in names
    cfg["mamba_proj_bias"] = first_ssm is not None and f"blk.{first_ssm}.ssm_in.bias" in names
    cfg["attention_bias"] = first_attention is not None and f"blk.{first_attention}.attn_q.bias" in names
    return cfg


def granite_pieces(cfg: Config) -> list[Piece]:
    """The Hugging Face tensors of a Granite 4.0-H config, from its GGUF."""
    h = cfg["hidden_size"]
    pieces = global_pieces(cfg, "model.norm.weight")
    for i, kind in enumerate(cfg["layer_types"]):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        pieces += [
            same(p + "attn_norm.weight", (h,), hf + "input_layernorm.weight"),
            same(p + "ffn_norm.weight", (h,), hf + "post_attention_layernorm.weight"),
        ]
        pieces += (
            _attention(cfg, p, hf + "self_attn.") if kind == "attention" else _mamba(cfg, p, hf + "mamba.")
        )
        pieces += _mlp(cfg, p, hf)
    return pieces


def _attention(cfg: Config, p: str, a: str) -> list[Piece]:
    """Attention, its q and k rows back from the converter's rotary-pair interleave."""
    h, num_heads, num_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    kv = num_kv * (h // num_heads)
    suffixes = ("weight", "bias") if cfg["attention_bias"] else ("weight",)
    out = []
    for s in suffixes:
        w = (h,) if s == "weight" else ()
        out += [
            same(f"{p}attn_q.{s}", (h, *w), f"{a}q_proj.{s}", lambda t: unpermute_rotary(t, num_heads)),
            same(f"{p}attn_k.{s}", (kv, *w), f"{a}k_proj.{s}", lambda t: unpermute_rotary(t, num_kv)),
            same(f"{p}attn_v.{s}", (kv, *w), f"{a}v_proj.{s}"),
        ]
    return [*out, same(p + "attn_output.weight", (h, h), a + "o_proj.weight")]


def _mamba(cfg: Config, p: str, m: str) -> list[Piece]:
    """A Mamba-2 layer."""
    h, heads_, groups = cfg["hidden_size"], cfg["mamba_n_heads"], cfg["mamba_n_groups"]
    inner, state = cfg["mamba_expand"] * h, cfg["mamba_d_state"]
    conv = inner + 2 * groups * state
    out = [
        same(p + "ssm_in.weight", (conv + inner + heads_, h), m + "in_proj.weight"),
        same(p + "ssm_conv1d.weight", (conv, cfg["mamba_d_conv"]), m + "conv1d.weight", conv_weight),
        same(p + "ssm_dt.bias", (heads_,), m + "dt_bias"),
        same(p + "ssm_a", (heads_, 1), m + "A_log", lambda t: a_log(p + "ssm_a")(t.reshape(heads_))),
        same(p + "ssm_d", (heads_, 1), m + "D", lambda t: t.reshape(heads_)),
        same(p + "ssm_norm.weight", (groups, inner // groups), m + "norm.weight", lambda t: t.reshape(inner)),
        same(p + "ssm_out.weight", (h, inner), m + "out_proj.weight"),
    ]
    if cfg["mamba_conv_bias"]:
        out.append(same(p + "ssm_conv1d.bias", (conv,), m + "conv1d.bias"))
    if cfg["mamba_proj_bias"]:
        out += [
            same(p + "ssm_in.bias", (conv + inner + heads_,), m + "in_proj.bias"),
            same(p + "ssm_out.bias", (h,), m + "out_proj.bias"),
        ]
    return out


def _mlp(cfg: Config, p: str, hf: str) -> list[Piece]:
    """The routed experts (if any) and the shared MLP, gate | up fused again."""
    h, shared, e = cfg["hidden_size"], cfg["shared_intermediate_size"], cfg["num_local_experts"]
    suffix = "_shexp" if e else ""  # (without experts the converter files the shared MLP as the dense one)
    gate, up, down = (f"{p}ffn_{part}{suffix}.weight" for part in ("gate", "up", "down"))
    out = [
        joined(((gate, (shared, h)), (up, (shared, h))), hf + "shared_mlp.input_linear.weight", dim=0),
        same(down, (h, shared), hf + "shared_mlp.output_linear.weight"),
    ]
    if not e:
        return out
    ff, moe = cfg["intermediate_size"], hf + "block_sparse_moe."
    return out + [
        same(p + "ffn_gate_inp.weight", (e, h), moe + "router.layer.weight"),
        joined(
            ((p + "ffn_gate_exps.weight", (e, ff, h)), (p + "ffn_up_exps.weight", (e, ff, h))),
            moe + "input_linear.weight",
            dim=1,
        ),
        same(p + "ffn_down_exps.weight", (e, h, ff), moe + "output_linear.weight"),
    ]
