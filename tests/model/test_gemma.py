"""Gemma 2 and Gemma 3 text against transformers, on the float and the packed path.

The checkpoints are transformers' own `Gemma2ForCausalLM` / `Gemma3ForCausalLM` with random
weights (`tests.support.tiny_gemma`): a sliding window of 8 under a 44-token prompt, so the
windowed layers see a fraction of it. The float32 path matches transformers' logits within
1e-4 from safetensors and from an F32 GGUF (norms shifted by 1 as llama.cpp's converter writes
them); a Q8_0 GGUF on the packed path stays within int8 tolerance of the same file on the float
path, over every KV cache type.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.gguf_file import ModelFileError
from ft.model.llama import LlamaConfig
from ft.model.loader import LoadedModel, load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.tokenizer.template import render_chat
from tests.support.gguf_files import RawGGUF
from tests.support.tiny_gemma import (
    END_OF_TURN,
    HIDDEN,
    WINDOW,
    gemma2_model,
    gemma3_model,
    save_gemma_dir,
    write_gemma_gguf,
)
from tests.support.tiny_qwen3 import GREEDY, PAGES, generate

transformers = pytest.importorskip("transformers")

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
NEW_TOKENS = 8
PACKED_RELATIVE_TOLERANCE = 0.04  # of the logits' spread: Q8_0 with int8 activations (measured ~0.8%)
BUILDERS = {"gemma2": gemma2_model, "gemma3": gemma3_model}
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def hf_model(family: str) -> Any:
    return BUILDERS[family]()


@pytest.fixture(scope="module")
def gemma_dir(family: str, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_gemma_dir(tmp_path_factory.mktemp(family) / f"tiny-{family}", hf_model)


@pytest.fixture(scope="module")
def gguf_model(family: str) -> Any:
    """The same family with `query_pre_attn_scalar` = head size: a GGUF does not store it."""
    return BUILDERS[family](query_pre_attn_scalar=32)


@pytest.fixture(scope="module")
def gemma_gguf(family: str, gguf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_gemma_gguf(
        tmp_path_factory.mktemp(f"{family}-gguf") / f"tiny-{family}.Q8_0.gguf", gguf_model
    )


def runner_of(loaded: LoadedModel, **kwargs: Any) -> TorchRunner:
    return build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, **kwargs)


def reference(model: Any, prompt: tuple[int, ...] = PROMPT) -> tuple[torch.Tensor, list[int]]:
    """transformers' last logits `[vocab]` and greedy tokens for `prompt`."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1]
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return logits, out[0, len(prompt) :].tolist()


def test_config_maps_gemmas_blocks_from_hf_and_gguf(
    family: str, gemma_dir: pathlib.Path, gemma_gguf: pathlib.Path
) -> None:
    hf = load_model(gemma_dir, torch.float32).config
    gguf = load_model(gemma_gguf, torch.float32).config
    for c in (hf, gguf):
        assert c.architecture == family and c.embed_scale and c.post_norms and c.tie_word_embeddings
        assert c.hidden_act == "gelu_pytorch_tanh" and c.sliding_window == WINDOW
        assert not c.is_all_windowed  # its global layers read every page: none is given back
    assert hf.norm_offset == 1.0 and gguf.norm_offset == 0.0  # the converter added the 1
    assert hf.query_scale == pytest.approx(24**-0.5) and gguf.query_scale == pytest.approx(32**-0.5)
    if family == "gemma2":
        assert hf.sliding_layers == gguf.sliding_layers == (True, False, True, False)
        assert (hf.attn_softcap, hf.final_softcap) == (gguf.attn_softcap, gguf.final_softcap) == (1.5, 4.0)
        assert hf.rope_local_theta == 0.0
    else:
        assert hf.sliding_layers == gguf.sliding_layers == (True,) * 5 + (False, True)
        assert hf.qk_norm and gguf.qk_norm and not hf.attn_softcap and not gguf.final_softcap
        assert hf.rope_local_theta == gguf.rope_local_theta == 10000.0 and hf.rope_theta == 1e6
        assert hf.rope_scaling is not None and gguf.rope_scaling is not None
        assert hf.rope_scaling["rope_type"] == gguf.rope_scaling["rope_type"] == "linear"
        assert hf.rope_scaling["factor"] == gguf.rope_scaling["factor"] == 4.0


