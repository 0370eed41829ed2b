"""Tiny random Gemma 2 / Gemma 3 text models, built by transformers itself, saved as
safetensors and as GGUFs the way llama.cpp's converter writes them.

The checkpoints are `Gemma2ForCausalLM` / `Gemma3ForCausalLM` from small configs (hidden 64,
4 heads / 2 kv heads of 32, a sliding window of 8 so that a 44-token prompt passes it; Gemma 2
alternates windowed and global layers, Gemma 3 has 5 windowed layers then a global one, with
its own rotary base for the windowed layers and linear rope scaling on the global ones), norm
weights randomized (they scale by 1 + w). The GGUF holds the same weights under llama.cpp's
names with its converter's `+ 1` on every norm, no `output.weight` (tied), and a SentencePiece
vocabulary of Gemma's shape (`<pad> <eos> <bos> <unk>`, the turn markers, byte fallback
`<0x..>` tokens, no merges: they are rebuilt from the order of the vocabulary).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.support.chat_templates import TEMPLATES

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 32, 128
WINDOW = 8
EOS, BOS, END_OF_TURN = "<eos>", "<bos>", "<end_of_turn>"

# Gemma's vocabulary in miniature: the specials at Gemma's ids (pad 0, eos 1, bos 2, unk 3), the
# turn markers, the 256 byte-fallback tokens, then pieces (each a merge of two earlier ones)
_SPECIALS = ["<pad>", EOS, BOS, "<unk>", "<mask>", "<start_of_turn>", END_OF_TURN]
_PIECES = [
    "▁", "\n", *"abcdefghijklmnopqrstuvwxyz", *"HTW.,!?",
    "▁t", "he", "▁the", "▁a", "in", "er", "on", "▁w", "or", "▁s", "ll", "el", "lo", "▁h",
    "▁he", "llo", "▁hello", "us", "er", "▁u", "▁us", "▁user", "mo", "de", "▁mo", "▁model",
    "od", "▁▁", "▁▁▁▁", "ou", "yo", "▁yo", "▁you", "H", "He", "Hel", "Hell", "Hello",
]  # fmt: skip
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gemma_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and GGUF token types of the tiny Gemma vocabulary (unique pieces)."""
    pieces = list(dict.fromkeys(_PIECES))
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [*_SPECIALS, *byte_tokens, *pieces]
    types = [3, 3, 3, 2, 3, 4, 4] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(_SPECIALS) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def _randomized(model: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))  # the norms scale by 1 + w
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def gemma2_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Gemma2ForCausalLM`: 4 layers (even ones windowed), soft-caps low enough
    to bite on random weights, `query_pre_attn_scalar` not the head size."""
    import transformers

    tokens, _, _ = gemma_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=4,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW,
        query_pre_attn_scalar=24, attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    fields.update(overrides)
    return _randomized(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**fields)), seed)


def gemma3_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Gemma3ForCausalLM`: 7 layers (the sixth global), q/k head norms, the
    windowed layers' rotary base 10000 and the global ones' 1e6 with linear scaling by 4."""
    import transformers

    tokens, _, _ = gemma_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=7,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW,
        query_pre_attn_scalar=24, eos_token_id=[1, 6], bos_token_id=2, pad_token_id=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        },
        attn_implementation="eager",
    )  # fmt: skip
    fields.update(overrides)
    return _randomized(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields)), seed)


def save_gemma_dir(directory: pathlib.Path, model: Any) -> pathlib.Path:
    """`model` as a Hugging Face directory: config.json, safetensors, a Gemma tokenizer.json
    (transformers' `GemmaTokenizer` over the tiny vocabulary) and the family's chat template."""
    import transformers

    from ft.tokenizer.spec import gemma_merges

    tokens, _, _ = gemma_vocab()
    model.save_pretrained(str(directory))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = transformers.GemmaTokenizer(vocab=vocab, merges=gemma_merges(tokens))
    tok.backend_tokenizer.save(str(directory / "tokenizer.json"))
    template = TEMPLATES["gemma-3" if model.config.model_type.startswith("gemma3") else "gemma-2"]
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "bos_token": BOS, "add_bos_token": True, "chat_template": template})
    )
    return directory


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """`model`'s weights under llama.cpp's names, its norms shifted by 1 as the converter does."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: the converter skips it
        data = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1
        if not name.startswith("model.layers."):
            out[_GLOBAL_NAMES[name]] = data
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        out[f"blk.{layer}.{_LAYER_NAMES[rest]}"] = data
    return out


def write_gemma_gguf(
    path: pathlib.Path, model: Any, *, qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0
) -> pathlib.Path:
    """`model` as a `gemma2` / `gemma3` GGUF: the projections and embedding of `qtype` (F32:
    as floats), norms F32, the metadata llama.cpp's converter writes (no query scalar: llama.cpp
    derives it from the head size, so `model` should have `query_pre_attn_scalar` = head_dim)."""
    c = model.config
    is_gemma3 = c.model_type == "gemma3_text"
    tokens, scores, types = gemma_vocab()
    w = GGUFWriter(str(path), "gemma3" if is_gemma3 else "gemma2")
    w.add_name("tiny-gemma")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    if is_gemma3:
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(float(full["rope_theta"]))
        if full.get("rope_type") == "linear":
            w.add_string("gemma3.rope.scaling.type", "linear")
            w.add_float32("gemma3.rope.scaling.factor", float(full["factor"]))
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    # NOTE: llama.cpp's Gemma files spell a token of several "▁" as that many spaces
    w.add_token_list([" " * len(t) if len(t) > 1 and set(t) == {"▁"} else t for t in tokens])
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(TEMPLATES["gemma-3" if is_gemma3 else "gemma-2"])
    for gguf_name, data in gguf_tensors(model).items():
        if data.ndim >= 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.asarray(quantize(data, qtype)), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gemma3_multimodal_model(seed: int = 0) -> Any:
    """A random-weight `Gemma3ForConditionalGeneration` (a one-layer vision tower beside the
    text model of `gemma3_model`, the shape Gemma 3 4B and up are published in)."""
    import transformers

    text = gemma3_model(seed).config
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return _randomized(transformers.Gemma3ForConditionalGeneration(config), seed)
