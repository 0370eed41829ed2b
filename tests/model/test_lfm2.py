"""LFM2 (short convolutions between attention layers) against transformers, and the runner's
recurrent state slots.

The checkpoint is transformers' own `Lfm2ForCausalLM` with random weights
(`tests.support.tiny_lfm2`), saved with `save_pretrained`. float32 logits agree with
transformers within 1e-4 (as every tiny family's; measured ~2e-6) over a prompt fed in
several prefill chunks across several pages, then greedy decode steps; a prompt split at any
boundary gives the whole prompt's states and logits; a failed step leaves every slot as it was.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ft.config import EngineConfig
from ft.core.batch import SeqWork, StateCopy
from ft.model.architectures import by_gguf
from ft.model.hybrid import state_slot_bytes
from ft.model.loader import LoadedModel, load_model
from ft.model.plan import ConfigError, plan, read_header
from ft.model.runners import build_runner
from ft.model.short_conv import ShortConvConfig
from ft.model.torch_runner import TorchRunner
from tests.support.tiny_lfm2 import GREEDY, check_batched_steps, greedy, lfm2_model, save_lfm2_dir

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPT = tuple((i * 7) % 250 + 3 for i in range(45))  # 12 pages of 4, 3 chunks of 16
NEW_TOKENS = 8
NUM_SLOTS = 4


@pytest.fixture(scope="module")
def hf_model() -> Any:
    torch.set_num_threads(1)
    return lfm2_model()


@pytest.fixture(scope="module")
def lfm2_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_lfm2_dir(tmp_path_factory.mktemp("lfm2") / "tiny-lfm2", hf_model)


@pytest.fixture(scope="module")
def loaded(lfm2_dir: pathlib.Path) -> LoadedModel:
    return load_model(lfm2_dir, torch.float32)


def runner_of(loaded: LoadedModel) -> TorchRunner:
    return build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, num_state_slots=NUM_SLOTS)


def states_of(runner: TorchRunner, slot: int) -> list[torch.Tensor]:
    assert runner.states is not None
    return [t[slot].clone() for layer in runner.states.layers for t in layer]


def test_the_config_reads_the_layer_kinds_and_the_adjusted_mlp_width(loaded: LoadedModel) -> None:
    c = loaded.config
    assert c.architecture == "lfm2" and c.is_hybrid
    assert c.layer_types == ("short_conv", "attention", "short_conv", "attention")
    assert c.num_kv_layers == 2 and c.mixer_config == ShortConvConfig(kernel=3) and c.qk_norm
    assert c.intermediate_size == 128  # int(2 * 192 / 3), rounded up to a multiple of 32
    assert c.tie_word_embeddings


def test_the_older_config_spellings_read_as_transformers_reads_them(
    lfm2_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    cfg = json.loads((lfm2_dir / "config.json").read_text())
    for key in ("layer_types", "intermediate_size"):
        del cfg[key]
    cfg |= {"full_attn_idxs": [1, 3], "block_ff_dim": 192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from ft.model.hf_loader import hf_config

    assert hf_config(tmp_path) == load_model(lfm2_dir, torch.float32).config


def test_kv_pages_hold_the_attention_layers_only(loaded: LoadedModel) -> None:
    runner = runner_of(loaded)
    c = loaded.config
    assert runner.k_cache.shape[0] == 2
    every_layer = 2 * c.num_layers * 4 * c.num_kv_heads * c.head_dim * 4
    assert TorchRunner.bytes_per_page(c, 4, torch.float32) == every_layer // 2
    assert runner.states is not None and runner.states.slot_bytes == state_slot_bytes(c) == 2 * 64 * 2 * 4


def test_float32_logits_and_greedy_tokens_match_transformers(hf_model: Any, loaded: LoadedModel) -> None:
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens, logits = greedy(runner_of(loaded), PROMPT, NEW_TOKENS, slot=2, chunk=16)
    assert tokens == ref.sequences[0, len(PROMPT) :].tolist()
    for mine, theirs in zip(logits, ref.logits, strict=True):
        assert (mine - theirs[0]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("split", [1, 2, 3, 4, 5, 17, 44])
def test_a_prompt_split_anywhere_gives_the_whole_prompts_states_and_logits(
    loaded: LoadedModel, split: int
) -> None:
    whole = runner_of(loaded)
    _, [want] = greedy(whole, PROMPT, 1)
    parts = runner_of(loaded)
    pages = tuple(range(32))
    parts.forward([SeqWork(0, PROMPT[:split], 0, pages, False, GREEDY, 0, state_slot=1)])
    got = parts.forward([SeqWork(0, PROMPT[split:], split, pages, True, GREEDY, 0, state_slot=1)])
    assert got is not None and (got[0] - want).abs().max().item() < 1e-5
    for a, b in zip(states_of(whole, 0), states_of(parts, 1), strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_a_batch_of_sequences_steps_each_as_it_would_alone(loaded: LoadedModel) -> None:
    """Decodes (one row each, batched together) beside a prefill chunk and a fresh prompt."""
    check_batched_steps(lambda: runner_of(loaded), PROMPT)


@pytest.mark.parametrize("length", [1, 9])
def test_a_fresh_sequence_ignores_what_its_slot_held(loaded: LoadedModel, length: int) -> None:
    """A work at position 0 starts from the zero state whatever its slot held (a slot freed by
    another sequence is given out again without being cleared)."""
    _, [want] = greedy(runner_of(loaded), PROMPT[:length], 1)
    runner = runner_of(loaded)
    greedy(runner, PROMPT[5:30], 3)  # slot 0 now holds another sequence's state
    _, [got] = greedy(runner, PROMPT[:length], 1)
    assert (got - want).abs().max().item() < 1e-5


def test_a_state_copy_continues_where_the_source_left_off(loaded: LoadedModel) -> None:
    runner = runner_of(loaded)
    pages = tuple(range(32))
    runner.forward([SeqWork(0, PROMPT[:20], 0, pages, False, GREEDY, 0, state_slot=0)])
    runner.copy_states([StateCopy(0, 3)])
    a = runner.forward([SeqWork(0, PROMPT[20:30], 20, pages, True, GREEDY, 0, state_slot=0)])
    b = runner.forward([SeqWork(1, PROMPT[20:30], 20, pages, True, GREEDY, 0, state_slot=3)])
    assert a is not None and b is not None and torch.equal(a, b)
    with pytest.raises(ValueError, match="outside"):
        runner.copy_states([StateCopy(0, NUM_SLOTS)])


@pytest.mark.parametrize("where", ["lm_head", "last_layer"])
def test_a_failed_step_leaves_every_state_slot_as_it_was(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A step that raises after the recurrent layers ran (in the last attention layer, or at
    the vocabulary projection) writes no state: the rerun gives the uninterrupted run's logits."""
    reference, runner = runner_of(loaded), runner_of(loaded)
    pages = tuple(range(32))
    prefill = SeqWork(0, PROMPT[:20], 0, pages, False, GREEDY, 0, state_slot=0)
    reference.forward([prefill])
    runner.forward([prefill])
    before = states_of(runner, 0)
    step = SeqWork(0, PROMPT[20:30], 20, pages, True, GREEDY, 0, state_slot=0)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    target = runner.model.layers[-1] if where == "last_layer" else runner
    with monkeypatch.context() as m:
        m.setattr(target, "forward" if where == "last_layer" else "_lm_head", boom)
        with pytest.raises(RuntimeError, match="injected"):
            runner.step([step])
    for a, b in zip(before, states_of(runner, 0), strict=True):
        assert torch.equal(a, b)
    (want,) = reference.step([step])
    (got,) = runner.step([step])
    assert got == want