def test_gemma3_configs_in_the_old_spelling_map_the_same(gemma_dir: pathlib.Path, family: str) -> None:
    """Hub configs from before transformers 5: `sliding_window_pattern`, `rope_local_base_freq`,
    `rope_theta` and `rope_scaling` instead of `layer_types` and per-type `rope_parameters`."""
    if family != "gemma3":
        pytest.skip("Gemma 3's spellings")
    new = json.loads((gemma_dir / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old |= {
        "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }  # fmt: skip
    a, b = LlamaConfig.from_hf(new), LlamaConfig.from_hf(old)
    assert replace(a, rope_scaling=None) == replace(b, rope_scaling=None)
    assert a.rope_scaling is not None and b.rope_scaling is not None
    assert (a.rope_scaling["rope_type"], a.rope_scaling["factor"]) == (b.rope_scaling["rope_type"], 4.0)


def test_float32_logits_and_greedy_tokens_match_transformers(hf_model: Any, gemma_dir: pathlib.Path) -> None:
    expected, expected_tokens = reference(hf_model)
    tokens, logits = generate(runner_of(load_model(gemma_dir, torch.float32)), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    assert tokens[: len(expected_tokens)] == expected_tokens


def test_the_window_is_what_makes_them_agree(
    hf_model: Any, gemma_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """The same weights with the window as wide as the context: far from transformers' logits,
    so the agreement above needs the window on exactly the windowed layers."""
    expected, _ = reference(hf_model)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((gemma_dir / name).read_bytes())
    cfg = json.loads((gemma_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"sliding_window": 4096}))
    _, logits = generate(runner_of(load_model(tmp_path, torch.float32)), PROMPT, 1)
    assert (logits - expected).abs().max().item() > 1e-2


def test_a_prompt_inside_the_window_matches_too(hf_model: Any, gemma_dir: pathlib.Path) -> None:
    short = PROMPT[: WINDOW - 2]
    expected, _ = reference(hf_model, short)
    _, logits = generate(runner_of(load_model(gemma_dir, torch.float32)), short, 1)
    assert (logits - expected).abs().max().item() < 1e-4


def test_gguf_float_path_matches_transformers(gguf_model: Any, tmp_path: pathlib.Path) -> None:
    """An F32 GGUF as llama.cpp writes it (norms + 1, no lm_head, llama.cpp's query scale)."""
    path = write_gemma_gguf(tmp_path / "tiny.f32.gguf", gguf_model, qtype=GGMLQuantizationType.F32)
    expected, expected_tokens = reference(gguf_model)
    tokens, logits = generate(runner_of(load_model(path, torch.float32)), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    assert tokens[: len(expected_tokens)] == expected_tokens


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


@needs_kernels
@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, kernels.Q8_0_KV], ids=["f32", "f16", "q8_0"]
)
def test_packed_path_agrees_with_the_float_path(gemma_gguf: pathlib.Path, kv_dtype: torch.dtype) -> None:
    """Fed the float path's greedy tokens, the packed path's logits stay within int8 tolerance
    at every step (the decode steps pass the window one position at a time)."""
    float_tokens, _ = generate(runner_of(load_model(gemma_gguf, torch.float32)), PROMPT, NEW_TOKENS)
    packed = runner_of(load_model(gemma_gguf, torch.float32, quantized=True), kv_dtype=kv_dtype)
    assert packed.packed is not None
    steps = zip(
        forced_logits(runner_of(load_model(gemma_gguf, torch.float32)), PROMPT, float_tokens),
        forced_logits(packed, PROMPT, float_tokens),
        strict=True,
    )
    for step, (want, got) in enumerate(steps):
        tolerance = PACKED_RELATIVE_TOLERANCE * (want.max() - want.min()).item()
        assert (got - want).abs().max().item() < tolerance, f"step {step}"
        lead = (want.max() - want[int(got.argmax())]).item()
        assert lead <= 2 * tolerance, f"step {step}: the packed path chose a token {lead:.3g} behind"


@needs_kernels
def test_the_packed_window_is_what_makes_them_agree(gemma_gguf: pathlib.Path) -> None:
    _, want = generate(runner_of(load_model(gemma_gguf, torch.float32)), PROMPT, 1)
    packed = runner_of(load_model(gemma_gguf, torch.float32, quantized=True))
    assert packed.packed is not None
    for layer in packed.packed.layers:
        layer.args.window = 0
    _, got = generate(packed, PROMPT, 1)
    assert (got - want).abs().max().item() > 2 * PACKED_RELATIVE_TOLERANCE * (want.max() - want.min()).item()


@needs_kernels
def test_packed_windowed_rows_do_not_depend_on_chunking_or_batching(gemma_gguf: pathlib.Path) -> None:
    """A prompt fed whole, in chunks of 5 (tiles that start inside and outside the window) or
    beside another sequence gives bitwise the same logits."""
    loaded = load_model(gemma_gguf, torch.float32, quantized=True)
    whole = runner_of(loaded).forward([SeqWork(0, PROMPT, 0, PAGES, True, GREEDY, 0)])
    chunked_runner = runner_of(loaded)
    for start in range(0, len(PROMPT), 5):
        chunk = PROMPT[start : start + 5]
        last = start + 5 >= len(PROMPT)
        chunked = chunked_runner.forward([SeqWork(0, chunk, start, PAGES, last, GREEDY, 0)])
    other = tuple(range(16, 32))
    batched = runner_of(loaded).forward(
        [SeqWork(1, PROMPT[:13], 0, other, True, GREEDY, 0), SeqWork(0, PROMPT, 0, PAGES, True, GREEDY, 0)]
    )
    assert whole is not None and chunked is not None and batched is not None
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[0], batched[1])


@needs_kernels
def test_packed_layer_refuses_one_output_norm_without_the_other(gemma_gguf: pathlib.Path) -> None:
    runner = runner_of(load_model(gemma_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[1].args.mlp_out_norm = None
    with pytest.raises(kernels.KernelError, match="output norms"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


@needs_kernels
def test_packed_layer_refuses_a_negative_window(gemma_gguf: pathlib.Path) -> None:
    runner = runner_of(load_model(gemma_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[0].args.window = -3
    with pytest.raises(kernels.KernelError, match="window -3"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "packed"])
def test_a_post_norm_of_the_wrong_shape_is_a_named_load_error(
    gemma_gguf: pathlib.Path, tmp_path: pathlib.Path, quantized: bool
) -> None:
    raw = RawGGUF.read(gemma_gguf)
    raw.retensor("blk.2.post_ffw_norm.weight", dims=(HIDDEN // 2,)).write(tmp_path / "short-norm.gguf")
    with pytest.raises(ModelFileError, match=r"blk\.2\.post_ffw_norm\.weight: expected shape \[64\]"):
        load_model(tmp_path / "short-norm.gguf", torch.float32, quantized=quantized)


def test_a_missing_post_norm_is_a_named_load_error(gemma_gguf: pathlib.Path, tmp_path: pathlib.Path) -> None:
    raw = RawGGUF.read(gemma_gguf)
    raw.tensors = [
        replace(t, name="blk.0.post_attn_norm.weight") if t.name == "blk.0.post_attention_norm.weight" else t
        for t in raw.tensors
    ]
    raw.write(tmp_path / "no-post-norm.gguf")
    with pytest.raises(ModelFileError, match=r"blk\.0\.post_attention_norm\.weight is missing"):
        load_model(tmp_path / "no-post-norm.gguf", torch.float32)


def test_gguf_tokenizer_gives_transformers_ids_and_stops_at_end_of_turn(gemma_gguf: pathlib.Path) -> None:
    spec = load_model(gemma_gguf, torch.float32).tokenizer
    ours = spec.build()
    theirs = transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    texts = ["Hello the user", "  hello  you    there\n\nok", "<start_of_turn>user\nhi<end_of_turn>\n",
             "Ünïcode ✓ 🙂", " leading", "xxxxx"]  # fmt: skip
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert spec.bos_token == "<bos>" and spec.add_bos_token
    assert spec.eos_token_ids == (1, ours.token_to_id(END_OF_TURN))


def test_gemmas_template_folds_the_system_prompt_into_the_first_turn(
    family: str, gemma_gguf: pathlib.Path
) -> None:
    spec = load_model(gemma_gguf, torch.float32).tokenizer
    assert spec.chat_template is not None
    messages = [{"role": "user", "content": "hi"}]
    text = render_chat(spec.chat_template, messages, bos_token=spec.bos_token)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    if family == "gemma3":
        system = [{"role": "system", "content": "Be brief."}, *messages]
        folded = render_chat(spec.chat_template, system, bos_token=spec.bos_token)
        assert folded == "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_two_tensor_parallel_ranks_give_the_tokens_and_logits_of_one(gemma_dir: pathlib.Path) -> None:
    """Output norms and soft-caps apply to the summed (all-reduced) outputs, the windows per rank."""
    from tests.support.parallel import tensor_parallel_runner

    one_tokens, one_logits = generate(runner_of(load_model(gemma_dir, torch.float32)), PROMPT, NEW_TOKENS)
    with tensor_parallel_runner(str(gemma_dir), 2, num_pages=32, page_size=4) as runner:
        tokens, logits = generate(runner, PROMPT, NEW_TOKENS)
    assert tokens == one_tokens
    assert (logits - one_logits).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_graphed_gemma_gives_the_cpu_tokens(gemma_dir: pathlib.Path) -> None:
    """float32 on the GPU (explicit soft-capped attention, decode graphs with window masks)."""
    loaded = load_model(gemma_dir, torch.float32)
    gpu = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, device=torch.device("cuda"))
    tokens_gpu, logits_gpu = generate(gpu, PROMPT, NEW_TOKENS)
    tokens_cpu, logits_cpu = generate(runner_of(loaded), PROMPT, NEW_TOKENS)
    assert tokens_gpu == tokens_cpu
    assert (logits_gpu.cpu() - logits_cpu).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": "8"}, "sliding_window"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"hidden_activation": "relu"}, "hidden activation 'relu'"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_a_bad_gemma_config_is_refused_naming_the_key(
    gemma_dir: pathlib.Path, tmp_path: pathlib.Path, edit: dict[str, Any], message: str
) -> None:
    cfg = json.loads((gemma_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, torch.float32)


def test_hidden_act_is_not_gemmas_activation(
    hf_model: Any, gemma_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """transformers' Gemma MLP reads `hidden_activation` only (tanh GELU by default): a config
    whose `hidden_act` says "gelu" (older conversions) without it runs as transformers does."""
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (gemma_dir / name).exists():
            (tmp_path / name).symlink_to(gemma_dir / name)
    cfg = json.loads((gemma_dir / "config.json").read_text())
    cfg.pop("hidden_activation", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"hidden_act": "gelu"}))
    loaded = load_model(tmp_path, torch.float32)
    assert loaded.config.hidden_act == "gelu_pytorch_tanh"


def _edited(gemma_gguf: pathlib.Path, tmp_path: pathlib.Path, edit: Any) -> pathlib.Path:
    edit(RawGGUF.read(gemma_gguf)).write(tmp_path / "edited.gguf")
    return tmp_path / "edited.gguf"


def test_a_sliding_window_pattern_in_the_file_decides_the_layers(
    family: str, gemma_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from tests.support.gguf_files import ARRAY, BOOL, U32, array, scalar

    layers = len(load_model(gemma_gguf, torch.float32).config.sliding_layers)
    key = f"{family}.attention.sliding_window_pattern"
    period = _edited(gemma_gguf, tmp_path, lambda raw: raw.set(key, U32, scalar(U32, 3)))
    assert load_model(period, torch.float32).config.sliding_layers == tuple(i % 3 < 2 for i in range(layers))
    flags = [i == 1 for i in range(layers)]
    listed = _edited(
        gemma_gguf, tmp_path, lambda raw: raw.set(key, ARRAY, array(BOOL, [scalar(BOOL, f) for f in flags]))
    )
    assert load_model(listed, torch.float32).config.sliding_layers == tuple(flags)
    short = _edited(gemma_gguf, tmp_path, lambda raw: raw.set(key, ARRAY, array(BOOL, [scalar(BOOL, True)])))
    with pytest.raises(ModelFileError, match="sliding_window_pattern.*one per layer"):
        load_model(short, torch.float32)
    zero = _edited(gemma_gguf, tmp_path, lambda raw: raw.set(key, U32, scalar(U32, 0)))
    with pytest.raises(ModelFileError, match="sliding_window_pattern"):
        load_model(zero, torch.float32)


def test_a_gguf_without_the_optional_keys_gets_llama_cpps_defaults(
    family: str, gemma_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Gemma 2: a window of 4096 and soft-caps of 50 / 30; Gemma 3 needs its window."""

    def drop(raw: RawGGUF) -> RawGGUF:
        for key in ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
            raw = raw.drop(f"{family}.{key}")
        return raw

    path = _edited(gemma_gguf, tmp_path, drop)
    if family == "gemma3":
        with pytest.raises(
            ModelFileError, match="lacks required metadata key 'gemma3.attention.sliding_window'"
        ):
            load_model(path, torch.float32)
        return
    c = load_model(path, torch.float32).config
    assert (c.sliding_window, c.attn_softcap, c.final_softcap) == (4096, 50.0, 30.0)


def test_a_negative_soft_cap_in_the_file_is_refused(
    family: str, gemma_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from tests.support.gguf_files import F32, scalar

    key = f"{family}.final_logit_softcapping"
    path = _edited(gemma_gguf, tmp_path, lambda raw: raw.set(key, F32, scalar(F32, -1.0)))
    with pytest.raises(ModelFileError, match="final_logit_softcapping"):
        load_model(path, torch.float32)


def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path: pathlib.Path) -> None:
    """Gemma 3 4B and up are `Gemma3ForConditionalGeneration`: the text model's `text_config`
    and `language_model.*` weights are read, the vision tower left out."""
    from tests.support.tiny_gemma import gemma3_multimodal_model

    model = gemma3_multimodal_model()
    path = save_gemma_dir(tmp_path / "gemma3-mm", model)
    loaded = load_model(path, torch.float32)
    assert loaded.config.architecture == "gemma3" and loaded.config.num_layers == 7
    assert not any("vision" in k or "projector" in k for k in loaded.state_dict)
    expected, expected_tokens = reference(model)
    tokens, logits = generate(runner_of(loaded), PROMPT, NEW_TOKENS)
    assert (logits - expected).abs().max().item() < 1e-4
    assert tokens[: len(expected_tokens)] == expected_tokens


def test_a_hub_multimodal_config_without_the_default_keys_gets_transformers_defaults() -> None:
    """The hub's gemma-3-4b-it `text_config` lists only what differs from the defaults."""
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }  # fmt: skip
    c = LlamaConfig.from_hf(cfg)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 256, 262208)
    assert c.sliding_window == 1024 and c.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(34))
    assert c.rope_theta == 1e6 and c.rope_local_theta == 10000.0 and c.query_scale == 256**-0.5
    assert c.rope_scaling is not None and c.rope_scaling["factor"] == 8.0 and c.tie_word_embeddings


def test_float_path_in_chunks_and_batched_decodes_matches_transformers(
    hf_model: Any, gemma_dir: pathlib.Path
) -> None:
    """Prefill chunks that start past the window, and decodes of two sequences of different
    lengths in one step (each gathers its own window), still give transformers' logits."""
    runner = runner_of(load_model(gemma_dir, torch.float32))
    short = PROMPT[:11]
    for start in range(0, len(PROMPT) - 1, 5):
        chunk = PROMPT[start : min(start + 5, len(PROMPT) - 1)]
        runner.forward([SeqWork(0, chunk, start, PAGES, False, GREEDY, 0)])
    runner.forward([SeqWork(1, short[:-1], 0, tuple(range(16, 32)), False, GREEDY, 0)])
    logits = runner.forward(
        [
            SeqWork(0, PROMPT[-1:], len(PROMPT) - 1, PAGES, True, GREEDY, 0),
            SeqWork(1, short[-1:], len(short) - 1, tuple(range(16, 32)), True, GREEDY, 0),
        ]
    )
    assert logits is not None
    for row, prompt in enumerate((PROMPT, short)):
        expected, _ = reference(hf_model, prompt)
        assert (logits[row] - expected).abs().max().item() < 1e-4
