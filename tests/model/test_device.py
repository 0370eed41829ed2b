"""Devices: the CUDA path's pieces that run anywhere (here, on the CPU), and the CUDA tests that
run where torch sees a GPU and are skipped otherwise (never faked)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.ranks import resolve_device
from ft.model.attention import SeqSpan, decode_attention
from ft.model.cuda_graphs import DecodeGraphs, GraphedRunner, context_bucket
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.model.test_runner import PROMPT_A, PROMPT_B, make_runner

GREEDY = SamplingParams(temperature=0.0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
PROMPT_C = (7, 7, 7, 3, 1, 2, 30, 31, 32, 33, 34)
DECODE_STEPS = 12  # greedy steps of the CUDA tests: PAGES hold each prompt and them (pages of 4)
PAGES = ((0, 1, 2, 3, 4, 5, 6, 7), (9, 10, 11, 12, 13), (16, 17, 18, 19, 20, 21))


def test_device_names_resolve() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:1")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")


def test_fused_decode_attention_equals_the_explicit_one() -> None:
    """The SDPA call the CUDA path makes computes what the CPU's matmuls do (GQA, masked)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, 16, generator=g)  # [B, kvh, group, hd]
    k = torch.randn(3, 2, 20, 16, generator=g)
    v = torch.randn(3, 2, 20, 16, generator=g)
    lens = torch.tensor([20, 5, 1])
    mask = (torch.arange(20)[None, :] < lens[:, None])[:, None, None, :]
    fused = decode_attention(q, k, v, mask, fused=True)
    explicit = decode_attention(q, k, v, mask, fused=False)
    assert torch.allclose(fused, explicit, atol=1e-5)


def test_context_buckets_are_powers_of_two_in_whole_pages() -> None:
    assert context_bucket(1, 16) == 256 and context_bucket(257, 16) == 512
    assert context_bucket(300, 48) == 528  # 512 rounded up to whole 48-slot pages


def _prefilled(runner: TorchRunner) -> tuple[list[int], list[int]]:
    """Prefill three prompts; their next tokens and positions."""
    works = [
        SeqWork(i, p, 0, PAGES[i], True, GREEDY, 0) for i, p in enumerate((PROMPT_A, PROMPT_B, PROMPT_C))
    ]
    logits = runner.forward(works)
    assert logits is not None
    return [int(t) for t in logits.argmax(-1).tolist()], [len(PROMPT_A), len(PROMPT_B), len(PROMPT_C)]


def test_decode_graph_inputs_compute_the_eager_decode(tiny_dir: pathlib.Path) -> None:
    """The graphs' packed inputs (token, position, page table; padding rows on a scratch page)
    give the eager decode's hidden states at every step the CUDA tests decode: checked here
    eagerly, on the CPU."""
    runner = make_runner(tiny_dir, num_pages=32, page_size=4)
    tokens, positions = _prefilled(runner)
    graphs = DecodeGraphs(runner.model, runner.k_cache, runner.v_cache, page_size=4, scratch_page=31,
                          max_context=256)  # fmt: skip
    for _ in range(1, DECODE_STEPS):
        got = graphs.run_eagerly(tokens, positions, list(PAGES))  # batch bucket 4: one padding row
        spans = [SeqSpan(p, 1, pages) for p, pages in zip(positions, PAGES, strict=True)]
        expected = runner._forward_torch(tokens, positions, spans)
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)
        tokens = runner.model.logits(expected).argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    assert graphs.bucket(300, 10) is None  # more rows than the largest bucket: eager


def _greedy(runner: TorchRunner, steps: int = DECODE_STEPS) -> tuple[list[list[int]], list[torch.Tensor]]:
    tokens, positions = _prefilled(runner)
    outs = [[t] for t in tokens]
    logits: list[torch.Tensor] = []
    for step in range(1, steps):
        works = [
            SeqWork(i, (o[-1],), positions[i] + step - 1, PAGES[i], True, GREEDY, step)
            for i, o in enumerate(outs)
        ]
        step_logits = runner.forward(works)
        assert step_logits is not None
        logits.append(step_logits.float().cpu())
        for o, t in zip(outs, step_logits.argmax(-1).tolist(), strict=True):
            o.append(int(t))
    return outs, logits


