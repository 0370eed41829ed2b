"""Mistral's `sliding_window`: every layer attends its last `sliding_window` positions.

transformers' own `MistralForCausalLM` with random weights and a window of 8 under a 44-token
prompt: the float32 path matches its logits within 1e-4 from safetensors and from a `llama`
GGUF named Mistral with `llama.attention.sliding_window` (q/k rows permuted as llama.cpp's
converter does); the packed path stays within int8 tolerance of the float path on a Q8_0 file.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from ft.model import kernels
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.support.gguf_files import tiny_tokens
from tests.support.tiny_qwen3 import generate, save_qwen3_dir

transformers = pytest.importorskip("transformers")

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
WINDOW, HEADS, KV_HEADS = 8, 4, 2
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def mistral_model(**overrides: Any) -> Any:
    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=16, max_position_embeddings=512,
        sliding_window=WINDOW, attn_implementation="eager",
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (rotary pairs interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_mistral_gguf(path: pathlib.Path, model: Any, qtype: GGMLQuantizationType) -> pathlib.Path:
    c = model.config
    tokens, merges, types = tiny_tokens()
    w = GGUFWriter(str(path), "llama")
    w.add_name("Mistral tiny")  # a "llama" file named Mistral is Mistral
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name]
        else:
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            gguf_name = f"blk.{layer}.{_NAMES[rest]}"
            if rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                data = _permuted(data, HEADS if "q_proj" in rest else KV_HEADS)
        if data.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.asarray(quantize(data, qtype)), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return mistral_model()


def runner_of(path: pathlib.Path, quantized: bool = False) -> TorchRunner:
    return build_runner(load_model(path, torch.float32, quantized=quantized), num_pages=32, page_size=4,
                       dtype=torch.float32)  # fmt: skip


def expected(model: Any) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor([PROMPT])).logits[0, -1]
    return logits


def test_safetensors_float32_logits_match_transformers(hf_model: Any, tmp_path: pathlib.Path) -> None:
    path = save_qwen3_dir(tmp_path / "mistral", hf_model)
    loaded = load_model(path, torch.float32)
    assert loaded.config.sliding_window == WINDOW and loaded.config.is_all_windowed
    _, logits = generate(runner_of(path), PROMPT, 1)
    assert (logits - expected(hf_model)).abs().max().item() < 1e-4


def test_without_the_window_the_logits_differ(hf_model: Any, tmp_path: pathlib.Path) -> None:
    path = save_qwen3_dir(tmp_path / "mistral", hf_model)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"sliding_window": None}))
    assert load_model(path, torch.float32).config.sliding_window == 0
    _, logits = generate(runner_of(path), PROMPT, 1)
    assert (logits - expected(hf_model)).abs().max().item() > 1e-2


def test_gguf_float_path_matches_transformers(hf_model: Any, tmp_path: pathlib.Path) -> None:
    path = write_mistral_gguf(tmp_path / "mistral.f32.gguf", hf_model, GGMLQuantizationType.F32)
    config = load_model(path, torch.float32).config
    assert config.architecture == "mistral" and config.sliding_window == WINDOW and not config.sliding_layers
    _, logits = generate(runner_of(path), PROMPT, 1)
    assert (logits - expected(hf_model)).abs().max().item() < 1e-4


@pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")
def test_packed_path_agrees_with_the_float_path(hf_model: Any, tmp_path: pathlib.Path) -> None:
    path = write_mistral_gguf(tmp_path / "mistral.q8_0.gguf", hf_model, GGMLQuantizationType.Q8_0)
    want_tokens, want = generate(runner_of(path), PROMPT, 4)
    packed = runner_of(path, quantized=True)
    assert packed.packed is not None and all(layer.args.window == WINDOW for layer in packed.packed.layers)
    got_tokens, got = generate(packed, PROMPT, 4)
    assert (got - want).abs().max().item() < 0.04 * (want.max() - want.min()).item()
    assert got_tokens[0] == want_tokens[0]


def test_a_llama_gguf_keeps_every_position(hf_model: Any, tmp_path: pathlib.Path) -> None:
    """llama.cpp's `llama` files attend everything: the key applies to Mistral only."""
    path = write_mistral_gguf(tmp_path / "mistral.f32.gguf", hf_model, GGMLQuantizationType.F32)
    from tests.support.gguf_files import STRING, RawGGUF, string

    RawGGUF.read(path).set("general.name", STRING, string("tiny llama")).write(tmp_path / "llama.gguf")
    assert load_model(tmp_path / "llama.gguf", torch.float32).config.sliding_window == 0


