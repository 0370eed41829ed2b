"""Prompt logprobs: what the runner scores equals a direct full forward pass (transformers, float32)
of the same tiny random model, however the prompt is chunked, cached or recomputed."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ft.core.batch import Sampled, Scored, SeqWork, StepDone, TokenOut, TokenScore
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.errors import ContextLengthExceeded
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.tiny_model import save_hf_dir, tiny_config

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 44, 11, 90, 3, 27)
TOP = 3
TOLERANCE = 1e-4


@pytest.fixture
def model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    save_hf_dir(tmp_path / "m", tiny_config())
    return tmp_path / "m"


@pytest.fixture
def reference(model_dir: pathlib.Path) -> torch.Tensor:
    """log_softmax of a direct full forward pass over PROMPT: `[T, vocab]`."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


def make_runner(model_dir: pathlib.Path, num_pages: int = 32) -> TorchRunner:
    return build_runner(
        load_model(model_dir, torch.float32), num_pages=num_pages, page_size=4, dtype=torch.float32
    )


def assert_scores_match(scores: tuple[TokenScore, ...] | list[TokenScore], reference: torch.Tensor) -> None:
    """Score i is prompt token i + 1 under the logits at position i, with its top `TOP`."""
    assert [s.token_id for s in scores] == list(PROMPT[1:])
    for pos, score in enumerate(scores):
        assert abs(score.logprob - reference[pos, PROMPT[pos + 1]].item()) < TOLERANCE
        expected = torch.topk(reference[pos], TOP).values.tolist()
        assert len(score.top_logprobs) == TOP
        for (token, lp), want in zip(score.top_logprobs, expected, strict=True):
            assert abs(lp - want) < TOLERANCE and abs(reference[pos, token].item() - lp) < TOLERANCE


@pytest.mark.parametrize("chunks", [[len(PROMPT)], [5, 7, 12], [1] * len(PROMPT)])
def test_chunked_prefill_scores_equal_a_full_forward_pass(
    model_dir: pathlib.Path, reference: torch.Tensor, chunks: list[int]
) -> None:
    """However the prefill is chunked, each chunk scores the prompt tokens after its positions."""
    runner = make_runner(model_dir)
    params = SamplingParams(temperature=0.0, prompt_logprobs=TOP)
    pages = tuple(range(7))
    scores: list[TokenScore] = []
    pos = 0
    for size in chunks:
        stop = pos + size
        work = SeqWork(0, PROMPT[pos:stop], pos, pages, stop == len(PROMPT), params, 0,
                       score_ids=PROMPT[pos + 1 : min(stop, len(PROMPT) - 1) + 1])  # fmt: skip
        out = runner.step([work])
        scores += [x for s in out if isinstance(s, Scored) for x in s.scores]
        pos = stop
    assert_scores_match(scores, reference)


def drive(s: Scheduler, runner: TorchRunner) -> list[TokenOut]:
    """Run the scheduler and the runner to the end, synchronously; every token out."""
    outs: list[TokenOut] = []
    while (batch := s.schedule()) is not None:
        result = runner.step(list(batch.works))
        done = StepDone(
            batch.step,
            tuple(x for x in result if isinstance(x, Sampled)),
            scored=tuple(x for x in result if isinstance(x, Scored)),
        )
        outs += [o for o in s.on_step_done(batch, done) if isinstance(o, TokenOut)]
    return outs


def scheduler(num_pages: int = 32) -> Scheduler:
    return Scheduler(PagePool(num_pages, 4), max_running=4, max_model_len=256, max_prefill_tokens=8,
                     eos_token_ids=[1])  # fmt: skip


def test_scores_through_the_scheduler_with_chunks_and_a_cached_prefix(
    model_dir: pathlib.Path, reference: torch.Tensor
) -> None:
    """8-token prefill chunks, and the prompt already in the prefix cache: the request that
    asks for prompt logprobs takes no cached page (they have no logits) and scores it all."""
    runner, s = make_runner(model_dir), scheduler()
    s.add(1, list(PROMPT), SamplingParams(temperature=0.0, max_tokens=2))
    plain = drive(s, runner)
    assert plain[0].prompt_logprobs == ()
    s.add(2, list(PROMPT), SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP))
    outs = drive(s, runner)
    assert outs[0].num_cached_tokens == 0
    assert_scores_match(outs[0].prompt_logprobs, reference)
    assert all(o.prompt_logprobs == () for o in outs[1:])
    s.add(3, list(PROMPT), SamplingParams(temperature=0.0, max_tokens=2))
    assert drive(s, runner)[0].num_cached_tokens > 0  # the cache is still used by the others


def test_scores_survive_a_preemption_mid_prefill_without_repeats(
    model_dir: pathlib.Path, reference: torch.Tensor
) -> None:
    """Preempted after its first chunk, a request recomputes from the cached pages it scored
    already, scores the rest once, and sends its prompt logprobs once."""
    runner, s = make_runner(model_dir), scheduler()
    s.add(1, list(PROMPT), SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP))
    batch = s.schedule()
    assert batch is not None and len(batch.works[0].token_ids) == 8
    result = runner.step(list(batch.works))
    s.on_step_done(batch, StepDone(batch.step, (), scored=tuple(x for x in result if isinstance(x, Scored))))
    s.preempt(1)
    outs = drive(s, runner)
    assert s.num_preemptions == 1
    assert_scores_match(outs[0].prompt_logprobs, reference)
    assert len(outs) == 3 and all(o.prompt_logprobs == () for o in outs[1:])


def test_scores_survive_a_preemption_after_the_first_token(
    model_dir: pathlib.Path, reference: torch.Tensor
) -> None:
    """Two requests in a pool too small for both: the later one is preempted while decoding
    and recomputed; each sends its prompt logprobs once, all equal to the full pass."""
    runner, s = make_runner(model_dir, num_pages=14), scheduler(num_pages=14)
    for uid in (1, 2):
        s.add(
            uid,
            list(PROMPT),
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=TOP),
        )
    outs = drive(s, runner)
    assert s.num_preemptions >= 1
    for uid in (1, 2):
        mine = [o for o in outs if o.uid == uid]
        assert len(mine) == 30
        assert_scores_match(mine[0].prompt_logprobs, reference)
        assert all(o.prompt_logprobs == () for o in mine[1:])


def test_a_prompt_that_fills_the_context_is_scored_with_max_tokens_zero(
    model_dir: pathlib.Path, reference: torch.Tensor
) -> None:
    """max_tokens 0 (lm-eval's loglikelihood, its prompt cut to the model's length) needs no room
    past the prompt: a prompt of exactly the context is scored by the real model, where a
    request that generates a token is refused. The one token sampled to end the prefill is the
    scheduler's; the request's stream drops it (tests/engine/test_prompt_only.py)."""
    s = Scheduler(PagePool(7, 4), max_running=4, max_model_len=len(PROMPT), max_prefill_tokens=8,
                  eos_token_ids=[1])  # fmt: skip
    with pytest.raises(ContextLengthExceeded):
        s.add(1, list(PROMPT), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP))
    s.add(2, list(PROMPT), SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=TOP))
    (out,) = drive(s, make_runner(model_dir, num_pages=7))
    assert out.finish_reason == "length"
    assert_scores_match(out.prompt_logprobs, reference)