@needs_cuda
def test_cuda_graph_decode_equals_eager(tiny_dir: pathlib.Path) -> None:
    loaded = load_model(tiny_dir, torch.float32)
    cuda = torch.device("cuda")

    def runner(graphs: bool) -> TorchRunner:
        return build_runner(
            loaded, num_pages=32, page_size=4, dtype=torch.float32, device=cuda, cuda_graphs=graphs
        )

    graphed = runner(True)
    tokens_g, logits_g = _greedy(graphed)
    tokens_e, logits_e = _greedy(runner(False))
    assert isinstance(graphed, GraphedRunner) and graphed.graphs.num_captured >= 1
    assert tokens_g == tokens_e
    for a, b in zip(logits_g, logits_e, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


@needs_cuda
def test_cuda_logits_and_tokens_match_the_cpu(tiny_dir: pathlib.Path) -> None:
    """float32 on the GPU (SDPA, graphs) against float32 on the CPU (itself within 1e-4 of transformers)."""
    loaded = load_model(tiny_dir, torch.float32)
    gpu = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, device=torch.device("cuda"))
    tokens_gpu, logits_gpu = _greedy(gpu)
    tokens_cpu, logits_cpu = _greedy(make_runner(tiny_dir))
    assert tokens_gpu == tokens_cpu
    assert max((a - b).abs().max().item() for a, b in zip(logits_gpu, logits_cpu, strict=True)) < 1e-3


@needs_cuda
def test_cuda_sampling_stays_on_the_device(tiny_dir: pathlib.Path) -> None:
    """Seeded sampling, penalties, logit bias and logprobs run on CUDA logits like on the CPU's."""
    from ft.model.sampler import sample

    logits = torch.randn(2, 96, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5, logprobs=True, top_logprobs=3,
                            logit_bias={4: 2.0}, frequency_penalty=0.5, repetition_penalty=1.1)  # fmt: skip
    works = [
        SeqWork(i, (1,), 3, (0,), True, params, 2, history=(1, 2, 3, 4), num_prompt_tokens=2)
        for i in range(2)
    ]
    on_cpu = sample(logits, works)
    on_gpu = sample(logits.cuda(), works)
    assert [s.token_id for s in on_gpu] == [s.token_id for s in on_cpu]
    for a, b in zip(on_gpu, on_cpu, strict=True):
        assert a.logprob is not None and b.logprob is not None and abs(a.logprob - b.logprob) < 1e-4


@needs_cuda
async def test_cuda_engine_serves_in_bfloat16_and_frees_everything(tiny_dir: pathlib.Path) -> None:
    import trio

    from ft.engine.engine import open_engine

    config = EngineConfig(model=str(tiny_dir), device="cuda", num_pages=64, tokenizer_workers=1)
    with trio.fail_after(120):
        async with open_engine(config) as engine:
            assert engine.kv_cache_dtype == "bfloat16"  # bfloat16 by default on CUDA
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(
                        engine.generate, "!" * (i + 3), SamplingParams(max_tokens=20, ignore_eos=True)
                    )
            assert engine.core is not None and engine.core.pool.num_used == 0
            assert len(engine.registry) == 0


def test_a_bucket_that_cannot_be_captured_runs_eagerly_from_then_on(tiny_dir: pathlib.Path) -> None:
    """A failed capture (here: no CUDA on this machine; on a GPU, out of memory) is not retried
    every step: `run` says "run it eagerly" for that bucket, at once, from then on."""
    runner = make_runner(tiny_dir, num_pages=32, page_size=4)
    tokens, positions = _prefilled(runner)
    graphs = DecodeGraphs(runner.model, runner.k_cache, runner.v_cache, page_size=4, scratch_page=31,
                          max_context=256)  # fmt: skip
    tries = 0
    capture = graphs._capture

    def counting(batch: int, context: int) -> object:
        nonlocal tries
        tries += 1
        return capture(batch, context)

    graphs._capture = counting  # type: ignore[method-assign,assignment]
    for _ in range(3):
        assert graphs.run(tokens, positions, list(PAGES)) is None
    assert tries == 1 and graphs.num_captured == 0
