"""Qwen3 (per-head q/k RMSNorm, no qkv bias, head size from the config) against transformers.

The checkpoint is transformers' own `Qwen3ForCausalLM` with random weights
(`tests.support.tiny_qwen3`): the float32 path matches its logits within 1e-4; its GGUF (Q8_0
projections) on the packed path stays within int8 tolerance of the same GGUF on the float path.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace
from typing import Any

import pytest
import torch

from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.cuda_graphs import GraphedRunner
from ft.model.gguf_file import ModelFileError
from ft.model.loader import LoadedModel, load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.support.gguf_files import STRING, RawGGUF, string
from tests.support.tiny_qwen3 import (
    GREEDY,
    HEAD_DIM,
    HIDDEN,
    PAGES,
    generate,
    qwen3_model,
    save_qwen3_dir,
    write_qwen3_gguf,
)

transformers = pytest.importorskip("transformers")

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
NEW_TOKENS = 8
# Q8_0 weights with int8 activations against the same weights dequantized: a share of the logits'
# spread (max |diff| / spread measured 1.0-1.5% on this model, 9 steps)
PACKED_RELATIVE_TOLERANCE = 0.04


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return qwen3_model()


@pytest.fixture(scope="module")
def qwen3_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_qwen3_dir(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", hf_model)


@pytest.fixture(scope="module")
def qwen3_gguf(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_qwen3_gguf(tmp_path_factory.mktemp("qwen3-gguf") / "tiny-qwen3.Q8_0.gguf", hf_model)


def runner_of(loaded: LoadedModel) -> TorchRunner:
    return build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32)


def test_config_maps_head_size_and_qk_norm_from_hf_and_gguf(
    qwen3_dir: pathlib.Path, qwen3_gguf: pathlib.Path
) -> None:
    hf = load_model(qwen3_dir, torch.float32).config
    gguf = load_model(qwen3_gguf, torch.float32).config
    for config in (hf, gguf):
        assert config.architecture == "qwen3" and config.qk_norm and not config.attention_bias
        assert config.head_dim == HEAD_DIM and config.q_size == 2 * HIDDEN  # not hidden / heads
    assert replace(hf, rms_norm_eps=0.0) == replace(gguf, rms_norm_eps=0.0)  # GGUF's eps is a float32
    assert gguf.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)


def test_float32_logits_and_greedy_tokens_match_transformers(hf_model: Any, qwen3_dir: pathlib.Path) -> None:
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0, -1]  # [vocab]
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    tokens, logits = generate(runner_of(load_model(qwen3_dir, torch.float32)), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    expected_tokens = ref[0, len(PROMPT) :].tolist()  # transformers stops after EOS
    assert tokens[: len(expected_tokens)] == expected_tokens


def test_gguf_float_path_matches_transformers_on_the_dequantized_weights(
    hf_model: Any, qwen3_gguf: pathlib.Path
) -> None:
    """No q/k permutation for qwen3, the norms under their names: the GGUF's float weights, put
    back into transformers' model, give its logits."""
    loaded = load_model(qwen3_gguf, torch.float32)
    dequantized = qwen3_model()
    dequantized.load_state_dict({k: v for k, v in loaded.state_dict.items()}, strict=True)  # type: ignore[misc]
    with torch.inference_mode():
        expected = dequantized(torch.tensor([PROMPT])).logits[0, -1]
    _, logits = generate(runner_of(loaded), PROMPT, 1)
    assert (logits - expected).abs().max().item() < 1e-4


def forced_logits(runner: TorchRunner, prompt: tuple[int, ...], forced: list[int]) -> list[torch.Tensor]:
    """Each step's logits `[vocab]` when the tokens after `prompt` are `forced`."""
    out = []
    logits = runner.forward([SeqWork(0, prompt, 0, PAGES, True, GREEDY, 0)])
    for i, token in enumerate([*forced, None]):
        assert logits is not None
        out.append(logits[0])
        if token is not None:
            logits = runner.forward([SeqWork(0, (token,), len(prompt) + i, PAGES, True, GREEDY, i + 1)])
    return out


@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, kernels.Q8_0_KV], ids=["f32", "f16", "q8_0"]
)
def test_packed_path_agrees_with_the_float_path(qwen3_gguf: pathlib.Path, kv_dtype: torch.dtype) -> None:
    """Fed the float path's greedy tokens, the packed path's logits (over each KV cache type)
    stay within int8 tolerance at every step, and its greedy choice is the float path's
    wherever that one leads by more than the tolerance (random weights leave near-ties)."""
    if not kernels.available():
        pytest.skip("no C++ compiler for the packed kernels")
    float_runner = runner_of(load_model(qwen3_gguf, torch.float32))
    float_tokens, _ = generate(float_runner, PROMPT, NEW_TOKENS)
    packed = build_runner(
        load_model(qwen3_gguf, torch.float32, quantized=True),
        num_pages=32, page_size=4, dtype=torch.float32, kv_dtype=kv_dtype,
    )  # fmt: skip
    assert packed.packed is not None
    steps = zip(
        forced_logits(runner_of(load_model(qwen3_gguf, torch.float32)), PROMPT, float_tokens),
        forced_logits(packed, PROMPT, float_tokens),
        strict=True,
    )
    agreeing = 0
    for step, (want, got) in enumerate(steps):
        tolerance = PACKED_RELATIVE_TOLERANCE * (want.max() - want.min()).item()
        assert (got - want).abs().max().item() < tolerance, f"step {step}"
        lead = (want.max() - want[int(got.argmax())]).item()
        assert lead <= 2 * tolerance, f"step {step}: the packed path chose a token {lead:.3g} behind"
        agreeing += int(got.argmax()) == int(want.argmax())
    assert agreeing >= NEW_TOKENS // 2


