"""Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next from safetensors against transformers.

Each checkpoint is transformers' own `*ForCausalLM` of `AutoConfig.for_model(...)` with every
weight redrawn (A_log, dt_bias and the norms included: `tests.support.tiny_qwen35`), saved with
`save_pretrained`, loaded through ft's loader and run by the float runner with its state
slots. float32 logits agree with transformers within 1e-4 of their scale over a 150-token
prompt fed in chunks of 48 across 38 pages of 4 (and whole, so a span crosses the rule's chunk
of 64), then greedy decode steps; a failed step leaves every slot as it was. A multimodal
checkpoint (`Qwen3_5ForConditionalGeneration`) runs its text model, the vision tower and the
multi-token prediction head left out. Last, what a Qwen3.5-9B-shaped model's pages and state
slots take.
"""

from __future__ import annotations

import copy
import logging
import pathlib
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ft.core.batch import SeqWork
from ft.model.architectures import by_hf
from ft.model.deltanet import DeltaNetConfig
from ft.model.hybrid import state_slot_bytes
from ft.model.llama import LlamaConfig
from ft.model.loader import LoadedModel, load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.support.tiny_families import save_dir
from tests.support.tiny_lfm2 import GREEDY, greedy
from tests.support.tiny_qwen35 import MODEL_TYPES, qwen35_model, save_vlm_dir

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # of the logits' scale (~4 here): four layers' float32 rounding, as test_qwen35's
PROMPT = tuple((i * 7) % 250 + 3 for i in range(150))
NEW_TOKENS = 6
NUM_SLOTS = 4


@pytest.fixture(scope="module", params=MODEL_TYPES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, LoadedModel]:
    """transformers' model of one family and ft's load of its saved checkpoint."""
    torch.set_num_threads(1)
    model = qwen35_model(request.param, seed=1)
    directory = save_dir(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}", model)
    return model, load_model(directory, torch.float32)


def runner_of(loaded: LoadedModel) -> TorchRunner:
    return build_runner(loaded, num_pages=48, page_size=4, dtype=torch.float32, num_state_slots=NUM_SLOTS)


def states_of(runner: TorchRunner, slot: int) -> list[torch.Tensor]:
    assert runner.states is not None
    return [t[slot].clone() for layer in runner.states.layers for t in layer]


def test_the_config_reads_the_layers_the_deltanet_and_the_experts(family: tuple[Any, LoadedModel]) -> None:
    hf_model, loaded = family
    c = loaded.config
    assert c.layer_types == ("gated_deltanet",) * 3 + ("attention",) and c.num_kv_layers == 1
    assert c.mixer_config == DeltaNetConfig(
        hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32, conv_kernel=4
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_width) == (4, 2, 32, 8)
    assert c.norm_offset == 0.0  # the (1 + w) is the norm module's, not folded into the weights
    if c.architecture == "qwen3_5":
        assert c.num_experts == 0 and c.intermediate_size == 128
    else:
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
        assert c.shared_expert_intermediate_size == 48 and c.norm_topk_prob
        assert c.mlp_only_layers == ((2,) if c.architecture == "qwen3_next" else ())
    family = by_hf(hf_model.config.to_dict())
    assert c.architecture == family.name
    assert (family.reasoning_parser, family.tool_call_parser) == ("think", "qwen3_coder")


@pytest.mark.parametrize("chunk", [48, 0])
def test_float32_logits_and_greedy_tokens_match_transformers(
    family: tuple[Any, LoadedModel], chunk: int
) -> None:
    hf_model, loaded = family
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens, logits = greedy(runner_of(loaded), PROMPT, NEW_TOKENS, slot=2, chunk=chunk)
    assert tokens == ref.sequences[0, len(PROMPT) :].tolist()
    for mine, theirs in zip(logits, ref.logits, strict=True):
        scale = theirs.abs().max().item()
        assert (mine - theirs[0]).abs().max().item() < TOLERANCE * scale


