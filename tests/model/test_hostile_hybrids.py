"""Hybrid model files that lie or hold values no recurrence survives: each is refused at load
naming what is wrong, never served as NaN; and the odd but honest ones (a convolution of any
kernel, 1 included: no state at all) run as transformers runs them.

The files are tiny random LFM2 and Granite 4.0-H checkpoints (`tests.support`) with one value of
their config.json or weights changed.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft.model.deltanet import DeltaNetConfig, hf_weights
from ft.model.hybrid import state_slot_bytes
from ft.model.loader import load_model
from ft.model.runners import build_runner
from tests.support.tiny_granite_hybrid import granite_hybrid_model, save_granite_hybrid_dir
from tests.support.tiny_lfm2 import greedy, lfm2_model, save_lfm2_dir

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_granite_hybrid_dir(tmp_path_factory.mktemp("granite") / "g", granite_hybrid_model("dense"))


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_lfm2_dir(tmp_path_factory.mktemp("lfm2") / "l", lfm2_model())


def changed(
    base: pathlib.Path,
    to: pathlib.Path,
    config: dict[str, Any] | None = None,
    weights: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> pathlib.Path:
    """A copy of the checkpoint `base` with `config` merged into its config.json and
    `weights` applied to its tensors."""
    shutil.copytree(base, to)
    cfg = json.loads((to / "config.json").read_text()) | (config or {})
    (to / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        (path,) = to.glob("*.safetensors")
        tensors = load_file(path)
        weights(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    return to


def a_log(value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        for name in tensors:
            if name.endswith("A_log"):
                tensors[name] = torch.full_like(tensors[name], value)

    return change


@pytest.mark.parametrize("value", [100.0, float("inf"), float("nan")])
def test_a_mamba2_decay_that_overflows_is_refused(
    granite_dir: pathlib.Path, tmp_path: pathlib.Path, value: float
) -> None:
    """exp(A_log) past float32's range made A -inf: every state after a prefill was NaN. The
    weights are mapped when the runner builds its model, before the engine serves."""
    loaded = load_model(changed(granite_dir, tmp_path / "g", weights=a_log(value)), torch.float32)
    with pytest.raises(ValueError, match="A_log"):
        build_runner(loaded, num_pages=4, page_size=4, dtype=torch.float32, num_state_slots=1)


def test_a_large_but_finite_mamba2_decay_still_loads(
    granite_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    loaded = load_model(changed(granite_dir, tmp_path / "g", weights=a_log(80.0)), torch.float32)
    build_runner(loaded, num_pages=4, page_size=4, dtype=torch.float32, num_state_slots=1)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"mamba_n_heads": 0}, "mamba_n_heads must be positive"),  # (was a ZeroDivisionError)
        ({"mamba_n_heads": 3}, "3 heads of 32 do not make"),
        ({"mamba_n_groups": 3}, "num_groups"),
        ({"mamba_d_conv": 1}, "conv_kernel must be at least 2"),
        ({"mamba_chunk_size": 0}, "chunk_size must be positive"),
        ({"time_step_limit": ["NaN", 1.0]}, "bad time_step_limit"),
    ],
)
def test_a_mamba2_config_that_cannot_run_is_refused_naming_it(
    granite_dir: pathlib.Path, tmp_path: pathlib.Path, config: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(changed(granite_dir, tmp_path / "g", config=config), torch.float32)


@pytest.mark.parametrize("limit", ["ab", [1.0], [0.0, 1.0, 2.0], {"low": 0}])
def test_a_time_step_limit_that_is_not_two_numbers_is_refused_naming_it(
    granite_dir: pathlib.Path, tmp_path: pathlib.Path, limit: Any
) -> None:
    with pytest.raises(ValueError, match="time_step_limit"):
        load_model(changed(granite_dir, tmp_path / "g", config={"time_step_limit": limit}), torch.float32)


def test_a_deltanet_decay_that_overflows_is_refused() -> None:
    c = DeltaNetConfig(hidden_size=8, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    sd = {
        "in_proj_qkv.weight": torch.zeros(2 * c.key_dim + c.value_dim, 8),
        "in_proj_z.weight": torch.zeros(c.value_dim, 8),
        "in_proj_b.weight": torch.zeros(2, 8),
        "in_proj_a.weight": torch.zeros(2, 8),
        "conv1d.weight": torch.zeros(c.conv_dim, 1, 4),
        "A_log": torch.tensor([0.0, 100.0]),
        "dt_bias": torch.zeros(2),
        "norm.weight": torch.ones(4),
        "out_proj.weight": torch.zeros(8, c.value_dim),
    }
    with pytest.raises(ValueError, match="A_log"):
        hf_weights(c, sd, "")
    sd["A_log"] = torch.tensor([0.0, 3.0])
    assert hf_weights(c, sd, "")["A_log"].tolist() == [0.0, 3.0]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"conv_L_cache": 0}, "kernel of at least 1"),
        ({"conv_L_cache": 1_000_000}, "size mismatch"),  # the weights say 3
        ({"hidden_size": 1_000_000}, "size mismatch"),
    ],
)
def test_an_lfm2_config_that_lies_about_its_shapes_is_refused(
    lfm2_dir: pathlib.Path, tmp_path: pathlib.Path, config: dict[str, Any], match: str
) -> None:
    """Refused by the load or, for the shapes the weights contradict, by the runner's build."""
    with pytest.raises((ValueError, RuntimeError), match=match):
        loaded = load_model(changed(lfm2_dir, tmp_path / "l", config=config), torch.float32)
        build_runner(loaded, num_pages=4, page_size=4, dtype=torch.float32, num_state_slots=1)


@pytest.mark.parametrize("family", ["granite", "lfm2"])
def test_a_hybrid_without_an_attention_layer_is_refused_at_load(
    granite_dir: pathlib.Path, lfm2_dir: pathlib.Path, tmp_path: pathlib.Path, family: str
) -> None:
    """No layer stores KV, so a page has no bytes: the budget divided by zero and the runner's
    KV cache indexed an empty layout (Granite's config without `layer_types` is all Mamba-2)."""
    if family == "granite":
        path = changed(granite_dir, tmp_path / "g", config={"layer_types": None})
    else:
        path = changed(lfm2_dir, tmp_path / "l", config={"layer_types": ["conv"] * 4})
    with pytest.raises(ValueError, match="attention layer"):
        load_model(path, torch.float32)


@pytest.mark.parametrize("kernel", [1, 2, 6])
def test_an_lfm2_of_any_kernel_runs_as_transformers_does(tmp_path: pathlib.Path, kernel: int) -> None:
    """`conv_L_cache` 1 is a pointwise convolution: no state at all (its empty slot tensors
    could not be made), 2 and 6 hold one and five inputs."""
    hf = lfm2_model(conv_L_cache=kernel)
    loaded = load_model(save_lfm2_dir(tmp_path / "lfm2", hf), torch.float32)
    assert state_slot_bytes(loaded.config) == 2 * 4 * 64 * (kernel - 1)  # two conv layers, float32
    runner = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, num_state_slots=2)
    prompt = tuple(range(3, 30))
    _, logits = greedy(runner, prompt, 2, chunk=5)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
