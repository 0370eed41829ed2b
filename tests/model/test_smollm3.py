"""SmolLM3 (no rotary on every fourth layer) against transformers.

The checkpoint is transformers' own `SmolLM3ForCausalLM` with random weights
(`tests.support.tiny_families`; 4 layers, the fourth without rotary): float32 logits match
transformers within 1e-4; its `smollm3` GGUF (q/k permuted as llama.cpp's converter writes
them, no key for the NoPE layers: llama.cpp hard-codes every fourth) on the packed path stays
within int8 tolerance of the float path, which a rotary on every layer would not.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace
from typing import Any

import pytest
import torch

from ft.model import kernels
from ft.model.architectures import by_name
from ft.model.loader import load_model
from ft.tokenizer.template import render_chat
from tests.support.chat_templates import TEMPLATES
from tests.support.tiny_families import (
    NEW_TOKENS,
    PACKED_RELATIVE_TOLERANCE,
    PROMPT,
    engine_greedy,
    packed_error,
    runner_of,
    save_dir,
    smollm3_model,
    write_gguf,
)
from tests.support.tiny_qwen3 import generate

transformers = pytest.importorskip("transformers")
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return smollm3_model()


@pytest.fixture(scope="module")
def smollm3_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_dir(tmp_path_factory.mktemp("smollm3") / "tiny-smollm3", hf_model, template="smollm3")


@pytest.fixture(scope="module")
def smollm3_gguf(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_gguf(tmp_path_factory.mktemp("smollm3-gguf") / "tiny-smollm3.Q8_0.gguf", hf_model)


def test_config_maps_the_layers_without_rotary_from_hf_and_gguf(
    smollm3_dir: pathlib.Path, smollm3_gguf: pathlib.Path
) -> None:
    hf = load_model(smollm3_dir, torch.float32).config
    gguf = load_model(smollm3_gguf, torch.float32).config
    assert hf.architecture == gguf.architecture == "smollm3"
    assert hf.no_rope_layers == gguf.no_rope_layers == (3,)
    assert replace(hf, rms_norm_eps=0.0) == replace(gguf, rms_norm_eps=0.0)


def test_float32_logits_and_greedy_tokens_match_transformers(
    hf_model: Any, smollm3_dir: pathlib.Path
) -> None:
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    loaded = load_model(smollm3_dir, torch.float32)
    tokens, logits = generate(runner_of(loaded), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    expected_tokens = ref[0, len(PROMPT) :].tolist()
    assert tokens[: len(expected_tokens)] == expected_tokens
    rotating = replace(loaded, config=replace(loaded.config, no_rope_layers=()))  # the check can fail
    _, rotating_logits = generate(runner_of(rotating), PROMPT, 1)
    assert (rotating_logits - expected).abs().max().item() > 1e-2


def test_a_config_of_its_own_layers_without_rotary_is_followed(
    hf_model: Any, smollm3_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """`no_rope_layers` as the file says (here layers 0 and 2), not every fourth."""
    other = smollm3_model(no_rope_layers=[0, 1, 0, 1])
    other.load_state_dict(hf_model.state_dict())
    directory = save_dir(tmp_path / "other", other)
    loaded = load_model(directory, torch.float32)
    assert loaded.config.no_rope_layers == (0, 2)
    with torch.inference_mode():
        expected = other(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(loaded), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("bad", [[1, 1, 1], [1, 1, 2, 0], "1110"])
def test_malformed_no_rope_layers_are_refused(
    smollm3_dir: pathlib.Path, tmp_path: pathlib.Path, bad: Any
) -> None:
    cfg = json.loads((smollm3_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"no_rope_layers": bad}))
    with pytest.raises(ValueError, match="no_rope_layers"):
        load_model(tmp_path, torch.float32)


def test_gguf_float_path_matches_transformers_on_the_dequantized_weights(
    hf_model: Any, smollm3_gguf: pathlib.Path
) -> None:
    """q/k rows un-permuted, the NoPE layer found without a key: transformers' model holding the
    GGUF's float weights gives the same logits."""
    loaded = load_model(smollm3_gguf, torch.float32)
    dequantized = smollm3_model()
    sd = dict(loaded.state_dict) | {"lm_head.weight": loaded.state_dict["model.embed_tokens.weight"]}
    dequantized.load_state_dict(sd, strict=True)
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(loaded), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


@needs_kernels
@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, kernels.Q8_0_KV], ids=["f32", "f16", "q8_0"]
)
def test_packed_path_agrees_with_the_float_path(smollm3_gguf: pathlib.Path, kv_dtype: Any) -> None:
    assert packed_error(smollm3_gguf, kv_dtype) < PACKED_RELATIVE_TOLERANCE


@needs_kernels
def test_packed_path_skips_the_rotary_on_the_nope_layer(smollm3_gguf: pathlib.Path) -> None:
    """Against a float model that rotates every layer, the packed path is far off."""
    loaded = load_model(smollm3_gguf, torch.float32)
    rotating = replace(loaded, config=replace(loaded.config, no_rope_layers=()))
    with pytest.raises(AssertionError):
        assert packed_error(smollm3_gguf, torch.float32, reference=rotating) < PACKED_RELATIVE_TOLERANCE


@needs_kernels
def test_packed_layer_refuses_a_no_rope_flag_other_than_0_or_1(smollm3_gguf: pathlib.Path) -> None:
    from ft.core.batch import SeqWork
    from tests.support.tiny_qwen3 import GREEDY, PAGES

    runner = runner_of(load_model(smollm3_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[3].args.no_rope = 2
    with pytest.raises(kernels.KernelError, match="no_rope 2"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


@needs_kernels
async def test_an_engine_serves_the_gguf_on_the_packed_path(smollm3_gguf: pathlib.Path) -> None:
    packed = runner_of(load_model(smollm3_gguf, torch.float32, quantized=True), kv_dtype=torch.float16)
    tokens, _ = generate(packed, PROMPT, NEW_TOKENS)
    assert await engine_greedy(smollm3_gguf, PROMPT, NEW_TOKENS) == tokens


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(smollm3_dir: pathlib.Path) -> None:
    from tests.support.parallel import tensor_parallel_runner

    one_tokens, one_logits = generate(runner_of(load_model(smollm3_dir, torch.float32)), PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(smollm3_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4


def test_its_reasoning_format_is_think() -> None:
    assert by_name("smollm3").reasoning_parser == "think"


@pytest.mark.parametrize(
    ("system", "kwargs", "thinks"),
    [
        (None, {}, True),  # reasoning by default
        (None, {"enable_thinking": False}, False),  # chat_template_kwargs
        ("Be brief /no_think", {}, False),  # the system prompt's flag
        ("Be brief /think", {"enable_thinking": False}, True),  # the flag wins over the kwarg
    ],
)
def test_its_template_switches_reasoning(system: str | None, kwargs: dict[str, Any], thinks: bool) -> None:
    """SmolLM3's template: `/think` and `/no_think` in the system prompt, `enable_thinking`
    through chat_template_kwargs; without reasoning it writes an empty think block."""
    messages = [{"role": "user", "content": "Hi"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text = render_chat(TEMPLATES["smollm3"], messages, extra=kwargs)
    assert ("Reasoning Mode: /think" in text) is thinks
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n") is not thinks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_graphed_smollm3_gives_the_cpu_tokens(smollm3_dir: pathlib.Path) -> None:
    from tests.support.tiny_families import assert_cuda_graphs_give_the_cpu_tokens

    assert_cuda_graphs_give_the_cpu_tokens(smollm3_dir)
