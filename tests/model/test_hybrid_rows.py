"""A recurrent mixer written against `ft.model.recurrent` plugs into the hybrid skeleton as one
`MixerKind` row: here Mamba-2 (`ft.model.mamba2`), its settings as `LlamaConfig.mixer_config`
and its Hugging Face weight map as the row's `hf_weights`, between attention layers, through
the float runner's state slots: a prompt split anywhere and its decode step equal the whole.
"""

from __future__ import annotations

import pytest
import torch

from ft.core.batch import SeqWork
from ft.model import hybrid
from ft.model.hybrid import MixerKind
from ft.model.llama import LlamaConfig
from ft.model.loader import LoadedModel
from ft.model.mamba2 import Mamba2Config, Mamba2Mixer, mamba2_weights_from_hf
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
MAMBA = Mamba2Config(
    hidden_size=64, num_heads=4, head_dim=32, state_size=16, num_groups=1, conv_kernel=4, chunk_size=8
)
PROMPT = tuple(range(3, 40))
PAGES = tuple(range(16))


@pytest.fixture
def mamba_row(monkeypatch: pytest.MonkeyPatch) -> None:
    row = MixerKind(
        "mamba2",
        lambda c, i: Mamba2Mixer(c.mixer_config),
        "mamba",
        lambda c, sd, p: mamba2_weights_from_hf(sd, p),
    )
    monkeypatch.setitem(hybrid.MIXERS, "mamba2", row)


def hf_weights(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names (Granite 4.0-H's `mamba` module)."""
    torch.manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape) * 0.1

    sd = {"model.embed_tokens.weight": rand(config.vocab_size, 64), "model.norm.weight": torch.ones(64)}
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": torch.ones(64),
            p + "post_attention_layernorm.weight": torch.ones(64),
        }
        sd |= {p + "mlp.gate_proj.weight": rand(128, 64), p + "mlp.up_proj.weight": rand(128, 64)}
        sd[p + "mlp.down_proj.weight"] = rand(64, 128)
        if kind == "attention":
            a = p + "self_attn."
            sd |= {a + "q_proj.weight": rand(64, 64), a + "k_proj.weight": rand(32, 64)}
            sd |= {a + "v_proj.weight": rand(32, 64), a + "o_proj.weight": rand(64, 64)}
            continue
        m = p + "mamba."
        sd[m + "in_proj.weight"] = rand(MAMBA.inner_size + MAMBA.conv_dim + MAMBA.num_heads, 64)
        sd |= {m + "conv1d.weight": 3 * rand(MAMBA.conv_dim, 1, 4), m + "conv1d.bias": rand(MAMBA.conv_dim)}
        sd |= {m + "dt_bias": rand(4), m + "A_log": rand(4), m + "D": torch.ones(4)}
        sd |= {m + "norm.weight": torch.ones(MAMBA.inner_size), m + "out_proj.weight": rand(64, 128)}
    return sd


def make_runner() -> TorchRunner:
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        layer_types=("mamba2", "attention", "mamba2", "attention"), mixer_config=MAMBA,
    )  # fmt: skip
    loaded = LoadedModel(config, dict(hf_weights(config)), None, "mamba-hybrid", torch.float32)  # type: ignore[arg-type]
    return build_runner(loaded, num_pages=16, page_size=4, dtype=torch.float32, num_state_slots=2)


@pytest.mark.parametrize("split", [1, 11, 36])
def test_a_mamba2_row_runs_in_the_skeleton_split_anywhere(mamba_row: None, split: int) -> None:
    whole, parts = make_runner(), make_runner()
    assert whole.k_cache.shape[0] == 2  # the attention layers' KV only
    want = whole.forward([SeqWork(0, PROMPT, 0, PAGES, True, GREEDY, 0, state_slot=0)])
    parts.forward([SeqWork(0, PROMPT[:split], 0, PAGES, False, GREEDY, 0, state_slot=1)])
    got = parts.forward([SeqWork(0, PROMPT[split:], split, PAGES, True, GREEDY, 0, state_slot=1)])
    assert want is not None and got is not None and (want - got).abs().max().item() < 1e-5
    decode = [SeqWork(0, (5,), len(PROMPT), PAGES, True, GREEDY, 1, state_slot=s) for s in (0, 1)]
    a, b = whole.forward(decode[:1]), parts.forward(decode[1:])
    assert a is not None and b is not None and (a - b).abs().max().item() < 1e-5
