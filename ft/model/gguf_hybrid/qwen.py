"""Qwen3.5 (`qwen35`), Qwen3.5-MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`) GGUFs back into
their checkpoints' `config.json` and tensors.

What llama.cpp's converter (`conversion/qwen.py`: `Qwen3NextModel`, and for Qwen3.5
`_LinearAttentionVReorderBase` on top) did, undone here:

- every norm but the DeltaNet's gated one (`linear_attn.norm`) is stored as `1 + w` (the
  checkpoint's `(1 + w)` norms): 1 is subtracted back;
- `A_log` is stored as `A = -exp(A_log)` (`ssm_a`), `dt_bias` as `ssm_dt.bias`, the conv's
  `[channels, 1, kernel]` weight squeezed to `[channels, kernel]`;
- Qwen3.5: where value heads outnumber key heads, each value-head-sized block (the v rows of
  `in_proj_qkv` and of the conv, `in_proj_z`, `in_proj_b` / `in_proj_a`, `A_log`, `dt_bias`,
  the columns of `out_proj`) was reordered from grouped by key head ([k0: v0 v1, k1: v0 v1])
  to tiled ([v0: k0 k1, v1: k0 k1]) for ggml's broadcast;
- Qwen3-Next: its fused `in_proj_qkvz`, grouped by key head ([q k v z] per key head), was
  split into q | k | v over all heads (`attn_qkv`) and z (`attn_gate`); `in_proj_ba` is kept;
- the experts stacked (`ffn_*_exps`), the multi-token-prediction layers (`mtp.*`) appended
  after the decoder's as blocks `num_hidden_layers + j` (`nextn_predict_layers` of them).

Which layers are Gated DeltaNet is `attention.recurrent_layers` (else every
`full_attention_interval`-th layer attends, as llama.cpp reads it). A setting the converter
does not write: Qwen3-Next's `norm_topk_prob` (`expert_weights_norm`; llama.cpp renormalizes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ft.model.gguf_file import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_WIDTH, GGUFFile, ModelFileError
from ft.model.gguf_hybrid.common import (
    MAX_CONV_KERNEL,
    MAX_STATE,
    Config,
    Keys,
    Piece,
    a_log,
    common_config,
    conv_weight,
    f32,
    global_pieces,
    heads,
    layer_count,
    minus_one,
    per_expert,
    rope_theta,
    same,
)

DEFAULT_MROPE_SECTIONS = [11, 11, 10, 0]  # what the converter writes when a checkpoint has none
HF_NAMES = {  # GGUF architecture -> (model_type, architectures) of the text checkpoint
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
}


def qwen_config(meta: GGUFFile, arch: str) -> Config:
    """The text checkpoint's `config.json` of a `qwen35`, `qwen35moe` or `qwen3next` GGUF."""
    keys = Keys(meta, arch)
    blocks = layer_count(keys)
    mtp = keys.integer("nextn_predict_layers", 0, blocks - 1, default=0)
    num_layers = blocks - mtp
    cfg = common_config(meta, keys, num_layers)
    model_type, hf_arch = HF_NAMES[arch]
    num_heads = heads(keys)
    num_kv = keys.integer("attention.head_count_kv", 1, num_heads, default=num_heads)
    if num_heads % num_kv:
        raise ModelFileError(
            f"metadata key {keys.key('attention.head_count_kv')!r}: {num_kv} does not divide the "
            f"{num_heads} heads of {keys.key('attention.head_count')!r}"
        )
    # (llama.cpp's default head size; a default is not range-checked, so the result is)
    head_dim = keys.integer("attention.key_length", 2, MAX_HEAD_DIM, default=cfg["hidden_size"] // num_heads)
    if not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ModelFileError(
            f"metadata key {keys.key('attention.key_length')!r} is absent and hidden / heads is {head_dim}"
        )
    if keys.integer("attention.value_length", 1, MAX_HEAD_DIM, default=head_dim) != head_dim:
        raise ModelFileError(
            f"metadata key {keys.key('attention.value_length')!r}: expected the key size {head_dim}"
        )
    rotary = keys.integer("rope.dimension_count", 2, head_dim, default=head_dim // 4)
    if rotary % 2 or rotary < 2:
        key = keys.key("rope.dimension_count")
        raise ModelFileError(
            f"metadata key {key!r}: {rotary} rotary dimensions (expected an even count, at least 2)"
        )
    rope: dict[str, object] = {
        "rope_type": "default",
        "rope_theta": rope_theta(keys),
        "partial_rotary_factor": rotary / head_dim,
    }
    sections = meta.get(keys.key("rope.dimension_sections"))
    if sections is not None and sections != DEFAULT_MROPE_SECTIONS:  # (text positions: plain rope)
        rope |= {"mrope_section": list(sections)[:3], "mrope_interleaved": True}
    num_k = keys.integer("ssm.group_count", 1, MAX_HEADS)
    num_v = keys.integer("ssm.time_step_rank", 1, MAX_HEADS)
    if num_v % num_k:
        raise ModelFileError(
            f"metadata key {keys.key('ssm.time_step_rank')!r}: {num_v} value heads are not a multiple of "
            f"the {num_k} key heads of {keys.key('ssm.group_count')!r}"
        )
    inner = keys.integer("ssm.inner_size", 1, MAX_WIDTH)
    cfg |= {
        "architectures": [hf_arch],
        "model_type": model_type,
        "num_attention_heads": num_heads,
        "hidden_act": "silu",  # (llama.cpp's graph hard-codes it)
        "num_key_value_heads": num_kv,
        "head_dim": head_dim,
        "rms_norm_eps": f32(keys.number("attention.layer_norm_rms_epsilon", 0.0, 1.0, 1e-6)),
        "rope_parameters": rope,
        "attention_bias": False,
        "layer_types": _layer_types(keys, blocks, num_layers),
        "linear_conv_kernel_dim": keys.integer("ssm.conv_kernel", 1, MAX_CONV_KERNEL),
        "linear_key_head_dim": keys.integer("ssm.state_size", 1, MAX_STATE),
        "linear_num_key_heads": num_k,
        "linear_num_value_heads": num_v,
        "linear_value_head_dim": keys.quotient("ssm.inner_size", inner, num_v, "the value heads"),
    }
    if mtp:
        cfg["mtp_num_hidden_layers"] = mtp
    if arch == "qwen35":
        cfg["intermediate_size"] = keys.integer("feed_forward_length", 1, MAX_WIDTH)
        return cfg
    num_experts = keys.integer("expert_count", 1, MAX_EXPERTS)
    cfg |= {
        "num_experts": num_experts,
        "num_experts_per_tok": keys.integer("expert_used_count", 1, num_experts),
        "moe_intermediate_size": keys.integer("expert_feed_forward_length", 1, MAX_WIDTH),
        "shared_expert_intermediate_size": keys.integer("expert_shared_feed_forward_length", 1, MAX_WIDTH),
    }
    if arch == "qwen3next":  # (llama.cpp's qwen3next has experts on every layer)
        cfg |= {"norm_topk_prob": keys.flag("expert_weights_norm", True), "decoder_sparse_step": 1,
                "mlp_only_layers": []}  # fmt: skip
        if keys.has("feed_forward_length"):  # (the dense width no layer uses)
            cfg["intermediate_size"] = keys.integer("feed_forward_length", 1, MAX_WIDTH)
    return cfg


def _layer_types(keys: Keys, blocks: int, num_layers: int) -> list[str]:
    """Each decoder layer's kind; the multi-token-prediction blocks after them must attend."""
    recurrent = keys.flags("attention.recurrent_layers", blocks)
    if recurrent is None:
        interval = keys.integer("full_attention_interval", 1, blocks, default=4)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)] + [False] * (blocks - num_layers)
    if any(recurrent[num_layers:]):
        raise ModelFileError(
            f"metadata key {keys.key('attention.recurrent_layers')!r}: a multi-token prediction layer "
            f"(past the {num_layers} of the decoder) is marked recurrent"
        )
    return ["linear_attention" if r else "full_attention" for r in recurrent[:num_layers]]


