"""Pooled embeddings agree with transformers: the same pooling over its last hidden state (after
the final norm), for prompts fed through the real scheduler in chunks.

Float path (a random Hugging Face checkpoint built here, Llama- and Qwen2-style; the default
model dequantized): agreement within float32 summation order (max |diff| < 1e-5 and 1e-4 on
unit vectors). Packed GGUF path (int8
activations per block of 32, as llama.cpp does): cosine similarity > 0.99 with transformers'
dequantized float model, on a tiny random GGUF and, when cached, on the default model.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from ft.config import resolve_pooling
from ft.core.batch import EmbeddingOut, PoolSum, Sampled, StepDone
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.model import kernels
from ft.model.loader import load_model
from ft.model.packed_runner import PackedRunner
from ft.model.pull import cached_model_path
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.gguf_files import write_tiny_gguf
from tests.support.tiny_model import save_hf_dir, tiny_config

transformers = pytest.importorskip("transformers")

POOLINGS = ("mean", "cls", "last")
PROMPTS = [
    [5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30] * 3,  # 57: four chunks
    [44, 11, 90, 3, 3, 27],
    [9],
]
FLOAT_TOLERANCE = 1e-4  # the default model (measured 1.9e-7..1.1e-6)
TINY_FLOAT_TOLERANCE = 1e-5  # measured 1.0e-7..2.6e-7
PACKED_MIN_COSINE = 0.99


def unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def ft_pooled(
    runner: TorchRunner, prompts: list[list[int]], pooling: str, **sched: int
) -> list[torch.Tensor]:
    """Each prompt pooled by the real scheduler and runner (all batched, prefill in chunks)."""
    opts = {"max_running": 8, "max_model_len": 512, "max_prefill_tokens": 16} | sched
    s = Scheduler(PagePool(runner.num_pages, runner.page_size), eos_token_ids=[], **opts)
    return [unit(torch.tensor(o.vector, dtype=torch.float64)) for o in pool_on(s, runner, prompts, pooling)]


def pool_on(s: Scheduler, runner: TorchRunner, prompts: list[list[int]], pooling: str) -> list[EmbeddingOut]:
    """Each prompt pooled on scheduler `s` (its prefix cache kept between calls), in order."""
    for uid, prompt in enumerate(prompts):
        s.add(uid, prompt, SamplingParams(pooling=pooling))
    outs: dict[int, EmbeddingOut] = {}
    while s.has_work:
        batch = s.schedule()
        assert batch is not None
        results = runner.step(list(batch.works))
        assert not any(isinstance(x, Sampled) for x in results)
        done = StepDone(batch.step, (), pooled=tuple(x for x in results if isinstance(x, PoolSum)))
        for out in s.on_step_done(batch, done):
            assert isinstance(out, EmbeddingOut)
            outs[out.uid] = out
    return [outs[uid] for uid in range(len(prompts))]


def hf_pooled(model: object, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    """The same pooling over transformers' last hidden state (the decoder after its final norm)."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].double()  # type: ignore[attr-defined]
            pooled = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
            out.append(unit(pooled))
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_float_path_pools_as_transformers(tmp_path: pathlib.Path, model_type: str, pooling: str) -> None:
    overrides = {"attention_bias": True} if model_type == "qwen2" else {}
    save_hf_dir(tmp_path / "m", tiny_config(**overrides), model_type)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    runner = build_runner(
        load_model(tmp_path / "m", torch.float32), num_pages=64, page_size=4, dtype=torch.float32
    )
    ours, theirs = ft_pooled(runner, PROMPTS, pooling), hf_pooled(hf, PROMPTS, pooling)
    for a, b in zip(ours, theirs, strict=True):
        assert (a - b).abs().max().item() < TINY_FLOAT_TOLERANCE


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def packed_runner(path: pathlib.Path, num_pages: int = 64) -> TorchRunner:
    runner = build_runner(load_model(path, torch.float32, quantized=True), num_pages=num_pages, page_size=16,
                         dtype=torch.float32)  # fmt: skip
    assert runner.packed is not None
    return runner


