"""TorchRunner over a tiny random model: paged KV, batching, chunking, prefix reuse, oracles."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ft.core.batch import SeqWork
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.tiny_model import save_hf_dir, tiny_config

GREEDY = SamplingParams(temperature=0.0)
PROMPT_A = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30)
PROMPT_B = (44, 11, 90, 3, 3, 27)


def make_runner(directory: pathlib.Path, num_pages: int = 32, page_size: int = 4) -> TorchRunner:
    return build_runner(load_model(directory, torch.float32), num_pages=num_pages, page_size=page_size,
                       dtype=torch.float32)  # fmt: skip


def generate(runner: TorchRunner, prompt: tuple[int, ...], pages: tuple[int, ...], n: int,
             chunks: list[int] | None = None) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """Greedy tokens, feeding the prompt in `chunks`; also the first step's logits."""
    pos = 0
    logits = None
    for size in chunks or [len(prompt)]:
        piece = prompt[pos : pos + size]
        last = pos + size == len(prompt)
        logits = runner.forward([SeqWork(0, piece, pos, pages, last, GREEDY, 0)])
        pos += size
    assert logits is not None
    out = [int(logits[0].argmax())]
    for i in range(1, n):
        s = runner.step([SeqWork(0, (out[-1],), len(prompt) + i - 1, pages, True, GREEDY, i)])
        out.append(s[0].token_id)
    return out, logits[0]


def test_hf_dir_round_trips_config_tokenizer_and_defaults(tiny_dir: pathlib.Path) -> None:
    loaded = load_model(tiny_dir, torch.float32)
    assert loaded.config.num_layers == 2 and loaded.config.num_kv_heads == 2
    assert loaded.model_id == "tiny"
    assert loaded.generation_defaults == {"temperature": 0.7, "top_p": 0.9}
    spec = loaded.tokenizer
    assert (spec.bos_token, spec.eos_token, spec.add_bos_token) == ("<s>", "</s>", True)
    assert spec.eos_token_ids == (1,)
    assert spec.build().encode('!"#').ids == [2, 3, 4]
    assert spec.chat_template is not None


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {"attention_bias": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ],
)  # fmt: skip
def test_logits_match_transformers(
    tmp_path: pathlib.Path, model_type: str, overrides: dict[str, object]
) -> None:
    transformers = pytest.importorskip("transformers")
    save_hf_dir(tmp_path / "m", tiny_config(**overrides), model_type)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    runner = make_runner(tmp_path / "m")
    prompt = PROMPT_A * 3  # 57 positions: long enough for rope scaling to matter
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]  # [T, vocab]
    works = [SeqWork(0, prompt, 0, tuple(range(16)), True, GREEDY, 0)]
    ours = runner.forward(works)
    assert ours is not None
    assert (ours[0] - expected[-1]).abs().max().item() < 1e-4
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected_tokens = ref[0, len(prompt) :].tolist()  # transformers stops after EOS (id 1)
    ours_tokens = generate(make_runner(tmp_path / "m"), prompt, tuple(range(16)), 8)[0]
    assert ours_tokens[: len(expected_tokens)] == expected_tokens


def test_batched_step_equals_one_at_a_time(tiny_dir: pathlib.Path) -> None:
    solo_a, logits_a = generate(make_runner(tiny_dir), PROMPT_A, (0, 1, 2, 3, 4, 5, 6), 10)
    solo_b, logits_b = generate(make_runner(tiny_dir), PROMPT_B, (9, 10, 11, 12), 10)
    runner = make_runner(tiny_dir)
    pages_a, pages_b = (20, 3, 7, 1, 15, 30, 2), (8, 4, 29, 11)  # scattered, not in order
    first = runner.forward([
        SeqWork(1, PROMPT_A, 0, pages_a, True, GREEDY, 0),
        SeqWork(2, PROMPT_B, 0, pages_b, True, GREEDY, 0),
    ])  # fmt: skip
    assert first is not None
    assert torch.allclose(first[0], logits_a, atol=1e-5) and torch.allclose(first[1], logits_b, atol=1e-5)
    outs = [[int(first[0].argmax())], [int(first[1].argmax())]]
    for i in range(1, 10):
        sampled = runner.step([
            SeqWork(1, (outs[0][-1],), len(PROMPT_A) + i - 1, pages_a, True, GREEDY, i),
            SeqWork(2, (outs[1][-1],), len(PROMPT_B) + i - 1, pages_b, True, GREEDY, i),
        ])  # fmt: skip
        assert [s.seq_id for s in sampled] == [1, 2]
        outs[0].append(sampled[0].token_id)
        outs[1].append(sampled[1].token_id)
    assert outs == [solo_a, solo_b]


