"""Tiny random Qwen3.5 / Qwen3-Next layers built by transformers itself, for layer-level tests.

The configs come from `AutoConfig.for_model` (hidden 64; Gated DeltaNet with 2 key heads of 16
and 4 value heads of 32, so key heads serve two value heads each; attention with 4 heads of 32
over 2 kv heads, a quarter of each head rotated). Every parameter is redrawn — A_log over
transformers' own range, dt_bias, the norms' weights — so no term of the layer is trivially
zero or one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HIDDEN = 64
DELTANET = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
}
ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def text_config(model_type: str = "qwen3_5", **overrides: Any) -> Any:
    """transformers' text config of a 4-layer model (3 DeltaNet layers, then attention)."""
    from transformers import AutoConfig

    fields: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        **DELTANET,
        **ATTENTION,
        **overrides,
    }
    if model_type == "qwen3_5":
        return AutoConfig.for_model("qwen3_5", text_config=fields).text_config
    return AutoConfig.for_model(model_type, **fields)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Redraw every parameter of `module` (in place) so that nothing is trivially 0 or 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1] if "." in name else name
            if leaf == "A_log":  # A over transformers' init range
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:  # norm weights around their neutral value (1, or 0 for 1 + w)
                base = 0.0 if torch.all(p == 0) else 1.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return module.eval()


def deltanet_layer(model_type: str = "qwen3_5", seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """transformers' text config and its Gated DeltaNet layer (layer 0), random weights."""
    config = text_config(model_type, **overrides)
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        return config, randomize(Qwen3NextGatedDeltaNet(config, 0), seed)
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    return config, randomize(Qwen3_5GatedDeltaNet(config, 0), seed)


def attention_layer(seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """transformers' text config and its gated attention layer (layer 3), random weights."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    config = text_config("qwen3_5", **overrides)
    config._attn_implementation = "eager"
    return config, randomize(Qwen3_5Attention(config, 3), seed)


# the experts of the tiny MoE models: 4 of 32, 2 a token, a shared expert of 48 beside them
EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def qwen35_model(model_type: str = "qwen3_5", seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` / `Qwen3NextForCausalLM`
    of 4 layers (3 DeltaNet, then attention) over the tests' byte-level vocabulary; the MoE
    models' experts `EXPERTS` (Qwen3-Next's layer 2 a dense MLP: `mlp_only_layers`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.gguf_files import tiny_tokens
    from tests.support.tiny_families import EOS

    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "vocab_size": len(tokens),
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "eos_token_id": tokens.index(EOS),
        "pad_token_id": 0,
        **DELTANET,
        **ATTENTION,
    }
    if model_type != "qwen3_5":
        fields |= EXPERTS
    if model_type == "qwen3_next":
        fields["mlp_only_layers"] = [2]
    fields |= overrides
    if model_type == "qwen3_next":
        config = AutoConfig.for_model(model_type, **fields)
    else:  # the multimodal config's text model, as Qwen3.5's checkpoints nest it
        config = AutoConfig.for_model(model_type, text_config=fields).text_config
    torch.manual_seed(seed)
    return randomize(AutoModelForCausalLM.from_config(config), seed)


def save_vlm_dir(directory: Any, model: Any) -> Any:
    """The text model `model` (a `Qwen3_5ForCausalLM`) as the published checkpoints hold it: a
    `Qwen3_5ForConditionalGeneration` directory (the text model under `model.language_model.`,
    a one-block vision tower under `model.visual.`) with the tests' tokenizer."""
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    from tests.support.tiny_families import save_dir

    vision = {
        "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
        "out_hidden_size": HIDDEN, "num_position_embeddings": 16,
    }  # fmt: skip
    config = AutoConfig.for_model("qwen3_5", text_config=model.config.to_dict(), vision_config=vision)
    vlm = Qwen3_5ForConditionalGeneration(config)
    vlm.model.language_model.load_state_dict(model.model.state_dict())
    vlm.lm_head.load_state_dict(model.lm_head.state_dict())
    return save_dir(directory, vlm.eval())


def transformers_text(model: Any, directory: Any, prompt: list[int], max_tokens: int) -> str:
    """transformers' greedy continuation of `prompt` (up to its EOS, hidden), as the server's
    detokenizer writes those tokens (a byte completing the prompt's last character is the
    prompt's: decoded after the prompt's tail)."""
    from tokenizers import Tokenizer

    from ft.actors.detokenizer import CONTEXT_TOKENS
    from ft.core.detok import SeqDetokenizer
    from tests.support.tiny_families import EOS

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    out = ids[len(prompt) :]
    detok = SeqDetokenizer(lambda t: str(tok.decode(list(t))), (), prompt[-CONTEXT_TOKENS:])
    pieces = [detok.add(t, is_last=i == len(out) - 1, is_hidden=t == eos)[0] for i, t in enumerate(out)]
    return "".join(pieces)
