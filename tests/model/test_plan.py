"""The execution plan: each choice decided from the model's header alone, each bad combination
refused before a weight is read, and every plan it returns one the loader runs as planned."""

from __future__ import annotations

import itertools
import pathlib
from collections import Counter

import pytest
import torch

from ft.config import KV_CACHE_DTYPES, EngineConfig
from ft.model import kernels
from ft.model.gguf_file import GGUFFile
from ft.model.packed_runner import PackedRunner
from ft.model.plan import ConfigError, ExecutionPlan, ModelHeader, plan, read_header
from ft.model.torch_runner import TorchRunner
from tests.support.gguf_files import TINY_KV_HEADS, write_tiny_gguf
from tests.support.tiny_model import save_hf_dir, tiny_config

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny quantized Llama GGUF (Q4_K, Q6_K, ... layers; heads of 64)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("plan") / "tiny.gguf")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny float32 Llama Hugging Face directory."""
    directory = tmp_path_factory.mktemp("plan") / "tiny"
    save_hf_dir(directory, tiny_config())
    return directory


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything reads a weight (every loader entry point is replaced)."""
    from ft.model import gguf_loader, hf_loader, loader

    def read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loader, "load_model", read)
    monkeypatch.setattr(gguf_loader, "gguf_tensors", read)
    monkeypatch.setattr(hf_loader, "hf_state_dict", read)


