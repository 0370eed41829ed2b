"""A tiny random Llama-family model, saved as a Hugging Face directory for the loaders."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from ft.model.llama import LlamaConfig


def tiny_config(**overrides: object) -> LlamaConfig:
    """A 2-layer GQA model small enough to run in milliseconds."""
    fields: dict[str, object] = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
    )  # fmt: skip
    fields.update(overrides)
    return LlamaConfig(**fields)  # type: ignore[arg-type]


def random_hf_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    c = config
    sd = {
        "model.embed_tokens.weight": rnd(c.vocab_size, c.hidden_size),
        "model.norm.weight": 1 + rnd(c.hidden_size),
    }
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + rnd(c.hidden_size)
        sd[p + "post_attention_layernorm.weight"] = 1 + rnd(c.hidden_size)
        sd[p + "self_attn.q_proj.weight"] = rnd(c.q_size, c.hidden_size)
        sd[p + "self_attn.k_proj.weight"] = rnd(c.kv_size, c.hidden_size)
        sd[p + "self_attn.v_proj.weight"] = rnd(c.kv_size, c.hidden_size)
        sd[p + "self_attn.o_proj.weight"] = rnd(c.hidden_size, c.q_size)
        if c.attention_bias:
            sd[p + "self_attn.q_proj.bias"] = rnd(c.q_size)
            sd[p + "self_attn.k_proj.bias"] = rnd(c.kv_size)
            sd[p + "self_attn.v_proj.bias"] = rnd(c.kv_size)
        sd[p + "mlp.gate_proj.weight"] = rnd(c.intermediate_size, c.hidden_size)
        sd[p + "mlp.up_proj.weight"] = rnd(c.intermediate_size, c.hidden_size)
        sd[p + "mlp.down_proj.weight"] = rnd(c.hidden_size, c.intermediate_size)
    return sd


def save_hf_dir(directory: pathlib.Path, config: LlamaConfig, model_type: str = "llama") -> None:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    cfg = {
        "architectures": [arch[model_type]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "eos_token_id": 1,
    }  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(random_hf_state_dict(config), str(directory / "model.safetensors"))
    vocab = {"<s>": 0, "</s>": 1}
    for i in range(config.vocab_size - 2):
        vocab[chr(0x21 + i)] = i + 2
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))  # fmt: skip
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1], "temperature": 0.7, "top_p": 0.9})
    )