@needs_kernels
@pytest.mark.parametrize("pooling", POOLINGS)
def test_packed_path_pools_as_transformers(tiny_gguf: pathlib.Path, pooling: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    ours, theirs = ft_pooled(packed_runner(tiny_gguf), PROMPTS, pooling), hf_pooled(hf, PROMPTS, pooling)
    for a, b in zip(ours, theirs, strict=True):
        assert float(a @ b) > PACKED_MIN_COSINE


@needs_kernels
def test_packed_rows_do_not_depend_on_chunking_batching_or_the_cache(tiny_gguf: pathlib.Path) -> None:
    """Alone, batched, in other chunks, or from a cached prefix (last pooling): the same vector."""
    runner = packed_runner(tiny_gguf)
    alone = [ft_pooled(runner, [p], "last", max_prefill_tokens=512)[0] for p in PROMPTS]
    batched = ft_pooled(runner, PROMPTS, "last", max_prefill_tokens=16)
    for a, b in zip(alone, batched, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for pooling in ("mean", "cls"):
        one = [ft_pooled(runner, [p], pooling, max_prefill_tokens=512)[0] for p in PROMPTS]
        many = ft_pooled(runner, PROMPTS, pooling, max_prefill_tokens=16)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one, many, strict=True))
    # From the cache: a second pass on the same scheduler starts from the first's pages (each
    # ft_pooled call has a fresh pool, so nothing above is a hit).
    s = Scheduler(PagePool(runner.num_pages, runner.page_size), max_running=8, max_model_len=512,
                  max_prefill_tokens=16, eos_token_ids=[])  # fmt: skip
    pool_on(s, runner, PROMPTS, "last")
    again = pool_on(s, runner, PROMPTS, "last")
    assert again[0].num_cached_tokens == 48  # the 57-token prompt's three full pages of 16
    for a, out in zip(alone, again, strict=True):
        assert torch.allclose(a, unit(torch.tensor(out.vector, dtype=torch.float64)), atol=1e-6)


@pytest.fixture(scope="module")
def default_hf() -> tuple[pathlib.Path, object]:
    path = cached_model_path()
    if not path.is_file():
        pytest.skip("the default model is not cached (ft pull)")
    torch.set_num_threads(1)  # a shared 2-core machine: see test_agreement
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return path, hf


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("quantized", [True, False], ids=["packed", "float"])
def test_default_model_pools_as_transformers(
    default_hf: tuple[pathlib.Path, object], quantized: bool
) -> None:
    """The default model (SmolLM2-135M-Instruct Q4_1), packed or dequantized to float32.

    Measured 2026-12-01 (AVX2): packed cosine 0.99969..0.99990 over mean/cls/last; float max
    |diff| 1.9e-7..1.1e-6 on the unit vectors.
    """
    path, hf = default_hf
    loaded = load_model(path, torch.float32, quantized=quantized)
    tok = loaded.tokenizer.build()
    texts = ["The capital of France is Paris.", "def f(x):\n    return x**2", "naïve café 東京 🚀"]
    prompts = [tok.encode(t).ids for t in texts]
    runner = build_runner(loaded, num_pages=64, page_size=16, dtype=torch.float32)
    assert isinstance(runner, PackedRunner) == quantized
    for pooling in POOLINGS:
        ours, theirs = ft_pooled(runner, prompts, pooling), hf_pooled(hf, prompts, pooling)
        if quantized:
            cosines = [float(a @ b) for a, b in zip(ours, theirs, strict=True)]
            assert min(cosines) > PACKED_MIN_COSINE, (pooling, cosines)
        else:
            diff = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
            assert diff < FLOAT_TOLERANCE, (pooling, diff)


@pytest.mark.parametrize(("pooling_type", "expected"), [(None, None), (0, None), (1, "mean"), (2, "cls"),
                                                         (3, "last")])  # fmt: skip
def test_the_gguf_pooling_type_is_read(
    tmp_path: pathlib.Path, pooling_type: int | None, expected: str | None
) -> None:
    path = write_tiny_gguf(tmp_path / "p.gguf", pooling_type=pooling_type)
    assert load_model(path, torch.float32, quantized=True).config.pooling == expected


def test_the_configured_pooling_wins_then_the_file_then_last() -> None:
    assert resolve_pooling("auto", None) == "last"
    assert resolve_pooling("auto", "mean") == "mean"
    assert resolve_pooling("cls", "mean") == "cls"