def qwen_pieces(cfg: Config) -> list[Piece]:
    """The Hugging Face tensors of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config, from its GGUF."""
    pieces = global_pieces(cfg, "model.norm.weight", minus_one)
    num_layers = cfg["num_hidden_layers"]
    for i, kind in enumerate(cfg["layer_types"]):
        layer = _attention(cfg, i, f"model.layers.{i}.") if kind == "full_attention" else _deltanet(cfg, i)
        pieces += layer + _mlp(cfg, i, f"model.layers.{i}.")
    for j in range(cfg.get("mtp_num_hidden_layers", 0)):  # after the decoder's, attention layers
        i = num_layers + j
        pieces += [
            _as_mtp(p) for p in _attention(cfg, i, f"mtp.layers.{j}.") + _mlp(cfg, i, f"mtp.layers.{j}.")
        ]
        if j == 0:  # (the converter files the block's own tensors under its first layer)
            h, p = cfg["hidden_size"], f"blk.{i}.nextn."
            pieces += [
                same(p + "eh_proj.weight", (h, 2 * h), "mtp.fc.weight", mtp=True),
                same(p + "enorm.weight", (h,), "mtp.pre_fc_norm_embedding.weight", minus_one, mtp=True),
                same(p + "hnorm.weight", (h,), "mtp.pre_fc_norm_hidden.weight", minus_one, mtp=True),
                same(p + "shared_head_norm.weight", (h,), "mtp.norm.weight", minus_one, mtp=True),
            ]
    return pieces