def test_a_work_without_a_state_slot_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(ValueError, match="state slot -1"):
        runner_of(loaded).forward([SeqWork(0, PROMPT[:4], 0, tuple(range(8)), True, GREEDY, 0)])
    with pytest.raises(ValueError, match="state slots"):
        build_runner(loaded, num_pages=8, page_size=4, dtype=torch.float32)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        (
            {"speculative_method": "ngram"},
            "speculative decoding is not supported for models with recurrent layers",
        ),
        ({"prompt_cache_dir": "/tmp/x"}, "disk tier is not supported for models with recurrent layers"),
        ({"tensor_parallel_size": 2}, "tensor parallelism is not supported for models with recurrent layers"),
    ],
)
def test_what_a_hybrid_cannot_run_with_is_refused_before_its_weights_load(
    lfm2_dir: pathlib.Path, option: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(EngineConfig(model=str(lfm2_dir), **option), read_header(lfm2_dir))


def test_the_plan_runs_it_on_the_float_path_eagerly(lfm2_dir: pathlib.Path) -> None:
    run = plan(EngineConfig(model=str(lfm2_dir), device="cpu"), read_header(lfm2_dir))
    assert not run.packed and run.runner == "float"


def test_an_lfm2_gguf_names_the_lfm2_entry() -> None:  # (its GGUFs: tests/model/test_gguf_hybrid.py)
    assert by_gguf("lfm2").name == "lfm2"