def test_a_failed_step_leaves_every_state_slot_as_it_was(
    family: tuple[Any, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises in its last layer (the attention, after every DeltaNet layer ran)
    writes no state: the rerun gives the uninterrupted run's tokens."""
    _, loaded = family
    reference, runner = runner_of(loaded), runner_of(loaded)
    pages = tuple(range(48))
    prefill = SeqWork(0, PROMPT[:70], 0, pages, False, GREEDY, 0, state_slot=1)
    reference.forward([prefill])
    runner.forward([prefill])
    before = states_of(runner, 1)
    step = SeqWork(0, PROMPT[70:100], 70, pages, True, GREEDY, 0, state_slot=1)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(runner.model.layers[-1], "forward", boom)
        with pytest.raises(RuntimeError, match="injected"):
            runner.step([step])
    for a, b in zip(before, states_of(runner, 1), strict=True):
        assert torch.equal(a, b)
    (want,) = reference.step([step])
    (got,) = runner.step([step])
    assert got == want


def test_a_multimodal_checkpoint_runs_its_text_model(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A `Qwen3_5ForConditionalGeneration` directory (the text model under
    `model.language_model.`, a vision tower, an `mtp.*` head) loads as the text model alone."""
    model = qwen35_model("qwen3_5", seed=2)
    text = load_model(save_dir(tmp_path / "text", model), torch.float32)
    vlm_dir = save_vlm_dir(tmp_path / "vlm", model)
    save_file({"mtp.fc.weight": torch.zeros(64, 128)}, str(vlm_dir / "mtp.safetensors"))
    with caplog.at_level(logging.INFO, logger="ft.model"):
        vlm = load_model(vlm_dir, torch.float32)
    assert vlm.config == text.config
    assert sorted(vlm.state_dict) == sorted(text.state_dict)
    assert "left out" in caplog.text and "mtp.*" in caplog.text and "model.visual.*" in caplog.text
    _, [a] = greedy(runner_of(text), PROMPT[:30], 1)
    _, [b] = greedy(runner_of(vlm), PROMPT[:30], 1)
    assert torch.equal(a, b)


def test_in_a_bfloat16_model_the_deltanets_small_parameters_stay_float32(tmp_path: pathlib.Path) -> None:
    """Its decays, time-step biases, conv and gated norm are read and kept as float32; its
    projections, attention and MLPs are bfloat16; its logits are as near the float32 model's as
    transformers' own bfloat16 model's are (0.13 and 0.16 of ~3.3 here: these random weights
    round far in bfloat16)."""
    model = qwen35_model("qwen3_5_moe", seed=1)
    directory = save_dir(tmp_path / "moe", model)
    low = load_model(directory, torch.bfloat16)
    assert low.state_dict["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert low.state_dict["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16
    runner = build_runner(low, num_pages=48, page_size=4, dtype=torch.bfloat16, num_state_slots=NUM_SLOTS)
    mixer = runner.model.layers[0].mixer
    assert {p.dtype for n, p in mixer.named_parameters() if n in mixer.float32_parameters} == {torch.float32}
    assert mixer.in_proj.weight.dtype == torch.bfloat16
    _, [got] = greedy(runner, PROMPT, 1, chunk=48)
    with torch.inference_mode():
        want = model(torch.tensor([PROMPT])).logits[0, -1]
        theirs = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor([PROMPT])).logits[0, -1].float()
    assert (got.float() - want).abs().max().item() < 1.5 * (theirs - want).abs().max().item()


def _qwen35_9b(**text: Any) -> dict[str, Any]:
    """Qwen3.5-9B's published shape (a `Qwen3_5ForConditionalGeneration` config.json's text
    model): 32 layers of hidden 4096, every fourth gated attention of 16 heads over 4 kv heads
    of 256, the others Gated DeltaNet of 16 key heads and 32 value heads of 128."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 12288,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "vocab_size": 248320, "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True,
            },
            **text,
        },
    }  # fmt: skip


def test_a_9b_shaped_model_keeps_kv_for_a_quarter_of_its_layers() -> None:
    """A page of 16 slots in bfloat16 holds the 8 attention layers' KV, 524,288 bytes (2,097,152
    were every layer to attend); one sequence's state (24 DeltaNet layers: 3 conv inputs of
    8,192 channels and 32 matrices of 128 x 128, float32) takes 52,690,944 bytes."""
    hybrid = LlamaConfig.from_hf(_qwen35_9b())
    assert hybrid.num_kv_layers == 8 and hybrid.rotary_width == 64
    assert TorchRunner.bytes_per_page(hybrid, 16, torch.bfloat16) == 524_288
    attends = LlamaConfig.from_hf(_qwen35_9b(layer_types=["full_attention"] * 32))
    assert TorchRunner.bytes_per_page(attends, 16, torch.bfloat16) == 2_097_152
    assert state_slot_bytes(hybrid) == 24 * 4 * (3 * 8192 + 32 * 128 * 128) == 52_690_944


def test_a_config_that_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="rotary scaling"):
        LlamaConfig.from_hf(_qwen35_9b(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    cfg = _qwen35_9b()
    del cfg["text_config"]["linear_num_key_heads"]
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        LlamaConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="attention with biases"):
        LlamaConfig.from_hf(_qwen35_9b(attention_bias=True))
