"""The q8_0 KV cache of the packed path: the KV write quantizes each block of 32, attention reads
the blocks in place as exactly their dequantized values, a decoder over q8_0 stays close to one
over float16, rows stay independent of their batch, pages follow the bytes, and the float path
refuses it before loading."""

from __future__ import annotations

import math
import pathlib
import re

import pytest
import torch

from ft.config import Q8_0_KV_PATH, EngineConfig
from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.loader import LoadedModel, load_model
from ft.model.quant import QuantTensor, to_q8_0
from ft.model.quantized_llama import QuantizedLlama, StepIndex
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.gguf_files import TINY_HEAD_DIM, U32, RawGGUF, scalar, write_tiny_gguf
from tests.support.tiny_model import random_hf_state_dict, tiny_config

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")

Q8 = kernels.Q8_0_KV


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """A reference q8_0 encoding of float32 `[..., n * 32]` → uint8 `[..., n * 34]`."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)  # [..., n, 32]
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()  # [..., n, 1]
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d.float()))
    qs = (blocks * inv).round().clamp(-127, 127).to(torch.int8)
    raw = torch.cat([d.view(torch.uint8), qs.view(torch.uint8)], dim=-1)  # [..., n, 34]
    return raw.flatten(-2).contiguous()


def paged(lengths: tuple[int, ...], page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scattered page tables for sequences of `lengths`, their seq and last positions."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(lengths) // page + 1
    tables = torch.randperm(per_seq * len(lengths), generator=g).view(len(lengths), per_seq).to(torch.int32)
    return tables, torch.arange(len(lengths)), torch.tensor([n - 1 for n in lengths])


@pytest.mark.parametrize(("hd", "lengths"), [(32, (1, 9)), (64, (7, 8, 33, 100)), (288, (5, 17))])
def test_attention_reads_q8_0_blocks_as_their_dequantized_values(hd: int, lengths: tuple[int, ...]) -> None:
    """Attention over q8_0 caches is the attention over the float32 caches they dequantize to
    (the blocks are read in place, element for element), and close to torch's softmax attention
    over those values; heads of 288 take the unblocked loop."""
    torch.manual_seed(hd)
    nh, nkvh, page = 6, 2, 4
    tables, seq, pos = paged(lengths, page, hd)
    num_slots = tables.numel() * page
    k_q8 = quantize_q8_0(torch.randn(num_slots, nkvh, hd) * 3)
    v_q8 = quantize_q8_0(torch.randn(num_slots, nkvh, hd))
    k, v = kernels.dequantize_q8_0_kv(k_q8), kernels.dequantize_q8_0_kv(v_q8)  # [slots, nkvh, hd]
    q = torch.randn(len(lengths), nh * hd)
    out = kernels.attention(q, k_q8, v_q8, seq, pos, tables, page, nh)
    assert torch.equal(out, kernels.attention(q, k, v, seq, pos, tables, page, nh))
    for i, n in enumerate(lengths):
        slots = torch.tensor([int(tables[i, p // page]) * page + p % page for p in range(n)])
        ks = k[slots].repeat_interleave(nh // nkvh, dim=1).transpose(0, 1)  # [nh, n, hd]
        vs = v[slots].repeat_interleave(nh // nkvh, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[i].view(nh, 1, hd), ks, vs)
        assert torch.allclose(out[i].view(nh, 1, hd), ref, atol=3e-5, rtol=1e-4)


def test_portable_build_reads_q8_0_blocks_too() -> None:
    """The plain C++ build (no AVX2) gives the same attention over q8_0 within float rounding."""
    portable = kernels.build_library("x86-64")
    torch.manual_seed(1)
    nh, nkvh, hd, page, lengths = 4, 2, 64, 4, (3, 20)
    tables, seq, pos = paged(lengths, page, 1)
    k_q8 = quantize_q8_0(torch.randn(tables.numel() * page, nkvh, hd))
    v_q8 = quantize_q8_0(torch.randn(tables.numel() * page, nkvh, hd))
    q = torch.randn(len(lengths), nh * hd)
    native = kernels.attention(q, k_q8, v_q8, seq, pos, tables, page, nh)
    out = torch.empty_like(q)
    kernels.check(portable, portable.ft_attention(
        q.data_ptr(), q.shape[0], k_q8.data_ptr(), v_q8.data_ptr(), k_q8.shape[0], k_q8[0].numel(),
        seq.data_ptr(), tables.shape[0], pos.data_ptr(), tables.data_ptr(), tables.shape[1], page, nh, nkvh,
        hd, out.data_ptr(), kernels.Q8_0_KV_CODE,
    ))  # fmt: skip
    assert torch.allclose(out, native, atol=1e-5, rtol=1e-4)


def test_attention_refuses_q8_0_slots_of_the_wrong_size() -> None:
    """A q8_0 cache whose slots are not whole blocks of the heads is refused, not read past."""
    q = torch.randn(1, 64)
    cache = torch.zeros(8, 1, 33, dtype=torch.uint8)  # 33 bytes: not a block
    with pytest.raises(kernels.KernelError):
        kernels.attention(
            q, cache, cache, torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32), 8, 1
        )


@pytest.fixture
def tiny_packed32() -> tuple:
    """A tiny packed model with heads of 32 (q8_0 blocks), its float weights and config."""
    config = tiny_config(hidden_size=128, intermediate_size=128, vocab_size=64)
    assert config.head_dim == 32
    sd = random_hf_state_dict(config)
    packed = {k: kernels.repacked(to_q8_0(v.numpy())) if v.dim() == 2 else v for k, v in sd.items()}
    return config, packed


def index_of(step: list[tuple[tuple[int, ...], int, tuple[int, ...]]], page: int) -> StepIndex:
    """The packed decoder's index arrays for `(tokens, start, pages)` entries."""
    slots = [p[q // page] * page + q % page for t, s, p in step for q in range(s, s + len(t))]
    width = max(len(p) for _, _, p in step)
    return StepIndex(
        slot_of=torch.tensor(slots),
        seq=torch.tensor([i for i, (t, _, _) in enumerate(step) for _ in t]),
        positions=torch.tensor([s + i for t, s, _ in step for i in range(len(t))]),
        block_tables=torch.tensor([list(p) + [0] * (width - len(p)) for _, _, p in step], dtype=torch.int32),
    )


def caches(config: object, kv_dtype: kernels.KVDtype, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = config
    last, storage = kernels.kv_cache_layout(kv_dtype, c.head_dim)  # type: ignore[attr-defined]
    shape = (c.num_layers, slots, c.num_kv_heads, last)  # type: ignore[attr-defined]
    return torch.zeros(shape, dtype=storage), torch.zeros(shape, dtype=storage)


def test_kv_write_quantizes_each_block_of_32(tiny_packed32: tuple) -> None:
    """The layer's KV write stores, per block of 32, d = max|x| / 127 as a half and
    round(x / d): each element within half a step of the float32 value; untouched slots stay 0."""
    config, sd = tiny_packed32
    model, page = QuantizedLlama(config, sd), 4
    step = [((5, 7, 9, 11, 13, 15), 0, (0, 1)), ((2, 4, 6), 0, (3,))]
    ids = torch.tensor([t for toks, _, _ in step for t in toks])
    exact, q8 = caches(config, torch.float32, 32), caches(config, Q8, 32)
    with torch.inference_mode():
        model.forward(ids, index_of(step, page), *exact, page)
        model.forward(ids, index_of(step, page), *q8, page)
    written = index_of(step, page).slot_of
    for ref, got in zip(exact, q8, strict=True):
        # Layer 0's keys and values do not depend on the cache (written before its attention).
        x = ref[0, written]  # [T, kvh, hd]
        raw = got[0, written].view(*x.shape[:-1], -1, 34)  # [T, kvh, blocks, 34]
        d = raw[..., :2].contiguous().view(torch.float16).float()
        qs = raw[..., 2:].contiguous().view(torch.int8).float()
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        assert torch.allclose(d, (blocks.abs().amax(-1, keepdim=True) / 127).half().float(), rtol=1e-3)
        assert (qs.abs() <= 127).all() and (qs - blocks / d).abs().max() <= 0.5 + 1e-3
        assert (kernels.dequantize_q8_0_kv(got[0, written]) - x).abs().max() <= d.max() / 2 * 1.01
        unused = torch.ones(got.shape[1], dtype=torch.bool)
        unused[written] = False
        assert not got[:, unused].any()


def test_decoder_over_q8_0_kv_moves_hidden_states_about_as_much_as_bfloat16(tiny_packed32: tuple) -> None:
    """Prefill chunks on cached positions and decode rows over q8_0 KV stay close to the same
    decoder over float32 KV: about as close as over bfloat16 KV (this random model amplifies any
    KV rounding: float16 KV alone moves it by ~2%)."""
    config, sd = tiny_packed32
    model, page = QuantizedLlama(config, sd), 4
    steps = [
        [((5, 7, 9, 11, 13, 15), 0, (0, 1)), ((2, 4, 6), 0, (2, 3, 4))],
        [((17,), 6, (0, 1)), ((8, 10, 12, 14, 16), 3, (2, 3, 4))],
    ]
    kinds: list[kernels.KVDtype] = [torch.float32, torch.float16, torch.bfloat16, Q8]
    all_caches = [caches(config, kind, 32 * page) for kind in kinds]
    for step in steps:
        ids = torch.tensor([t for toks, _, _ in step for t in toks])
        with torch.inference_mode():
            exact, *outs = [model.forward(ids, index_of(step, page), *c, page) for c in all_caches]
        f16, bf16, q8 = [((out - exact).norm() / exact.norm()).item() for out in outs]
        assert q8 < 1.5 * bf16 + 1e-3 and q8 < 0.06, (f16, bf16, q8)
        assert ((outs[2] - outs[0]).norm() / outs[0].norm()).item() < 0.06  # q8_0 against float16


def test_q8_0_rows_do_not_depend_on_the_batch(tiny_packed32: tuple, tiny_dir: pathlib.Path) -> None:
    """Over q8_0 KV a request's logits are bitwise the same alone, in a mixed batch and with its
    prompt cut into chunks (prefix hits, chunked prefill, recompute all rely on it)."""
    config, sd = tiny_packed32
    spec = load_model(tiny_dir, torch.float32).tokenizer
    loaded = LoadedModel(config, sd, spec, "tiny-packed", torch.float32)
    greedy = SamplingParams(temperature=0.0)
    prompt = (13, 14, 15, 16, 17, 18, 19, 20, 21, 22)

    def work(seq: int, tokens: tuple[int, ...], start: int, pages: tuple[int, ...]) -> SeqWork:
        return SeqWork(seq, tokens, start, pages, True, greedy, 0)

    def fresh() -> TorchRunner:
        runner = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, kv_dtype=Q8)
        runner.forward([work(1, (3, 4, 5, 6, 7), 0, (0, 1))])
        return runner

    a = work(1, (11,), 5, (0, 1))
    whole = work(3, prompt, 0, (3, 4, 5))
    alone = [fresh().forward([w]) for w in (a, whole)]
    mixed = fresh().forward([a, whole])
    assert mixed is not None
    for row, single in zip(mixed, alone, strict=True):
        assert single is not None and torch.equal(row, single[0])
    for cut in (1, 8, 9):  # the first `cut` prompt tokens in an earlier step
        runner = fresh()
        runner.forward([work(3, prompt[:cut], 0, (3, 4, 5))])
        tail = runner.forward([a, work(3, prompt[cut:], cut, (3, 4, 5))])
        assert tail is not None and torch.equal(tail[1], mixed[1])


def test_a_page_of_q8_0_holds_the_bytes_of_its_blocks() -> None:
    """Pages are sized by the real bytes per slot: 34 per 32 elements, so a budget holds 64/34
    (1.88x) the float16 pages at any head size that is a multiple of 32."""
    for hd in (32, 64, 128):
        c = tiny_config(hidden_size=4 * hd, num_heads=4, num_kv_heads=2)
        f16 = TorchRunner.bytes_per_page(c, 16, torch.float16)
        q8 = TorchRunner.bytes_per_page(c, 16, Q8)
        assert q8 == 2 * c.num_layers * 16 * c.num_kv_heads * hd // 32 * 34
        budget = 1 << 30
        assert 1.87 < (budget // q8) / (budget // f16) < 1.89


def test_q8_0_refuses_heads_that_are_not_whole_blocks() -> None:
    """Heads of 16 (not a multiple of 32) are refused with the size named."""
    with pytest.raises(ValueError, match="heads of 16 are not a multiple of 32"):
        TorchRunner.bytes_per_page(tiny_config(hidden_size=64), 16, Q8)


@pytest.mark.parametrize(
    "fields",
    [{"dtype": "float32"}, {"quantize": "int8"}, {"device": "cuda"}, {"tensor_parallel_size": 2}],
)
def test_config_refuses_q8_0_off_the_packed_path(fields: dict[str, object]) -> None:
    """q8_0 KV with float weights, int8 weights, CUDA or ranks is refused as the config is made."""
    with pytest.raises(ValueError, match="packed CPU path"):
        EngineConfig(kv_cache_dtype="q8_0", **fields)  # type: ignore[arg-type]


def test_float_weights_refuse_q8_0_before_loading(
    tiny_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hugging Face model (float weights) with q8_0 KV is refused before a weight is read,
    with a message naming the packed path; a float runner refuses it too."""
    from ft.engine import loading
    from ft.model import loader

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded")

    loaded = load_model(tiny_dir, torch.float32)
    monkeypatch.setattr(loader, "load_model", no_load)
    with pytest.raises(ValueError, match="packed CPU path.*not a quantized GGUF"):
        loading.load_torch_model(EngineConfig(model=str(tiny_dir), kv_cache_dtype="q8_0", device="cpu"))
    with pytest.raises(ValueError, match=Q8_0_KV_PATH[:40]):
        build_runner(loaded, num_pages=4, page_size=4, dtype=torch.float32, kv_dtype=Q8)


def test_a_quantized_gguf_loads_with_q8_0_kv(tmp_path: pathlib.Path) -> None:
    """A quantized GGUF (heads of 64) loads packed with q8_0 KV: its runner's caches are q8_0
    blocks and its pages are counted in their bytes."""
    from ft.engine import loading

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    parts = loading.load_torch_model(EngineConfig(model=str(path), kv_cache_dtype="q8_0", device="cpu"))
    runner = parts.make_runner(4, 16)
    assert isinstance(runner, TorchRunner) and runner.packed is not None and runner.kv_dtype == Q8
    assert runner.k_cache.dtype == torch.uint8 and runner.k_cache.shape[-1] == TINY_HEAD_DIM // 32 * 34
    assert parts.bytes_per_page(16) == 2 * runner.k_cache[:, :16].numel()


@pytest.mark.parametrize("where", ["cuda", "heads of 16"])
def test_q8_0_is_refused_before_loading_a_gguf_it_cannot_run(
    where: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quantized GGUF that would run on a GPU, or whose heads are not whole blocks (its header
    says 16: its tensors are never read, so they need not agree), is refused before loading."""
    from ft.engine import loading
    from ft.model import loader

    raw = RawGGUF.read(write_tiny_gguf(tmp_path / "tiny.gguf"))
    if where == "cuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine's plan
        expected = "packed CPU path.*not on the CPU"
    else:
        raw = raw.set("llama.attention.head_count", U32, scalar(U32, 16))
        raw = raw.set("llama.rope.dimension_count", U32, scalar(U32, 16))
        expected = "heads of 16 are not a multiple of 32"
    raw.write(tmp_path / "edited.gguf")

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loader, "load_model", no_load)
    with pytest.raises(ValueError, match=expected):
        loading.load_torch_model(EngineConfig(model=str(tmp_path / "edited.gguf"), kv_cache_dtype="q8_0"))


@pytest.mark.parametrize("march", ["native", "x86-64"])
def test_non_finite_keys_and_values_are_stored_as_defined_blocks(tiny_packed32: tuple, march: str) -> None:
    """A NaN, +Inf or -Inf key or value (through the q|k|v bias) is written as a defined block,
    never a float-to-int cast out of range: NaN stores 0 and leaves its block's scale to the
    finite values, an infinity saturates the scale at the largest half and itself at +-127."""
    config, sd = tiny_packed32
    if march != "native":  # rows as GGUF stores them: the portable build multiplies no groups
        sd = {k: to_q8_0(v.dequantize().numpy()) if isinstance(v, QuantTensor) else v for k, v in sd.items()}
    model, page = QuantizedLlama(config, sd), 4
    model.lib = kernels.build_library(march) if march != "native" else kernels.library()
    qsz, kvsz = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    bias = torch.zeros(qsz + 2 * kvsz)
    for at, value in ((3, math.nan), (32 + 8, math.inf), (32 + 20, -math.inf)):
        bias[qsz + at] = bias[qsz + kvsz + at] = value  # keys (then rotated) and values
    model.layers[0].keep.append(bias)
    model.layers[0].args.bias, model.layers[0].args.bias_len = bias.data_ptr(), bias.numel()
    step = [((5, 7, 9), 0, (0,))]
    k, v = caches(config, Q8, 8)
    with torch.inference_mode():
        model.forward(torch.tensor([5, 7, 9]), index_of(step, page), k, v, page)
    for cache in (k, v):
        raw = cache[0, :3].reshape(3, -1, 34)  # [rows, blocks, 34]
        d = raw[..., :2].contiguous().view(torch.float16).float()
        qs = raw[..., 2:].contiguous().view(torch.int8)
        assert torch.isfinite(d).all() and (d > 0).all() and (qs.abs() <= 127).all()
    # Values are not rotated: the NaN's block keeps its finite scale, the infinities' saturates.
    raw = v[0, :3].reshape(3, -1, 34)
    d = raw[..., :2].contiguous().view(torch.float16).float()
    qs = raw[..., 2:].contiguous().view(torch.int8)
    assert (qs[:, 0, 3] == 0).all() and (d[:, 0] < 1).all() and (qs[:, 0].abs().amax(-1) == 127).all()
    assert (d[:, 1] == 65504).all() and (qs[:, 1, 8] == 127).all() and (qs[:, 1, 20] == -127).all()
    assert (qs[:, 1].abs() <= 1).sum() == 3 * 30


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("norm1", None, "norms of"),
        ("norm2_len", 7, "norms of 128 and 7 elements"),
        ("hidden", 64, "rows of 128 for hidden 64"),
        ("kv_heads", 3, "heads over 3 kv heads"),
        ("inter", 0, "hidden 128, ffn 0"),
        ("bias_len", 5, "a q|k|v bias of 5"),
    ],
)
def test_a_layer_whose_arguments_disagree_is_refused_before_any_read(
    tiny_packed32: tuple, field: str, value: object, message: str
) -> None:
    """Every size in a layer's `LayerArgs` is checked against the others (and the step's rows
    against the hidden size) before the kernel reads a pointer: a wrong one is a `KernelError`
    naming it, never a read past a buffer."""
    config, sd = tiny_packed32
    model, page = QuantizedLlama(config, sd), 4
    if field == "bias_len":
        bias = torch.zeros(8)
        model.layers[0].keep.append(bias)
        model.layers[0].args.bias = bias.data_ptr()
    setattr(model.layers[0].args, field, value)
    k, v = caches(config, torch.float32, 8)
    with pytest.raises(kernels.KernelError, match=re.escape(message)), torch.inference_mode():
        model.forward(torch.tensor([5, 7, 9]), index_of([((5, 7, 9), 0, (0,))], page), k, v, page)