def test_mixed_prefill_and_decode_in_one_step(tiny_dir: pathlib.Path) -> None:
    solo_b, _ = generate(make_runner(tiny_dir), PROMPT_B, (0, 1, 2, 3), 4)
    runner = make_runner(tiny_dir)
    first = runner.step([SeqWork(1, PROMPT_B, 0, (0, 1, 2, 3), True, GREEDY, 0)])
    outs = [first[0].token_id]
    # A decode of B shares the step with a non-sampling prefill chunk of A and a sampling one.
    sampled = runner.step([
        SeqWork(2, PROMPT_A[:8], 0, (10, 11, 12, 13, 14), False, GREEDY, 0),
        SeqWork(1, (outs[-1],), len(PROMPT_B), (0, 1, 2, 3), True, GREEDY, 1),
        SeqWork(3, PROMPT_A[:5], 0, (20, 21), True, GREEDY, 0),
    ])  # fmt: skip
    assert [s.seq_id for s in sampled] == [1, 3]
    outs.append(sampled[0].token_id)
    for i in range(2, 4):
        outs.append(
            runner.step([SeqWork(1, (outs[-1],), len(PROMPT_B) + i - 1, (0, 1, 2, 3), True, GREEDY, i)])[
                0
            ].token_id
        )
    assert outs == solo_b


@pytest.mark.parametrize("chunks", [[7, 12], [4, 4, 11], [1, 18]])
def test_chunked_prefill_equals_whole_prompt(tiny_dir: pathlib.Path, chunks: list[int]) -> None:
    whole, logits_whole = generate(make_runner(tiny_dir), PROMPT_A, tuple(range(8)), 8)
    chunked, logits_chunked = generate(make_runner(tiny_dir), PROMPT_A, tuple(range(8)), 8, chunks)
    assert chunked == whole
    assert torch.allclose(logits_chunked, logits_whole, atol=1e-5)


def test_prefix_pages_are_reused(tiny_dir: pathlib.Path) -> None:
    expected, _ = generate(make_runner(tiny_dir), PROMPT_A, (0, 1, 2, 3, 4, 5, 6), 6)
    runner = make_runner(tiny_dir)
    shared = (5, 9, 2)  # first 12 positions, page_size 4
    runner.forward([SeqWork(1, PROMPT_A[:14], 0, (*shared, 17), False, GREEDY, 0)])
    # A second sequence skips the 12 cached positions and writes only its own pages.
    own = (*shared, 20, 21, 22, 23)
    logits = runner.forward([SeqWork(2, PROMPT_A[12:], 12, own, True, GREEDY, 0)])
    assert logits is not None
    out = [int(logits[0].argmax())]
    for i in range(1, 6):
        out.append(
            runner.step([SeqWork(2, (out[-1],), len(PROMPT_A) + i - 1, own, True, GREEDY, i)])[0].token_id
        )
    assert out == expected


def test_bad_page_ids_are_refused(tiny_dir: pathlib.Path) -> None:
    runner = make_runner(tiny_dir, num_pages=4)
    with pytest.raises(ValueError, match="page_ids"):
        runner.step([SeqWork(1, PROMPT_A, 0, (0, 1, 2, 9, 3), True, GREEDY, 0)])
    with pytest.raises(ValueError, match="page_ids"):
        runner.step([SeqWork(1, PROMPT_A, 0, (0, 1), True, GREEDY, 0)])


def test_bytes_per_page_counts_keys_and_values() -> None:
    c = tiny_config()
    assert TorchRunner.bytes_per_page(c, 16, torch.float32) == 2 * 2 * 16 * 2 * 8 * 4
    assert TorchRunner.bytes_per_page(c, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 8 * 2


def test_loading_reports_progress(tiny_dir: pathlib.Path) -> None:
    from ft.model.loader import load_model

    seen: list[float] = []
    load_model(tiny_dir, torch.float32, seen.append)
    assert seen and seen == sorted(seen) and all(0.0 <= f < 1.0 for f in seen)


def test_int8_quantized_runner_stays_close_to_float32(tiny_dir: pathlib.Path) -> None:
    loaded = load_model(tiny_dir, torch.float32)
    exact = build_runner(loaded, num_pages=8, page_size=4, dtype=torch.float32)
    quant = build_runner(loaded, num_pages=8, page_size=4, dtype=torch.float32, quantize="int8")
    work = SeqWork(0, (5, 9, 17, 3, 8), 0, (0, 1), True, SamplingParams(temperature=0), 0)
    a, b = exact.forward([work]), quant.forward([work])
    assert a is not None and b is not None
    cosine = torch.nn.functional.cosine_similarity(a, b).item()
    assert cosine > 0.99, cosine
    (sampled,) = quant.step([work])
    assert 0 <= sampled.token_id < loaded.config.vocab_size


def test_int8_needs_float32_activations(tiny_dir: pathlib.Path) -> None:
    loaded = load_model(tiny_dir, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        build_runner(loaded, num_pages=8, page_size=4, dtype=torch.bfloat16, quantize="int8")
