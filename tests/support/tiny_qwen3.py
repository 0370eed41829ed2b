"""A tiny random Qwen3, built by transformers itself, saved as safetensors and as a GGUF.

The checkpoint is `Qwen3ForCausalLM` from a `Qwen3Config` (2 layers, hidden 64, 4 heads / 2 kv
heads of 32: the head size is not hidden / heads, as on the real models), saved with
`save_pretrained`. The GGUF holds the same weights under llama.cpp's names for `qwen3` (no q/k
permutation, `attn_q_norm` / `attn_k_norm` in F32, the projections in Q8_0), its tokenizer as
byte-level BPE with the `qwen2` pre-tokenizer and Qwen3's own chat template.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from ft.core.batch import SeqWork
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from ft.tokenizer.spec import byte_level_bpe_from_gguf
from tests.support.chat_templates import TEMPLATES
from tests.support.gguf_files import tiny_tokens

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 32, 128, 2
EOS = "<|im_end|>"

# Hugging Face layer names (after `model.layers.N.`) → llama.cpp's (after `blk.N.`)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
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
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def qwen3_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Qwen3ForCausalLM` (norm weights randomized too, so q/k norm matters)."""
    import transformers

    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=512, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=tokens.index(EOS),
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def save_qwen3_dir(directory: pathlib.Path, model: Any) -> pathlib.Path:
    """`model` as a Hugging Face directory: config.json, safetensors, tokenizer, Qwen3's template."""
    tokens, merges, types = tiny_tokens()
    model.save_pretrained(str(directory))
    byte_level_bpe_from_gguf(tokens, merges, types, "qwen2").save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "bos_token": None, "chat_template": TEMPLATES["qwen-3"]})
    )
    return directory


def _gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """`model`'s weights under llama.cpp's names (a MoE's experts stacked per projection)."""
    out = {}
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if not name.startswith("model.layers."):
            out[_GLOBAL_NAMES[name]] = data
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        p = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [experts, 2 * inter, hidden]
            out[p + "ffn_gate_exps.weight"], out[p + "ffn_up_exps.weight"] = np.split(data, 2, axis=1)
        elif rest == "mlp.experts.down_proj":
            out[p + "ffn_down_exps.weight"] = data
        elif rest == "mlp.gate.weight":
            out[p + "ffn_gate_inp.weight"] = data
        else:
            out[p + _LAYER_NAMES[rest]] = data
    return out


def write_qwen3_gguf(path: pathlib.Path, model: Any) -> pathlib.Path:
    """`model`'s weights as a `qwen3` (or, for a MoE, `qwen3moe`) GGUF: the projections, experts
    and embedding Q8_0 (the router F32, as llama.cpp keeps small tensors), norms F32."""
    c = model.config
    tokens, merges, types = tiny_tokens()
    is_moe = hasattr(c, "num_experts_per_tok")
    w = GGUFWriter(str(path), "qwen3moe" if is_moe else "qwen3")
    if is_moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_name("tiny-qwen3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index(EOS))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATES["qwen-3"])
    for gguf_name, data in _gguf_tensors(model).items():
        if data.ndim >= 2 and not gguf_name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(gguf_name, np.asarray(quantize(data, GGMLQuantizationType.Q8_0)),
                         raw_dtype=GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(gguf_name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def qwen3_moe_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Qwen3MoeForCausalLM`: 8 experts of 32, 2 per token, every layer routed."""
    import transformers

    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=512, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=tokens.index(EOS),
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08 if not name.endswith("gate.weight") else 0.5)  # routers: clear choices
    return model.eval()


GREEDY = SamplingParams(temperature=0.0)
PAGES = tuple(range(16))  # the KV pages a runner test sequence holds


def generate(runner: TorchRunner, prompt: tuple[int, ...], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the first step's logits `[vocab]`."""
    logits = runner.forward([SeqWork(0, prompt, 0, PAGES, True, GREEDY, 0)])
    assert logits is not None
    out = [int(logits[0].argmax())]
    for i in range(1, n):
        step = runner.step([SeqWork(0, (out[-1],), len(prompt) + i - 1, PAGES, True, GREEDY, i)])
        out.append(step[0].token_id)
    return out, logits[0]