@pytest.mark.parametrize("window", [WINDOW, None], ids=["key", "no-key"])
def test_a_mistral_gguf_without_the_window_key_warns_that_the_converter_drops_it(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, window: int | None
) -> None:
    """llama.cpp's converter writes no `llama.attention.sliding_window`: such a file attends
    everything (as llama.cpp does) and its load says so; one with the key says nothing."""
    path = write_mistral_gguf(
        tmp_path / "mistral.gguf", mistral_model(sliding_window=window), GGMLQuantizationType.F32
    )
    with caplog.at_level(logging.WARNING, logger="ft.model"):
        config = load_model(path, torch.float32).config
    warnings = [r.getMessage() for r in caplog.records if "'sliding_window'" in r.getMessage()]
    assert config.architecture == "mistral" and config.sliding_window == (window or 0)
    assert len(warnings) == (window is None)
    assert all("converter does not write it" in w and "whole context" in w for w in warnings)


def serve(
    runner: TorchRunner, kv_window: int, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[int, list[int]], int, int]:
    """Greedy tokens of each prompt served together through the scheduler core and `runner`,
    the pages dropped and the most pages in use at once."""
    from ft.core.batch import Sampled, StepDone, TokenOut
    from ft.core.kv import PagePool
    from ft.core.scheduler import Scheduler
    from ft.params import SamplingParams

    s = Scheduler(
        PagePool(runner.num_pages, runner.page_size), max_running=4, max_model_len=512, max_prefill_tokens=16,
        eos_token_ids=[], kv_window=kv_window,
    )  # fmt: skip
    for uid, prompt in enumerate(prompts):
        s.add(uid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: dict[int, list[int]] = {uid: [] for uid in range(len(prompts))}
    peak = 0
    while s.has_work:
        batch = s.schedule()
        assert batch is not None
        peak = max(peak, s.pool.num_used)
        sampled = tuple(o for o in runner.step(list(batch.works)) if isinstance(o, Sampled))
        for out in s.on_step_done(batch, StepDone(batch.step, sampled)):
            assert isinstance(out, TokenOut)
            tokens[out.uid].append(out.token_id)
    return tokens, s.num_dropped_pages, peak


@pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")
def test_pages_behind_the_window_return_to_the_pool_and_the_tokens_stay_the_same(
    hf_model: Any, tmp_path: pathlib.Path
) -> None:
    """Two sequences decoding past the window on a small pool: the pages each passes go back
    (and are handed to the other), and every greedy token is the one all pages held give."""
    path = write_mistral_gguf(tmp_path / "mistral.q8_0.gguf", hf_model, GGMLQuantizationType.Q8_0)
    prompts = [list(PROMPT[:30]), list(PROMPT[5:25])]
    runner = build_runner(load_model(path, torch.float32, quantized=True), num_pages=24, page_size=4,
                         dtype=torch.float32)  # fmt: skip
    held, none_dropped, held_peak = serve(runner, 0, prompts, 40)
    windowed, dropped, windowed_peak = serve(runner, WINDOW, prompts, 40)
    assert none_dropped == 0 and dropped > 0 and windowed_peak < held_peak
    assert windowed == held


def test_a_prompt_longer_than_the_pool_runs_in_a_pool_of_its_window(
    hf_model: Any, tmp_path: pathlib.Path
) -> None:
    """44 prompt tokens and 30 more on 7 pages of 4 (the window's 7 positions, a chunk of 16,
    a page for the straddle): admitted by its window, given pages a chunk ahead, it gives the
    greedy tokens of a pool holding every page (float path)."""
    path = save_qwen3_dir(tmp_path / "mistral", hf_model)
    small = build_runner(load_model(path, torch.float32), num_pages=7, page_size=4, dtype=torch.float32)
    windowed, dropped, peak = serve(small, WINDOW, [list(PROMPT)], 30)
    held, _, _ = serve(runner_of(path), 0, [list(PROMPT)], 30)
    assert windowed == held and len(held[0]) == 30
    assert dropped > 0 and peak <= 7 < -(-(len(PROMPT) + 30) // 4)


async def _engine_tokens(
    path: pathlib.Path, prompt: list[int], n: int, **config: Any
) -> tuple[list[int], Any]:
    """Greedy tokens of `prompt` served by a whole engine of `config`, and its core after."""
    import trio

    from ft.config import EngineConfig
    from ft.engine.engine import open_engine
    from ft.params import SamplingParams
    from ft.prompt import PromptSpec

    engine_config = EngineConfig(
        model=str(path), compute_threads=1, page_size=4, max_prefill_tokens=16, **config
    )
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with trio.fail_after(300):
        async with open_engine(engine_config) as engine:
            async with engine.open_request(PromptSpec(token_ids=tuple(prompt)), params=params) as stream:
                (choice,) = await stream.collect()
            core = engine.core
    return list(choice.token_ids), core


@pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "q8_0"])
async def test_the_disk_tier_and_drafts_with_dropped_pages_give_the_tokens_of_all_pages_held(
    tmp_path: pathlib.Path, kv_cache_dtype: str
) -> None:
    """A windowed model serving through the disk tier and n-gram drafts: the pages saved as
    they fill (before the window drops them), read back by a second server into fresh pages,
    and the drafts verified past dropped pages, all give the tokens of a scheduler holding every
    page without drafts (heads of 32: q8_0 KV blocks)."""
    model = mistral_model(head_dim=32)
    path = write_mistral_gguf(tmp_path / "mistral.q8_0.gguf", model, GGMLQuantizationType.Q8_0)
    prompt, n = list(PROMPT), 24  # repeats itself: the n-gram drafter finds drafts
    runner = build_runner(
        load_model(path, torch.float32, quantized=True), num_pages=32, page_size=4, dtype=torch.float32,
        kv_dtype=kernels.Q8_0_KV if kv_cache_dtype == "q8_0" else torch.float32,
    )  # fmt: skip
    held, _, _ = serve(runner, 0, [prompt], n)
    disk = dict(
        prompt_cache_dir=str(tmp_path / "cache"), prompt_cache_min_tokens=4, kv_cache_dtype=kv_cache_dtype,
        speculative_method="ngram",
    )  # fmt: skip
    first, core = await _engine_tokens(path, prompt, n, **disk)
    assert core.num_dropped_pages > 0 and core.num_draft_tokens > 0
    assert first == held[0]
    second, core = await _engine_tokens(path, prompt, n, **disk)  # a fresh server: RAM is empty
    assert core.num_disk_hit_tokens > 0
    assert second == held[0]


