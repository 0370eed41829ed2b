"""A tiny random LFM2 (short convolutions and attention), built by transformers itself.

The checkpoint is transformers' own `Lfm2ForCausalLM` from `AutoConfig.for_model("lfm2", ...)`
(hidden 64, 4 layers: conv, attention, conv, attention; 4 heads / 2 kv heads of 16; the MLP
width adjusted as LFM2's is), every weight random (norms around 1), saved with
`save_pretrained` beside the tests' byte-level BPE tokenizer.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import torch

from ft.core.batch import SeqWork
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.gguf_files import tiny_tokens
from tests.support.tiny_families import EOS, save_dir

GREEDY = SamplingParams(temperature=0.0)
LAYER_TYPES = ["conv", "full_attention", "conv", "full_attention"]


def lfm2_model(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight `Lfm2ForCausalLM` (`overrides`: `Lfm2Config` fields)."""
    import transformers

    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=LAYER_TYPES, conv_L_cache=3,
        max_position_embeddings=512, norm_eps=1e-5, block_multiple_of=32, eos_token_id=tokens.index(EOS),
        pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("lfm2", **fields)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def save_lfm2_dir(directory: pathlib.Path, model: Any) -> pathlib.Path:
    """`model` as a Hugging Face directory (config.json, safetensors, tokenizer)."""
    return save_dir(directory, model)


def greedy(
    runner: TorchRunner, prompt: tuple[int, ...], steps: int, *, slot: int = 0, chunk: int = 0
) -> tuple[list[int], list[torch.Tensor]]:
    """`steps` greedy tokens after `prompt` (fed `chunk` tokens a step, 0: at once) in state slot
    `slot`, pages 0.. of the runner; and each step's logits `[vocab]`."""
    pages = tuple(range(runner.num_pages))
    chunk = chunk or len(prompt)
    logits: list[torch.Tensor] = []
    for start in range(0, len(prompt), chunk):
        part = prompt[start : start + chunk]
        last = start + len(part) == len(prompt)
        out = runner.forward([SeqWork(0, part, start, pages, last, GREEDY, 0, state_slot=slot)])
        if last:
            assert out is not None
            logits.append(out[0])
    tokens = [int(logits[0].argmax())]
    for i in range(1, steps):
        work = SeqWork(0, (tokens[-1],), len(prompt) + i - 1, pages, True, GREEDY, i, state_slot=slot)
        out = runner.forward([work])
        assert out is not None
        logits.append(out[0])
        tokens.append(int(out[0].argmax()))
    return tokens, logits


def check_batched_steps(runner_of: Callable[[], TorchRunner], prompt: tuple[int, ...]) -> None:
    """Two sequences' decodes (one row each, batched together) beside a fresh prompt in one
    step give each the logits it gets stepped alone (fresh runners from `runner_of`)."""
    prompts = [prompt[: 10 + 7 * i] for i in range(3)]
    alone = [greedy(runner_of(), p, 2)[1] for p in prompts]
    runner = runner_of()
    pages = [tuple(range(10 * i, 10 * i + 10)) for i in range(3)]
    first = runner.forward(
        [SeqWork(i, prompts[i], 0, pages[i], True, GREEDY, 0, state_slot=i) for i in range(2)]
    )
    assert first is not None
    tokens = [int(first[i].argmax()) for i in range(2)]
    works = [
        SeqWork(i, (tokens[i],), len(prompts[i]), pages[i], True, GREEDY, 1, state_slot=i) for i in range(2)
    ] + [SeqWork(2, prompts[2], 0, pages[2], True, GREEDY, 0, state_slot=3)]
    out = runner.forward(works)
    assert out is not None
    for i in range(3):
        want = alone[i][1] if i < 2 else alone[2][0]
        assert (out[i] - want).abs().max().item() < 1e-5
