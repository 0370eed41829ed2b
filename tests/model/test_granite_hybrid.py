"""Granite 4.0-H (Mamba-2 layers between attention layers, experts beside a shared MLP) against
transformers, loaded through ft's loader and run by the float runner.

The checkpoints are transformers' own `GraniteMoeHybridForCausalLM` with random weights
(`tests.support.tiny_granite_hybrid`: experts with rotary attention and B/C in 2 groups; the
shared MLP alone with attention without rotary, 1 group), saved with `save_pretrained`. float32
logits agree with transformers within 1e-4 (as every tiny family's; measured ~3e-7 on logits
of ~0.5) over a 45-token prompt fed in 16-token prefill chunks (each two of the scan's 8-token
chunks) across 12 pages of 4, then greedy decode steps.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ft.core.batch import SeqWork
from ft.model.architectures import by_gguf
from ft.model.hf_loader import hf_config
from ft.model.hybrid import state_slot_bytes
from ft.model.loader import LoadedModel, load_model
from ft.model.mamba2 import Mamba2Config
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.support.tiny_granite_hybrid import granite_hybrid_model, save_granite_hybrid_dir
from tests.support.tiny_lfm2 import GREEDY, check_batched_steps, greedy

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPT = tuple((i * 7) % 250 + 3 for i in range(45))  # 12 pages of 4, 3 chunks of 16
NEW_TOKENS = 8
NUM_SLOTS = 4


@pytest.fixture(scope="module", params=["moe", "dense"])
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def hf_model(variant: str) -> Any:
    torch.set_num_threads(1)
    return granite_hybrid_model(variant)


@pytest.fixture(scope="module")
def model_dir(hf_model: Any, variant: str, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_granite_hybrid_dir(tmp_path_factory.mktemp(f"granite-{variant}") / "tiny-granite", hf_model)


@pytest.fixture(scope="module")
def loaded(model_dir: pathlib.Path) -> LoadedModel:
    return load_model(model_dir, torch.float32)


def runner_of(loaded: LoadedModel, dtype: torch.dtype = torch.float32) -> TorchRunner:
    return build_runner(loaded, num_pages=32, page_size=4, dtype=dtype, num_state_slots=NUM_SLOTS)


def reference(hf_model: Any, prompt: tuple[int, ...], steps: int) -> Any:
    with torch.inference_mode():
        return hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip


def test_the_config_reads_layer_kinds_experts_multipliers_and_mamba_shapes(
    loaded: LoadedModel, variant: str
) -> None:
    c = loaded.config
    m = c.mixer_config
    assert c.architecture == "granite_hybrid" and c.is_hybrid and isinstance(m, Mamba2Config)
    assert (c.embedding_multiplier, c.residual_multiplier) == (12.0, 0.22)
    assert (c.attention_multiplier, c.logits_scaling) == (0.0078125, 6.0)
    assert c.intermediate_size == 48  # the shared MLP's
    assert (m.state_size, m.chunk_size, m.conv_kernel) == (16, 8, 4)
    if variant == "moe":
        assert c.layer_types == ("mamba2", "attention", "mamba2", "attention")
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
        assert c.shared_mlp and c.norm_topk_prob and c.no_rope_layers == ()
        assert (m.num_heads, m.head_dim, m.num_groups) == (8, 16, 2)
    else:
        assert c.layer_types == ("mamba2", "mamba2", "attention", "mamba2")
        assert c.num_experts == 0 and not c.shared_mlp
        assert c.no_rope_layers == (0, 1, 2, 3)  # attention without rotary
        assert (m.num_heads, m.head_dim, m.num_groups) == (4, 32, 1)


def test_the_published_spellings_read_as_transformers_writes_them(
    model_dir: pathlib.Path, variant: str, tmp_path: pathlib.Path
) -> None:
    """`layers_block_type` of "mamba" / "attention", `position_embedding_type` "nope" and a
    `time_step_limit` of JSON's Infinity, as the hub's config.json files say them."""
    cfg = json.loads((model_dir / "config.json").read_text())
    types = cfg.pop("layer_types")
    cfg["layers_block_type"] = ["mamba" if t == "linear_attention" else "attention" for t in types]
    if cfg["position_embedding_type"] is None:
        cfg["position_embedding_type"] = "nope"
    assert cfg["time_step_limit"] == [0.0, {"__float__": "Infinity"}]  # transformers 5's spelling
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"time_step_limit": [0.0, float("inf")]}))
    assert "Infinity" in (tmp_path / "config.json").read_text()
    assert hf_config(tmp_path) == hf_config(model_dir)


def test_kv_pages_hold_the_attention_layers_and_slots_the_mamba_states(
    loaded: LoadedModel, variant: str
) -> None:
    c = loaded.config
    runner = runner_of(loaded)
    assert runner.k_cache.shape[0] == c.num_kv_layers == (2 if variant == "moe" else 1)
    m = c.mixer_config
    assert isinstance(m, Mamba2Config)
    per_layer = (m.conv_kernel - 1) * m.conv_dim + m.num_heads * m.head_dim * m.state_size
    mamba_layers = c.num_layers - c.num_kv_layers
    assert runner.states is not None
    assert runner.states.slot_bytes == state_slot_bytes(c) == 4 * mamba_layers * per_layer


def test_float32_logits_and_greedy_tokens_match_transformers(hf_model: Any, loaded: LoadedModel) -> None:
    ref = reference(hf_model, PROMPT, NEW_TOKENS)
    tokens, logits = greedy(runner_of(loaded), PROMPT, NEW_TOKENS, slot=2, chunk=16)
    assert tokens == ref.sequences[0, len(PROMPT) :].tolist()
    for mine, theirs in zip(logits, ref.logits, strict=True):
        assert (mine - theirs[0]).abs().max().item() < TOLERANCE


def test_a_batch_of_sequences_steps_each_as_it_would_alone(loaded: LoadedModel) -> None:
    """Decodes (one row each) beside a fresh prompt in one step: the experts see every
    sequence's rows together, the Mamba-2 layers scan each from its own slot."""
    check_batched_steps(lambda: runner_of(loaded), PROMPT)