def _as_mtp(piece: Piece) -> Piece:
    """`piece` as part of a multi-token prediction layer."""
    return Piece(piece.sources, piece.build, mtp=True)


def _attention(cfg: Config, i: int, hf: str) -> list[Piece]:
    """Gated attention: q_proj's rows per head query | gate as the checkpoint has them (the
    converter does not permute Qwen's q/k), per-head q/k norms of `(1 + w)`."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    p, a = f"blk.{i}.", hf + "self_attn."
    return [
        same(p + "attn_norm.weight", (h,), hf + "input_layernorm.weight", minus_one),
        same(p + "post_attention_norm.weight", (h,), hf + "post_attention_layernorm.weight", minus_one),
        same(p + "attn_q.weight", (2 * q, h), a + "q_proj.weight"),
        same(p + "attn_k.weight", (kv, h), a + "k_proj.weight"),
        same(p + "attn_v.weight", (kv, h), a + "v_proj.weight"),
        same(p + "attn_output.weight", (h, q), a + "o_proj.weight"),
        same(p + "attn_q_norm.weight", (d,), a + "q_norm.weight", minus_one),
        same(p + "attn_k_norm.weight", (d,), a + "k_norm.weight", minus_one),
    ]


def _deltanet(cfg: Config, i: int) -> list[Piece]:
    """A Gated DeltaNet layer (`linear_attn`)."""
    h, nk, nv = cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, kernel = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    qk, v = 2 * nk * dk, nv * dv
    p, hf = f"blk.{i}.", f"model.layers.{i}."
    la = hf + "linear_attn."
    pieces = [
        same(p + "attn_norm.weight", (h,), hf + "input_layernorm.weight", minus_one),
        same(p + "post_attention_norm.weight", (h,), hf + "post_attention_layernorm.weight", minus_one),
        same(p + "ssm_norm.weight", (dv,), la + "norm.weight"),  # (the gated norm: plain w, kept)
    ]
    if cfg["model_type"] == "qwen3_next":  # heads grouped by key head, as the checkpoint has them
        return pieces + [
            same(p + "ssm_a", (nv,), la + "A_log", a_log(p + "ssm_a")),
            same(p + "ssm_dt.bias", (nv,), la + "dt_bias"),
            same(p + "ssm_conv1d.weight", (qk + v, kernel), la + "conv1d.weight", conv_weight),
            same(p + "ssm_ba.weight", (2 * nv, h), la + "in_proj_ba.weight"),
            Piece(
                ((p + "attn_qkv.weight", (qk + v, h)), (p + "attn_gate.weight", (v, h))),
                lambda ts: {la + "in_proj_qkvz.weight": _qkvz(ts[0], ts[1], nk, dk, v // nk)},
            ),
            same(p + "ssm_out.weight", (h, v), la + "out_proj.weight"),
        ]
    per_k = nv // nk

    def grouped(size: int, dim: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: _grouped(t, dim, nk, per_k, size)

    def qkv(t: torch.Tensor) -> torch.Tensor:  # only the v rows were reordered
        return torch.cat([t[:qk], _grouped(t[qk:], 0, nk, per_k, dv)])

    return pieces + [
        same(p + "ssm_a", (nv,), la + "A_log", lambda t: a_log(p + "ssm_a")(grouped(1)(t))),
        same(p + "ssm_dt.bias", (nv,), la + "dt_bias", grouped(1)),
        same(p + "ssm_conv1d.weight", (qk + v, kernel), la + "conv1d.weight", lambda t: conv_weight(qkv(t))),
        same(p + "ssm_alpha.weight", (nv, h), la + "in_proj_a.weight", grouped(1)),
        same(p + "ssm_beta.weight", (nv, h), la + "in_proj_b.weight", grouped(1)),
        same(p + "attn_qkv.weight", (qk + v, h), la + "in_proj_qkv.weight", qkv),
        same(p + "attn_gate.weight", (v, h), la + "in_proj_z.weight", grouped(dv)),
        same(p + "ssm_out.weight", (h, v), la + "out_proj.weight", grouped(dv, dim=1)),
    ]


def _grouped(t: torch.Tensor, dim: int, num_k: int, per_k: int, size: int) -> torch.Tensor:
    """Blocks of `size` along `dim` from the converter's tiled order (value head j of every key
    head, for j in turn) back to the checkpoint's, grouped by key head."""
    shape = list(t.shape)
    tiled = t.reshape(*shape[:dim], per_k, num_k, size, *shape[dim + 1 :])  # [.., per_k, num_k, size, ..]
    return tiled.transpose(dim, dim + 1).reshape(shape)


