"""One sequence's recurrent state never reaches another sequence of the same step.

A state can go bad on its own (an activation that overflows in bfloat16 for one prompt, a
hostile input): what it then holds, NaN included, must stay that sequence's. Each test puts NaN
into one sequence's slot, steps it in a batch beside a fresh sequence, and asks that the fresh
one's output and new state equal what it gets alone: every mixer (short convolution, Mamba-2,
Gated DeltaNet), a decode or a prefill span beside a prefill span that pads its last scan chunk,
and whole served models (LFM2, Granite 4.0-H with and without experts) through the float runner.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from ft.core.batch import SeqWork
from ft.model.deltanet import DeltaNetConfig, GatedDeltaNet
from ft.model.llama import LlamaConfig
from ft.model.loader import LoadedModel, load_model
from ft.model.mamba2 import Mamba2Config, Mamba2Mixer
from ft.model.recurrent import StateSpan
from ft.model.runners import build_runner
from ft.model.short_conv import ShortConv, ShortConvConfig
from tests.support.tiny_granite_hybrid import granite_hybrid_model, save_granite_hybrid_dir
from tests.support.tiny_lfm2 import GREEDY, lfm2_model, save_lfm2_dir

pytest.importorskip("transformers")

TOL = 1e-5
# The poisoned sequence first (row 0 of the step: a scan's padding used to read it), as one
# decode row or a prefill span; the fresh one after it, 11 rows (not a whole number of chunks).
LAYOUTS = {
    "decode beside prefill": [StateSpan(0, 0, 1, False), StateSpan(1, 1, 11, True)],
    "prefill beside prefill": [StateSpan(0, 0, 5, False), StateSpan(1, 5, 11, True)],
    "decode beside decode": [StateSpan(0, 0, 1, False), StateSpan(1, 1, 1, True)],
}


def _mamba2() -> nn.Module:
    c = Mamba2Config(
        hidden_size=64, num_heads=4, head_dim=32, state_size=16, num_groups=2, conv_kernel=4, chunk_size=8
    )
    return Mamba2Mixer(c)


def _deltanet() -> nn.Module:
    c = DeltaNetConfig(
        hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, chunk_size=4
    )
    return GatedDeltaNet(c)


def _short_conv() -> nn.Module:
    config = LlamaConfig(
        vocab_size=10, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
        layer_types=("short_conv", "attention"), mixer_config=ShortConvConfig(3),
    )  # fmt: skip
    return ShortConv(config)


MIXERS = {"mamba2": _mamba2, "deltanet": _deltanet, "short_conv": _short_conv}


def _random(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 0.1)
            if name == "A":  # Mamba-2's decays (negative)
                p.copy_(-0.1 - torch.rand_like(p))
            elif "norm" in name:
                p.fill_(1.0)
    return module.eval()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", MIXERS)
def test_a_nan_state_stays_in_its_own_sequence(kind: str, layout: str) -> None:
    mixer = _random(MIXERS[kind]())
    poisoned, fresh = LAYOUTS[layout]
    slots = [torch.zeros(3, *shape) for shape in mixer.state_shapes()]
    for t in slots:
        t[poisoned.slot] = float("nan")
    x = torch.randn(fresh.row_start + fresh.num_rows, 64)
    rows = slice(fresh.row_start, fresh.row_start + fresh.num_rows)
    with torch.no_grad():
        out, new = mixer(x, [poisoned, fresh], slots)
        alone, alone_new = mixer(x[rows], [StateSpan(fresh.slot, 0, fresh.num_rows, True)], slots)
    assert out[poisoned.row_start].isnan().any()  # (the poison is real)
    torch.testing.assert_close(out[rows], alone, rtol=TOL, atol=TOL)
    for got, want in zip(new[1], alone_new[0], strict=True):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


# --- whole models through the runner ----------------------------------------------------------


@pytest.fixture(scope="module", params=["lfm2", "granite-moe", "granite-dense"])
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("isolation")
    hf: Any
    if request.param == "lfm2":
        path: pathlib.Path = save_lfm2_dir(directory / "lfm2", lfm2_model())
    else:
        hf = granite_hybrid_model(request.param.removeprefix("granite-"))
        path = save_granite_hybrid_dir(directory / "granite", hf)
    return load_model(path, torch.float32)


def _work(seq: int, tokens: Sequence[int], start: int, slot: int, index: int = 0) -> SeqWork:
    pages = tuple(range(16 * slot, 16 * slot + 16))  # each sequence its own pages
    return SeqWork(seq, tuple(tokens), start, pages, True, GREEDY, index, state_slot=slot)


@pytest.mark.parametrize("theirs", ["prefill", "decode"])
@pytest.mark.parametrize("poisoned_rows", [1, 5])
def test_a_nan_state_in_one_slot_leaves_the_batchs_other_sequence_exact(
    loaded: LoadedModel, poisoned_rows: int, theirs: str
) -> None:
    """Sequence 0 has run a prompt; its slot then holds NaN (and so, after its next step, do
    its KV pages). A step that feeds it (a decode row or a chunk) beside sequence 1 (a fresh
    11-token prompt, or a decode row after it) gives sequence 1 its lone logits and state."""

    def runner() -> Any:
        return build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, num_state_slots=2)

    prompt = tuple(range(3, 14))
    other = _work(1, prompt, 0, 1) if theirs == "prefill" else _work(1, (40,), len(prompt), 1, 1)
    lone, r = runner(), runner()
    if theirs == "decode":
        lone.forward([_work(1, prompt, 0, 1)])
        r.forward([_work(1, prompt, 0, 1)])
    want = lone.forward([other])
    r.forward([_work(0, range(20, 26), 0, 0)])
    for layer in r.states.layers:
        for t in layer:
            t[0] = float("nan")
    got = r.forward([_work(0, range(30, 30 + poisoned_rows), 6, 0, 1), other])
    assert want is not None and got is not None
    assert got[0].isnan().any()
    torch.testing.assert_close(got[1], want[0], rtol=1e-4, atol=1e-4)
    for mine, alone in zip(r.states.layers, lone.states.layers, strict=True):
        for a, b in zip(mine, alone, strict=True):
            torch.testing.assert_close(a[1], b[1], rtol=1e-4, atol=1e-4)