@pytest.fixture
def gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan as on a machine where torch sees a CUDA device (planning touches no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def planned(model: pathlib.Path, **options: object) -> ExecutionPlan:
    return plan(EngineConfig(model=str(model), **options), read_header(model))  # type: ignore[arg-type]


# The header.


def test_a_gguf_header_lists_its_weight_types_without_reading_them(gguf: pathlib.Path) -> None:
    header = read_header(gguf)
    table = Counter(t.tensor_type.name for t in GGUFFile(gguf).tensors if len(t.shape) == 2)
    assert header.is_gguf and header.is_quantized and header.weight_types == dict(table)
    assert header.main_type == max(table, key=table.__getitem__)
    assert header.config.num_kv_heads == TINY_KV_HEADS and not header.can_rank


def test_an_hf_header_reads_the_safetensors_dtypes(hf_dir: pathlib.Path) -> None:
    header = read_header(hf_dir)
    assert not header.is_gguf and not header.is_quantized
    assert header.weight_types == {"F32": 2 + 7 * tiny_config().num_layers}  # embed, lm_head, layers


def test_a_gguf_with_garbage_tensor_data_still_plans(gguf: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The plan reads the header only: a file whose whole data region is garbage plans the
    same as the real one."""
    raw = bytearray(gguf.read_bytes())
    start = GGUFFile(gguf).data_start
    raw[start:] = b"\xff" * (len(raw) - start)
    (tmp_path / "garbage.gguf").write_bytes(bytes(raw))
    assert planned(tmp_path / "garbage.gguf", device="cpu") == planned(gguf, device="cpu")
    with pytest.raises(ConfigError, match="--tensor-parallel-size 4"):
        planned(tmp_path / "garbage.gguf", device="cpu", tensor_parallel_size=4)


def test_a_truncated_safetensors_header_is_a_model_file_error(tmp_path: pathlib.Path) -> None:
    from ft.model.gguf_file import ModelFileError

    save_hf_dir(tmp_path / "m", tiny_config())
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ModelFileError, match="too few for a safetensors header"):
        read_header(tmp_path / "m")


# The decisions.


@needs_kernels
def test_a_quantized_gguf_on_the_cpu_runs_packed_with_float16_kv(gguf: pathlib.Path) -> None:
    p = planned(gguf, device="cpu")
    assert (p.packed, p.dtype, p.kv_dtype, p.cuda_graphs) == (True, "float32", "float16", False)
    assert any(r.startswith("packed: a ") and "GGUF on the CPU" in r for r in p.reasons)
    assert p.summary().startswith(f"packed {p.weights} (CPU, threads measured), KV float16")


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"dtype": "float32"}, "--dtype float32 asked for"),
        ({"quantize": "int8"}, "--quantize int8 asked for"),
        ({"tensor_parallel_size": 2}, "dequantized for tensor parallelism"),
    ],
)
def test_a_quantized_gguf_is_dequantized_when_an_option_says_so(
    gguf: pathlib.Path, options: dict[str, object], why: str
) -> None:
    p = planned(gguf, device="cpu", **options)
    assert not p.packed and any(why in r for r in p.reasons)


def test_ranks_on_the_cpu_share_its_cores_and_agree_on_a_dtype(
    gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    p = planned(gguf, device="cpu", tensor_parallel_size=2)
    assert (p.dtype, p.threads, p.tensor_parallel_size) == ("float32", 4, 2)
    assert planned(gguf, device="cpu", tensor_parallel_size=2, compute_threads=3).threads == 3


def test_a_float_model_on_the_cpu_measures_its_dtype_at_load(hf_dir: pathlib.Path) -> None:
    p = planned(hf_dir, device="cpu")
    assert (p.packed, p.dtype, p.kv_dtype) == (False, "auto", "auto")
    assert "dtype auto: float32 or bfloat16, measured at load" in p.reasons
    assert planned(hf_dir, device="cpu", dtype="bfloat16").dtype == "bfloat16"


@pytest.mark.usefixtures("gpu_machine")
def test_on_cuda_a_quantized_gguf_runs_bfloat16_with_graphs(gguf: pathlib.Path) -> None:
    p = planned(gguf)
    assert (p.device, p.packed, p.dtype, p.cuda_graphs) == ("cuda", False, "bfloat16", True)
    assert "float: the packed kernels run on the CPU; dequantized for cuda" in p.reasons
    assert not planned(gguf, cuda_graphs=False).cuda_graphs
    ranked = planned(gguf, tensor_parallel_size=2)
    assert not ranked.cuda_graphs and any(r.startswith("eager: tensor-parallel") for r in ranked.reasons)


@pytest.mark.usefixtures("gpu_machine")
def test_auto_device_with_int8_stays_on_the_cpu(hf_dir: pathlib.Path) -> None:
    p = planned(hf_dir, quantize="int8")
    assert (p.device, p.dtype, p.quantize) == ("cpu", "float32", "int8")
    assert "device cpu: --quantize int8 runs on the CPU" in p.reasons


def test_pooling_comes_from_the_file_else_last(tmp_path: pathlib.Path, gguf: pathlib.Path) -> None:
    mean = write_tiny_gguf(tmp_path / "mean.gguf", pooling_type=1)
    assert planned(mean, device="cpu").pooling == "mean"
    assert planned(gguf, device="cpu").pooling == "last"
    assert planned(mean, device="cpu", pooling="cls").pooling == "cls"


@needs_kernels
@pytest.mark.usefixtures("no_weights")
def test_the_draft_model_is_planned_with_the_target(gguf: pathlib.Path, hf_dir: pathlib.Path) -> None:
    """Its side of the plan (packed or float, dtype, KV), read from its header, shown in the summary."""
    from dataclasses import asdict

    draft = {"speculative_method": "draft", "speculative_model": str(gguf)}
    p = planned(gguf, device="cpu", **draft)
    assert p.draft is not None
    assert (p.draft.packed, p.draft.dtype, p.draft.kv_dtype) == (True, "float32", "float16")
    assert p.summary().endswith(f"speculative draft (packed {p.draft.weights}, KV float16), pooling last")
    assert asdict(p)["draft"]["packed"] is True  # as `/v1/stats` shows `model.plan`
    floats = planned(gguf, device="cpu", speculative_method="draft", speculative_model=str(hf_dir)).draft
    assert floats is not None and (floats.packed, floats.dtype, floats.kv_dtype) == (
        False,
        "float32",
        "float32",
    )
    assert planned(gguf, device="cpu").draft is None


@pytest.mark.usefixtures("no_weights", "gpu_machine")
def test_on_cuda_the_draft_model_runs_as_bfloat16_floats(gguf: pathlib.Path) -> None:
    p = planned(gguf, speculative_method="draft", speculative_model=str(gguf))
    assert p.draft is not None and (p.draft.packed, p.draft.dtype, p.draft.kv_dtype) == (
        False,
        "bfloat16",
        "bfloat16",
    )
    assert "draft float: the packed kernels run on the CPU; dequantized for cuda" in p.draft.reasons


# The refusals: each before a weight is read (`no_weights`), through the real load path.


def _refused(model: pathlib.Path, match: str, **options: object) -> None:
    from ft.engine.loading import load_torch_model

    with pytest.raises(ConfigError, match=match):
        load_torch_model(EngineConfig(model=str(model), **options))  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_weights", "gpu_machine")
def test_int8_on_cuda_is_refused_before_loading(hf_dir: pathlib.Path) -> None:
    _refused(
        hf_dir,
        "--quantize int8 runs on the CPU; it cannot be combined with --device cuda",
        quantize="int8",
        device="cuda",
    )


@pytest.mark.usefixtures("no_weights")
def test_cuda_without_a_gpu_is_refused_before_loading(
    hf_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(hf_dir, "--device cuda:1 was asked for, but torch sees no CUDA device", device="cuda:1")


@pytest.mark.usefixtures("no_weights")
def test_q8_0_kv_off_the_packed_path_is_refused_before_loading(hf_dir: pathlib.Path) -> None:
    _refused(hf_dir, "packed CPU path.*not a quantized GGUF", kv_cache_dtype="q8_0", device="cpu")


@pytest.mark.usefixtures("no_weights", "gpu_machine")
def test_q8_0_kv_on_cuda_is_refused_before_loading(gguf: pathlib.Path) -> None:
    _refused(gguf, "packed CPU path.*not on the CPU in one process \\(cuda, 1 rank", kv_cache_dtype="q8_0")


@pytest.mark.usefixtures("no_weights")
def test_more_ranks_than_kv_heads_is_refused_before_any_rank_starts(gguf: pathlib.Path) -> None:
    _refused(
        gguf,
        f"--tensor-parallel-size 4: .*more than the model's {TINY_KV_HEADS} kv heads",
        tensor_parallel_size=4,
        dtype="float32",
        device="cpu",
    )


@pytest.mark.usefixtures("no_weights")
def test_rank_pooling_without_a_classifier_is_refused_before_loading(hf_dir: pathlib.Path) -> None:
    _refused(hf_dir, "--pooling rank needs a reranker", pooling="rank", device="cpu")


@pytest.mark.usefixtures("no_weights")
def test_a_context_past_the_models_is_refused_before_loading(hf_dir: pathlib.Path) -> None:
    _refused(hf_dir, "--max-model-len 4096 exceeds the model's context 256", max_model_len=4096, device="cpu")


# The property: whatever the plan accepts, the loader and runner run as planned.

GRID = list(itertools.product(("auto", "float32", "bfloat16"), (None, "int8"), KV_CACHE_DTYPES))


@pytest.mark.parametrize("model", ["gguf", "hf"])
def test_every_plan_is_one_the_loader_runs(
    model: str, gguf: pathlib.Path, hf_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over dtype x quantize x KV dtype on the CPU: each combination the config accepts is
    either refused by the plan or loads and builds a runner with exactly the planned choices."""
    from ft.engine.loading import load_torch_model

    path = gguf if model == "gguf" else hf_dir
    header: ModelHeader = read_header(path)
    ran = 0
    for dtype, quantize, kv in GRID:
        try:
            config = EngineConfig(
                model=str(path), dtype=dtype, quantize=quantize, kv_cache_dtype=kv, device="cpu"
            )
        except ValueError:
            continue  # refused by the config alone (int8 with bfloat16, q8_0 with a float dtype)
        try:
            p = plan(config, header)
        except ConfigError:
            assert kv == "q8_0" and model == "hf"
            continue
        caplog.clear()
        with caplog.at_level("INFO", logger="ft.engine"):
            runner = load_torch_model(config).make_runner(4, 16)
        assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"] == [f"plan: {p.summary()}"]
        assert isinstance(runner, TorchRunner)
        assert isinstance(runner, PackedRunner) == p.packed
        if p.dtype != "auto":
            assert runner.dtype == getattr(torch, p.dtype)
        expected_kv = runner.dtype if p.kv_dtype == "auto" else p.kv_dtype
        assert str(runner.kv_dtype).removeprefix("torch.") == str(expected_kv).removeprefix("torch.")
        ran += 1
    assert ran >= 10


def test_a_reranker_gguf_plans_rank_pooling(tmp_path: pathlib.Path) -> None:
    from tests.support.tiny_rerank import causal_model, write_rank_gguf

    path = write_rank_gguf(tmp_path / "rank.gguf", causal_model())
    assert read_header(path).can_rank
    assert planned(path, device="cpu", pooling="rank").pooling == "rank"
    assert planned(path, device="cpu").pooling == "rank"


async def test_the_engine_shows_its_plan_in_stats(gguf: pathlib.Path) -> None:
    """`/v1/stats`'s body (`as_json`) carries the plan the model was loaded with."""
    import trio

    from ft.engine.engine import open_engine

    config = EngineConfig(model=str(gguf), device="cpu", num_pages=16, compute_threads=1)
    with trio.fail_after(120):
        async with open_engine(config) as engine:
            body = engine.snapshot().as_json()
    assert body["model"]["plan"] == {
        **body["model"]["plan"],
        "device": "cpu",
        "packed": kernels.available(),
        "tensor_parallel_size": 1,
    }
    assert isinstance(body["model"]["plan"]["reasons"], tuple | list) and body["model"]["plan"]["reasons"]


def test_a_family_the_kernels_do_not_run_loads_as_floats(
    gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The architecture entry's `packed` flag is what the plan reads: off, a quantized GGUF of
    the family is dequantized, and q8_0 KV is refused naming the family."""
    import dataclasses

    from ft.model.architectures import LLAMA

    monkeypatch.setattr(
        ModelHeader, "family", property(lambda self: dataclasses.replace(LLAMA, packed=False))
    )
    p = planned(gguf, device="cpu")
    assert not p.packed and "float: the packed kernels do not run llama; dequantized" in p.reasons
    with pytest.raises(ConfigError, match="packed CPU path.*do not run llama"):
        planned(gguf, device="cpu", kv_cache_dtype="q8_0")


def test_without_the_kernels_a_quantized_gguf_loads_as_floats(
    gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "build_error", lambda: "no compiler")
    p = planned(gguf, device="cpu")
    assert not p.packed and p.dtype == "auto"
    assert "float: the packed kernels cannot be built here (no compiler)" in p.reasons
    with pytest.raises(ConfigError, match="packed CPU path.*cannot be built here \\(no compiler\\)"):
        planned(gguf, device="cpu", kv_cache_dtype="q8_0")


@pytest.mark.usefixtures("no_weights")
def test_a_draft_model_with_another_tokenizer_is_refused_before_loading(
    gguf: pathlib.Path, hf_dir: pathlib.Path
) -> None:
    _refused(
        gguf,
        "the draft model's tokenizer is not the target's",
        speculative_method="draft",
        speculative_model=str(hf_dir),
        device="cpu",
    )