def _qkvz(qkv: torch.Tensor, z: torch.Tensor, num_k: int, dk: int, v_per_k: int) -> torch.Tensor:
    """Qwen3-Next's `in_proj_qkvz` `[num_k * (2 dk + 2 v_per_k), hidden]`, per key head q | k |
    v | z, from the converter's q | k | v over every head and z apart."""
    hidden = qkv.shape[1]
    q, k, v = qkv.split([num_k * dk, num_k * dk, num_k * v_per_k])
    per_head = [t.reshape(num_k, -1, hidden) for t in (q, k, v, z)]  # [num_k, rows of one head, hidden]
    return torch.cat(per_head, dim=1).reshape(-1, hidden)


def _mlp(cfg: Config, i: int, hf: str) -> list[Piece]:
    """The dense MLP, or the routed experts with their gated shared expert."""
    h, p, m = cfg["hidden_size"], f"blk.{i}.", hf + "mlp."
    if "num_experts" not in cfg:
        ff = cfg["intermediate_size"]
        return [
            same(p + "ffn_gate.weight", (ff, h), m + "gate_proj.weight"),
            same(p + "ffn_up.weight", (ff, h), m + "up_proj.weight"),
            same(p + "ffn_down.weight", (h, ff), m + "down_proj.weight"),
        ]
    e, ff, shared = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    return [
        same(p + "ffn_gate_inp.weight", (e, h), m + "gate.weight"),
        per_expert(p + "ffn_gate_exps.weight", (e, ff, h), m + "experts", "gate_proj"),
        per_expert(p + "ffn_up_exps.weight", (e, ff, h), m + "experts", "up_proj"),
        per_expert(p + "ffn_down_exps.weight", (e, h, ff), m + "experts", "down_proj"),
        same(p + "ffn_gate_shexp.weight", (shared, h), m + "shared_expert.gate_proj.weight"),
        same(p + "ffn_up_shexp.weight", (shared, h), m + "shared_expert.up_proj.weight"),
        same(p + "ffn_down_shexp.weight", (h, shared), m + "shared_expert.down_proj.weight"),
        same(p + "ffn_gate_inp_shexp.weight", (1, h), m + "shared_expert_gate.weight"),
    ]
