"""Tiny random Gemma 4 text models, built by transformers itself and saved as safetensors with
the tiny Gemma tokenizer of `tests.support.tiny_gemma`.

The base (`gemma4_model()`) is `Gemma4ForCausalLM` of hidden 64 over 6 layers (sliding,
sliding, global, sliding, sliding, global), 4 query heads: the sliding layers' of 16 over 2 kv
heads, the global ones' of 32 (`global_head_dim`) with the default rotaries (10k on the sliding
layers, "proportional" 1M over a quarter of the pairs on the global ones), a window of 8, a
final soft-cap of 8, no per-layer embeddings. `VARIANTS` add, one at a time, what Gemma 4 can
add: per-layer embeddings, `attention_k_eq_v` (global layers of 1 kv head whose values are
their keys), 2 KV-sharing layers (one of each type, double-wide MLPs), experts beside the MLP.
Every weight is random, norms, layer scalars and router scales around 1 (they multiply as
stored). `reference` is transformers' run of `PROMPT` and its greedy steps, `chunked_then_greedy`
ft's (the prompt in chunks of `CHUNK` on a `runner_of` runner), for the tests to compare.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

from ft.core.batch import SeqWork
from ft.model.loader import LoadedModel
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.support.tiny_gemma import BOS, EOS, gemma_vocab
from tests.support.tiny_qwen3 import GREEDY, PAGES

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, GLOBAL_HEAD_DIM, FFN = 64, 4, 2, 16, 32, 128
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "ple": {"hidden_size_per_layer_input": 8},
    "k_eq_v": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "kv_shared": {"num_kv_shared_layers": 2, "use_double_wide_mlp": True},
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
}
PROMPT = tuple((7 + 37 * i) % 320 + 3 for i in range(45))  # ids 3..322 of the tiny vocabulary
CHUNK = 16
NEW_TOKENS = 6
PAGE_SIZE = 4
# a turn in Gemma 4's chat format (the tiny vocabulary spells its markers byte by byte)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def text_config(**overrides: Any) -> Any:
    """The base's `Gemma4TextConfig` with `overrides`."""
    import transformers

    tokens, _, _ = gemma_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        global_head_dim=GLOBAL_HEAD_DIM, layer_types=LAYER_TYPES, sliding_window=WINDOW,
        max_position_embeddings=512, rms_norm_eps=1e-6, final_logit_softcapping=8.0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=len(tokens),
        eos_token_id=1, bos_token_id=2, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    fields.update(overrides)
    return transformers.Gemma4TextConfig(**fields)


def _randomized(model: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "scale")):  # norms, router and expert scales
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model.eval()


def gemma4_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Gemma4ForCausalLM` of the base config with `overrides`."""
    import transformers

    return _randomized(transformers.Gemma4ForCausalLM(text_config(**overrides)), seed)


def gemma4_multimodal_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Gemma4ForConditionalGeneration` without vision or audio towers (the
    names of its text weights: `model.language_model.*`)."""
    import transformers

    config = transformers.Gemma4Config(
        text_config=text_config(**overrides), vision_config=None, audio_config=None
    )
    return _randomized(transformers.Gemma4ForConditionalGeneration(config), seed)


def save_gemma4_dir(directory: pathlib.Path, model: Any) -> pathlib.Path:
    """`model` as a Hugging Face directory: config.json, safetensors, the tiny Gemma
    tokenizer.json and a chat template in Gemma 4's turn format."""
    _save(directory, model, CHAT_TEMPLATE)
    return directory


# Gemma 4's markers, special tokens in its vocabulary (its turns, tool declarations, calls,
# results, strings, thought channel, thinking switch); `chat_model` puts them after the tiny one.
MARKERS = (
    "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
    "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>",
)  # fmt: skip
CHAT_VOCAB = len(gemma_vocab()[0]) + len(MARKERS)


def marker_id(marker: str) -> int:
    """The id of one of `MARKERS` in a `save_gemma4_chat_dir` directory's vocabulary."""
    return len(gemma_vocab()[0]) + MARKERS.index(marker)


def gemma4_chat_model(seed: int = 0) -> Any:
    """The base model over the tiny vocabulary and `MARKERS`, for 4096 positions (a prompt with
    tools is ~1k tokens of the tiny vocabulary)."""
    vocab = {"vocab_size": CHAT_VOCAB, "vocab_size_per_layer_input": CHAT_VOCAB}
    return gemma4_model(seed, max_position_embeddings=4096, **vocab)


def save_gemma4_chat_dir(directory: pathlib.Path, model: Any, template: str) -> pathlib.Path:
    """`model` (of `gemma4_chat_model`) as a Hugging Face directory whose vocabulary holds
    `MARKERS` as special tokens, with chat template `template`, ending at `<turn|>` and
    `<|tool_response>` as Gemma 4's generation config does."""
    import transformers

    added = [transformers.AddedToken(m, special=True, normalized=False) for m in MARKERS]
    _save(directory, model, template, added)
    eos = [1, marker_id("<turn|>"), marker_id("<|tool_response>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory


def _save(directory: pathlib.Path, model: Any, template: str, added: list[Any] | None = None) -> None:
    import transformers

    from ft.tokenizer.spec import gemma_merges

    tokens, _, _ = gemma_vocab()
    model.save_pretrained(str(directory))
    tok = transformers.GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=gemma_merges(tokens))
    if added:
        tok.add_tokens(added, special_tokens=True)
    tok.backend_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "bos_token": BOS, "add_bos_token": True, "chat_template": template})
    )


def runner_of(loaded: LoadedModel) -> TorchRunner:
    """A float32 runner of 32 pages of `PAGE_SIZE` over `loaded`."""
    # NOTE: one thread: the tiny steps gain nothing from two, and a busy machine stalls them
    return build_runner(loaded, num_pages=32, page_size=PAGE_SIZE, dtype=torch.float32, threads=1)


def reference(model: Any) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """transformers' logits `[T, vocab]` over the prompt, its greedy tokens, and the logits
    `[NEW_TOKENS, vocab]` of each of its greedy steps (the prompt and the tokens before)."""
    with torch.inference_mode():
        prompt_logits = model(torch.tensor([PROMPT])).logits[0]
        greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=None)  # (past an EOS too)
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, **greedy)
        tokens = out[0, len(PROMPT) :].tolist()
        steps = model(out[:, :-1]).logits[0, len(PROMPT) - 1 :]
    return prompt_logits, tokens, steps


def chunked_then_greedy(runner: TorchRunner) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """The prompt fed in chunks of `CHUNK` (each chunk's last logits), then greedy decode steps
    (their tokens and logits)."""
    chunk_logits = []
    for start in range(0, len(PROMPT), CHUNK):
        logits = runner.forward([SeqWork(0, PROMPT[start : start + CHUNK], start, PAGES, True, GREEDY, 0)])
        assert logits is not None
        chunk_logits.append(logits[0])
    tokens, step_logits = [int(chunk_logits[-1].argmax())], [chunk_logits[-1]]
    for i in range(1, NEW_TOKENS):
        logits = runner.forward([SeqWork(0, (tokens[-1],), len(PROMPT) + i - 1, PAGES, True, GREEDY, i)])
        assert logits is not None
        tokens.append(int(logits[0].argmax()))
        step_logits.append(logits[0])
    return chunk_logits, tokens, step_logits