def test_the_mixers_small_parameters_stay_float32_in_a_bfloat16_model(
    model_dir: pathlib.Path, loaded: LoadedModel
) -> None:
    low = load_model(model_dir, torch.bfloat16)
    assert low.state_dict["model.layers.0.mamba.A_log"].dtype == torch.float32
    assert low.state_dict["model.layers.0.mamba.in_proj.weight"].dtype == torch.bfloat16
    runner = runner_of(low, torch.bfloat16)
    mixer = runner.model.layers[0].mixer
    for name in ("A", "D", "dt_bias", "conv_weight", "conv_bias", "norm_weight"):
        assert getattr(mixer, name).dtype == torch.float32, name
    assert mixer.in_proj.weight.dtype == torch.bfloat16
    _, [want] = greedy(runner_of(loaded), PROMPT, 1)
    _, [got] = greedy(runner, PROMPT, 1)
    assert (got.float() - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_a_granite_4_of_attention_layers_only_runs_without_state(tmp_path: pathlib.Path) -> None:
    """A dense Granite 4.0 of this model type whose layers all attend (as Granite-4.0-Micro):
    no recurrent layer, no state slot, the shared MLP as its MLP."""
    hf = granite_hybrid_model("dense", layer_types=["attention"] * 4)
    loaded = load_model(save_granite_hybrid_dir(tmp_path / "micro", hf), torch.float32)
    assert not loaded.config.is_hybrid and loaded.config.mixer_config is None
    runner = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32)
    assert runner.states is None
    ref = reference(hf, PROMPT, 3)
    pages = tuple(range(32))
    out = runner.forward([SeqWork(0, PROMPT, 0, pages, True, GREEDY, 0)])
    assert out is not None and (out[0] - ref.logits[0][0]).abs().max().item() < TOLERANCE
    token = int(out[0].argmax())
    out = runner.forward([SeqWork(0, (token,), len(PROMPT), pages, True, GREEDY, 1)])
    assert out is not None and (out[0] - ref.logits[1][0]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"layer_types": ["mamba", "conv", "mamba", "attention"]}, "layer_types"),
    ],
)
def test_what_ft_does_not_run_is_refused_naming_it(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, change: dict[str, Any], match: str
) -> None:
    cfg = json.loads((model_dir / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        hf_config(tmp_path)


def test_a_granite_hybrid_gguf_names_the_granite_hybrid_entry() -> None:  # (its GGUFs: test_gguf_hybrid)
    assert by_gguf("granitehybrid").name == "granite_hybrid"