def test_packed_layer_refuses_one_head_norm_without_the_other(qwen3_gguf: pathlib.Path) -> None:
    if not kernels.available():
        pytest.skip("no C++ compiler for the packed kernels")
    runner = runner_of(load_model(qwen3_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[1].args.k_norm = None  # the layer's q norm stays
    with pytest.raises(kernels.KernelError, match="q/k head norms"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


def test_packed_layer_refuses_head_norms_of_the_wrong_size(qwen3_gguf: pathlib.Path) -> None:
    if not kernels.available():
        pytest.skip("no C++ compiler for the packed kernels")
    runner = runner_of(load_model(qwen3_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    layer, half = runner.packed.layers[0], torch.ones(HEAD_DIM // 2)
    layer.keep.append(half)
    layer.args.q_norm = layer.args.k_norm = half.data_ptr()
    layer.args.qk_norm_len = half.numel()
    with pytest.raises(kernels.KernelError, match="q/k head norms of 16 for heads of 32"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


def test_gguf_without_a_head_norm_is_refused_naming_it(
    qwen3_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    raw = RawGGUF.read(qwen3_gguf)
    old = "blk.1.attn_k_norm.weight"
    raw.tensors = [replace(t, name="blk.1.attn_kk_norm.weight") if t.name == old else t for t in raw.tensors]
    raw.write(tmp_path / "no-k-norm.gguf")
    with pytest.raises(ModelFileError, match=r"blk\.1\.attn_k_norm\.weight is missing"):
        load_model(tmp_path / "no-k-norm.gguf", torch.float32, quantized=True)


def test_sliding_window_qwen3_is_refused(qwen3_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cfg = json.loads((qwen3_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(cfg | {"use_sliding_window": True, "sliding_window": 64})
    )
    with pytest.raises(ValueError, match="sliding"):
        load_model(tmp_path, torch.float32)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, "MambaForCausalLM"),
        ({"model_type": "falcon"}, "falcon"),
    ],
)
def test_unsupported_hf_architecture_is_named_with_the_supported_list(
    tmp_path: pathlib.Path, config: dict[str, Any], named: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{named}.*not supported \(supported: .*Qwen3ForCausalLM"):
        load_model(tmp_path, torch.float32)


def test_unsupported_gguf_architecture_is_named_with_the_supported_list(
    qwen3_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    raw = RawGGUF.read(qwen3_gguf)
    raw.set("general.architecture", STRING, string("mamba")).write(tmp_path / "mamba.gguf")
    with pytest.raises(ModelFileError, match=r"'mamba' is not supported \(supported: .*qwen3"):
        load_model(tmp_path / "mamba.gguf", torch.float32)


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(qwen3_dir: pathlib.Path) -> None:
    """The head norms are one head's weights: each rank applies them to its own heads."""
    from tests.support.parallel import tensor_parallel_runner

    one_tokens, one_logits = generate(runner_of(load_model(qwen3_dir, torch.float32)), PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(qwen3_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_graphed_qwen3_gives_the_cpu_tokens(qwen3_dir: pathlib.Path) -> None:
    """float32 on the GPU (SDPA, decode graphs with the head norms inside) against the CPU."""
    loaded = load_model(qwen3_dir, torch.float32)
    gpu = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, device=torch.device("cuda"))
    tokens_gpu, logits_gpu = generate(gpu, PROMPT, NEW_TOKENS)
    tokens_cpu, logits_cpu = generate(runner_of(loaded), PROMPT, NEW_TOKENS)
    assert isinstance(gpu, GraphedRunner) and gpu.graphs.num_captured >= 1
    assert tokens_gpu == tokens_cpu
    assert (logits_gpu.cpu() - logits_cpu).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "qwen3"),
        ({"model_type": "qwen3"}, "qwen3"),  # no architectures: the model type decides
        ({"model_type": "qwen2"}, "qwen2"),
        ({}, "llama"),  # an old config.json with neither
    ],
)
def test_the_registry_finds_the_family_of_a_config(config: dict[str, Any], family: str) -> None:
    from ft.model.architectures import by_hf

    assert by_hf(config).name == family


def test_a_config_whose_architectures_is_not_a_list_of_names_is_refused() -> None:
    from ft.model.architectures import by_hf

    with pytest.raises(ValueError, match="must be a list of names"):
        by_hf({"architectures": "Qwen3ForCausalLM"})