def _serve_core(
    runner: TorchRunner, preempt_at: int, kv_window: int, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[int, list[int]], Any]:
    """As `serve`, with n-gram drafts, request 0 preempted after step `preempt_at` (and again
    five steps on); also the scheduler after."""
    from ft.core.batch import Sampled, StepDone, TokenOut
    from ft.core.kv import PagePool
    from ft.core.scheduler import Scheduler
    from ft.params import SamplingParams

    s = Scheduler(
        PagePool(runner.num_pages, runner.page_size), max_running=4, max_model_len=512, max_prefill_tokens=16,
        eos_token_ids=[], kv_window=kv_window, speculative_tokens=3,
    )  # fmt: skip
    for uid, prompt in enumerate(prompts):
        s.add(uid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: dict[int, list[int]] = {uid: [] for uid in range(len(prompts))}
    while s.has_work:
        batch = s.schedule()
        assert batch is not None
        sampled = tuple(o for o in runner.step(list(batch.works)) if isinstance(o, Sampled))
        for out in s.on_step_done(batch, StepDone(batch.step, sampled)):
            assert isinstance(out, TokenOut)
            tokens[out.uid].append(out.token_id)
        if batch.step in (preempt_at, preempt_at + 5) and 0 in {seq.uid for seq in s.running.values()}:
            s.preempt(0)
    return tokens, s


@pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the packed kernels")
@pytest.mark.parametrize("preempt_at", [1, 4, 12])
def test_preempted_windowed_sequences_recompute_the_tokens_of_all_pages_held(
    hf_model: Any, tmp_path: pathlib.Path, preempt_at: int
) -> None:
    """Three sequences with n-gram drafts, one preempted mid-prefill or mid-decode after pages
    were dropped: it recomputes (its dropped registered pages matched as a cached prefix), and
    every greedy token is the one each gives alone with every page held."""
    path = write_mistral_gguf(tmp_path / "mistral.q8_0.gguf", hf_model, GGMLQuantizationType.Q8_0)
    runner = build_runner(load_model(path, torch.float32, quantized=True), num_pages=32, page_size=4,
                         dtype=torch.float32)  # fmt: skip
    prompts = [list(PROMPT[:30]), list(PROMPT[5:27]), list(PROMPT[:30])]
    alone = [serve(runner, 0, [p], 30)[0][0] for p in prompts]
    tokens, core = _serve_core(runner, preempt_at, WINDOW, prompts, 30)
    assert core.num_preemptions > 0 and core.num_dropped_pages > 0 and core.pool.num_used == 0
    assert core.num_draft_tokens > 0 and core.num_prefix_hit_tokens > 0
    assert [tokens[i] for i in range(len(prompts))] == alone
