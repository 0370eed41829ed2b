"""Rerank scores agree with transformers: the last token's hidden state (after the final norm)
through the classification head, for pairs fed through the real scheduler in chunks.

Hugging Face `Qwen3ForSequenceClassification` / `LlamaForSequenceClassification` (one label,
`score.weight`) on the float path: the raw logit within `FLOAT_TOLERANCE`. A Qwen3-Reranker-style
GGUF (`cls.output.weight` = the lm_head's "yes" and "no" rows, softmaxed as llama.cpp does):
p(yes) against transformers' causal LM on the same weights, within `FLOAT_TOLERANCE` with F32
weights, within `PACKED_TOLERANCE` with Q8_0 weights run as stored. Malformed heads are named
load errors.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch

from ft.config import resolve_pooling
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.model import kernels
from ft.model.gguf_file import ModelFileError
from ft.model.loader import load_model
from ft.model.rerank import RankFormat
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from tests.model.test_pooling_agreement import pool_on
from tests.support.tiny_qwen3 import HIDDEN
from tests.support.tiny_rerank import (
    causal_model,
    hf_scores,
    save_seq_cls_dir,
    seq_cls_model,
    write_rank_gguf,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30] * 3,  # 57: four chunks
    [44, 11, 90, 3, 3, 27],
    [9],
    [200, 201, 202, 203, 204, 205, 206, 207, 208, 209],
    [61, 62, 63, 64, 65, 66, 67, 68],
]
FLOAT_TOLERANCE = 1e-4
PACKED_TOLERANCE = 0.02  # p(yes), Q8_0 weights and int8 activations (measured below)

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")


def ft_scores(runner: TorchRunner, prompts: list[list[int]], fmt: RankFormat, **sched: int) -> list[float]:
    """Each prompt scored by the real scheduler and runner (all batched, prefill in chunks)."""
    opts = {"max_running": 8, "max_model_len": 512, "max_prefill_tokens": 16} | sched
    s = Scheduler(PagePool(runner.num_pages, runner.page_size), eos_token_ids=[], **opts)
    return [fmt.score(o.vector) for o in pool_on(s, runner, prompts, "rank")]


def order(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda k: -scores[k])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_sequence_classifier_scores_as_transformers(tmp_path: pathlib.Path, family: str) -> None:
    hf = seq_cls_model(family)
    loaded = load_model(save_seq_cls_dir(tmp_path / "m", hf), torch.float32)
    assert loaded.config.pooling == "rank" and loaded.classifier is not None
    assert loaded.rank_format is not None and loaded.rank_format.num_labels == 1
    assert not any(k.startswith("score") for k in loaded.state_dict)  # the decoder never sees it
    runner = build_runner(loaded, num_pages=64, page_size=4, dtype=torch.float32)
    ours, theirs = ft_scores(runner, PROMPTS, loaded.rank_format), hf_scores(hf, PROMPTS)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < FLOAT_TOLERANCE
    assert order(ours) == order(theirs)
    assert len(set(order(theirs))) == len(PROMPTS) and max(theirs) - min(theirs) > 0.05  # a real ordering


@pytest.fixture(scope="module")
def causal() -> object:
    return causal_model()


def test_rank_gguf_scores_as_transformers_on_the_float_path(tmp_path: pathlib.Path, causal: object) -> None:
    path = write_rank_gguf(tmp_path / "r.gguf", causal)
    loaded = load_model(path, torch.float32)
    fmt = loaded.rank_format
    assert loaded.config.pooling == "rank" and fmt is not None
    assert fmt.num_labels == 2 and fmt.labels == ("yes", "no") and fmt.template is not None
    runner = build_runner(loaded, num_pages=64, page_size=4, dtype=torch.float32)
    ours, theirs = ft_scores(runner, PROMPTS, fmt), hf_scores(causal, PROMPTS)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < FLOAT_TOLERANCE
    assert order(ours) == order(theirs)


@needs_kernels
def test_rank_gguf_scores_as_transformers_on_the_packed_path(tmp_path: pathlib.Path, causal: object) -> None:
    path = write_rank_gguf(tmp_path / "q.gguf", causal, quantized=True)
    loaded = load_model(path, torch.float32, quantized=True)
    assert loaded.rank_format is not None
    runner = build_runner(loaded, num_pages=64, page_size=16, dtype=torch.float32)
    assert runner.packed is not None
    ours = ft_scores(runner, PROMPTS, loaded.rank_format)
    theirs = hf_scores(causal, PROMPTS)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < PACKED_TOLERANCE
    # Alone, batched, in other chunks: the same score (the head sees one row either way).
    alone = [ft_scores(runner, [p], loaded.rank_format, max_prefill_tokens=512)[0] for p in PROMPTS]
    assert alone == pytest.approx(ours, abs=1e-6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"head": np.zeros((3, HIDDEN), np.float32)}, r"cls\.output\.weight: expected shape \[2, 64\]"),
        ({"head": np.zeros((2, HIDDEN + 1), np.float32)}, r"cls\.output\.weight: expected shape \[2, 64\]"),
        ({"head": np.zeros((2,), np.float32)}, r"cls\.output\.weight: expected shape"),
        ({"labels": ["relevant"]}, r"cls\.output\.weight: expected shape \[1, 64\]"),
        ({"extra": {"cls.bias": np.zeros(HIDDEN, np.float32)}}, r"cls\.bias without cls\.weight"),
        (
            {"extra": {"cls.weight": np.zeros((HIDDEN, 3), np.float32)}},
            r"cls\.weight: expected shape \[64, 64\]",
        ),
        ({"extra": {"cls.output.bias": np.zeros(5, np.float32)}}, r"cls\.output\.bias: expected shape \[2\]"),
        ({"head": np.full((2, HIDDEN), np.nan, np.float32)}, r"cls\.output\.weight holds NaN"),
    ],
    ids=["rows", "width", "1-D", "labels", "bias-alone", "dense", "out-bias", "nan"],
)
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "packed"])
def test_a_malformed_head_is_a_named_load_error(
    tmp_path: pathlib.Path, causal: object, changes: dict[str, object], message: str, quantized: bool
) -> None:
    path = write_rank_gguf(tmp_path / "bad.gguf", causal, **changes)  # type: ignore[arg-type]
    with pytest.raises(ModelFileError, match=message):
        load_model(path, torch.float32, quantized=quantized)


def test_rank_pooling_without_a_head_is_a_named_load_error(tmp_path: pathlib.Path) -> None:
    from tests.support.gguf_files import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "p.gguf", pooling_type=4)
    with pytest.raises(ModelFileError, match=r"cls\.output\.weight is missing: its pooling_type is rank"):
        load_model(path, torch.float32, quantized=True)


def test_a_dense_layer_and_biases_are_applied(tmp_path: pathlib.Path, causal: object) -> None:
    """`cls.weight` + `cls.bias` then tanh, then `cls.output` + its bias (llama.cpp's order)."""
    rng = np.random.default_rng(1)
    dense, dense_b = rng.normal(0, 0.3, (HIDDEN, HIDDEN)), rng.normal(0, 0.3, HIDDEN)
    out, out_b = rng.normal(0, 0.3, (2, HIDDEN)), rng.normal(0, 0.3, 2)
    extra = {"cls.weight": dense, "cls.bias": dense_b, "cls.output.bias": out_b}
    path = write_rank_gguf(tmp_path / "d.gguf", causal, head=out.astype(np.float32),
                           extra={k: v.astype(np.float32) for k, v in extra.items()})  # fmt: skip
    loaded = load_model(path, torch.float32)
    assert loaded.rank_format is not None
    runner = build_runner(loaded, num_pages=64, page_size=4, dtype=torch.float32)
    ours = ft_scores(runner, PROMPTS[:2], loaded.rank_format)
    with torch.inference_mode():
        expected = []
        for prompt in PROMPTS[:2]:
            h = causal.model(torch.tensor([prompt])).last_hidden_state[0, -1].double()  # type: ignore[attr-defined]
            x = torch.tanh(torch.from_numpy(dense) @ h + torch.from_numpy(dense_b))
            expected.append(float(torch.softmax(torch.from_numpy(out) @ x + torch.from_numpy(out_b), -1)[0]))
    assert ours == pytest.approx(expected, abs=FLOAT_TOLERANCE)


def test_a_classifier_with_two_labels_is_refused(tmp_path: pathlib.Path) -> None:
    hf = seq_cls_model("qwen3", num_labels=2)
    with pytest.raises(ValueError, match="has 2 labels"):
        load_model(save_seq_cls_dir(tmp_path / "m", hf), torch.float32)


def test_rank_needs_a_head_and_auto_picks_it() -> None:
    with pytest.raises(ValueError, match="--pooling rank needs a reranker"):
        resolve_pooling("rank", None)
    assert resolve_pooling("auto", "rank", can_rank=True) == "rank"
    assert resolve_pooling("auto", None, can_rank=True) == "rank"
    assert resolve_pooling("last", "rank", can_rank=True) == "last"


def test_the_pair_format_follows_llama_server() -> None:
    fmt = RankFormat(1, template="Q: {query} D: {document}")
    assert fmt.render("a {document}", "b") == "Q: a {document} D: b"  # one pass
    plain = RankFormat(1, bos_id=1, eos_id=2, sep_id=3)
    assert plain.pair_ids([10, 11], [20]) == [10, 11, 20]  # a tokenizer that adds nothing
    every = RankFormat(1, bos_id=1, eos_id=2, sep_id=3, add_bos=True, add_eos=True, add_sep=True)
    assert every.pair_ids([10, 11], [20]) == [1, 10, 11, 2, 3, 20, 2]
    assert RankFormat.score([0.25, 0.75]) == 0.25


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.pop("score.weight"), "a sequence classifier without its score.weight"),
        (
            lambda sd: sd.update({"score.weight": torch.zeros(1, HIDDEN + 2)}),
            r"tensor score\.weight: expected shape",
        ),
        (lambda sd: sd.update({"score.bias": torch.zeros(3)}), r"tensor score\.bias: expected shape \[1\]"),
    ],
    ids=["missing", "width", "bias"],
)
def test_a_malformed_score_head_is_a_named_load_error(
    tmp_path: pathlib.Path, edit: Any, message: str
) -> None:
    from safetensors.torch import load_file, save_file

    directory = save_seq_cls_dir(tmp_path / "m", seq_cls_model("llama"))
    sd = load_file(str(directory / "model.safetensors"))
    edit(sd)
    save_file(sd, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_model(directory, torch.float32)
