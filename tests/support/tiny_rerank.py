"""Tiny random rerankers, built by transformers, saved as Hugging Face directories and a GGUF.

- `seq_cls_model("qwen3" | "llama")`: a `Qwen3ForSequenceClassification` or
  `LlamaForSequenceClassification` with one label (`score.weight` `[1, hidden]`), saved by
  `save_seq_cls_dir` with the tiny byte-level tokenizer.
- `write_rank_gguf`: a `Qwen3ForCausalLM`'s weights as a `qwen3` GGUF written the way llama.cpp's
  converter writes Qwen3-Reranker: `qwen3.pooling_type` 4 (rank), the labels `["yes", "no"]`,
  `cls.output.weight` the lm_head's rows of two tokens standing for "yes" and "no" (in that
  order) and a `tokenizer.chat_template.rerank` with `{query}` and `{document}`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, PoolingType
from gguf.quants import quantize

from ft.tokenizer.spec import byte_level_bpe_from_gguf
from tests.support.gguf_files import tiny_tokens
from tests.support.tiny_qwen3 import EOS, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, _gguf_tensors

YES, NO = 100, 120  # the token ids whose lm_head rows the GGUF's head holds ("yes", "no")
RERANK_TEMPLATE = (
    "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
)


def _randomized(model: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08 if not name.startswith("score") else 0.5)
    return model.eval()


def seq_cls_model(family: str = "qwen3", seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Qwen3ForSequenceClassification` or `LlamaForSequenceClassification`."""
    import transformers

    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        rms_norm_eps=1e-6, num_labels=1, pad_token_id=tokens.index("<|endoftext|>"),
        eos_token_id=tokens.index(EOS), tie_word_embeddings=False,
    )  # fmt: skip
    if family == "qwen3":
        fields |= dict(head_dim=HEAD_DIM, rope_theta=1_000_000.0)
        fields.update(overrides)
        model = transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(**fields))
    else:
        fields.update(overrides)
        model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**fields))
    return _randomized(model, seed)


def save_seq_cls_dir(directory: pathlib.Path, model: Any, **tokenizer_config: Any) -> pathlib.Path:
    """`model` as a Hugging Face directory: config.json, safetensors, the tiny tokenizer."""
    tokens, merges, types = tiny_tokens()
    model.save_pretrained(str(directory))
    byte_level_bpe_from_gguf(tokens, merges, types, "qwen2").save(str(directory / "tokenizer.json"))
    tcfg = {"eos_token": EOS, "bos_token": None} | tokenizer_config
    (directory / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return directory


def causal_model(seed: int = 0) -> Any:
    """The random `Qwen3ForCausalLM` the rank GGUF is written from."""
    from tests.support.tiny_qwen3 import qwen3_model

    return qwen3_model(seed)


def write_rank_gguf(
    path: pathlib.Path,
    model: Any,
    *,
    quantized: bool = False,
    template: str | None = RERANK_TEMPLATE,
    head: np.ndarray | None = None,
    labels: list[str] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> pathlib.Path:
    """`model` (a `Qwen3ForCausalLM`) as a Qwen3-Reranker-style GGUF (see the module docstring).

    `quantized`: the projections and embedding Q8_0 (else every tensor F32); `head` replaces
    `cls.output.weight`, `labels` the labels, `extra` adds tensors (malformed-file tests).
    """
    c = model.config
    tokens, merges, types = tiny_tokens()
    w = GGUFWriter(str(path), "qwen3")
    w.add_name("tiny-qwen3-reranker")
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
    w.add_pooling_type(PoolingType.RANK)  # 4, llama.cpp's LLAMA_POOLING_TYPE_RANK
    w.add_classifier_output_labels(labels if labels is not None else ["yes", "no"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index(EOS))
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template([{"name": "rerank", "template": template}])
    tensors = _gguf_tensors(model)
    lm_head = tensors["output.weight"]
    tensors["cls.output.weight"] = head if head is not None else np.stack([lm_head[YES], lm_head[NO]])
    tensors |= extra or {}
    for name, data in tensors.items():
        if quantized and data.ndim >= 2 and not name.startswith("cls."):
            w.add_tensor(name, np.asarray(quantize(data, GGMLQuantizationType.Q8_0)),
                         raw_dtype=GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_scores(model: Any, prompts: list[list[int]]) -> list[float]:
    """transformers' score of each prompt: a sequence classifier's logit, or for a causal LM the
    rank GGUF's (softmax over its "yes" and "no" logits at the last position: p(yes))."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits  # [1, labels] or [1, T, vocab]
            if logits.ndim == 2:
                out.append(float(logits[0, 0]))
            else:
                pair = logits[0, -1, [YES, NO]].double()
                out.append(float(torch.softmax(pair, dim=-1)[0]))
    return out
