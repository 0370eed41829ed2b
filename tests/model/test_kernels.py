"""The packed GGUF kernels: exact products on every supported type, and a packed decoder that
matches the torch one on a tiny random model (mixed prefill chunks and decode rows, paged KV)."""

from __future__ import annotations

import ctypes
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.attention import SeqSpan, build_metadata
from ft.model.llama import build_model
from ft.model.loader import LoadedModel, load_model
from ft.model.quant import IQ4_NL, IQ4_XS, KERNEL_TYPES, Q3_K, Q4_K, Q5_0, Q5_K, Q6_K, QuantTensor, to_q8_0
from ft.model.quantized_llama import QuantizedLlama, StepIndex
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.tiny_model import random_hf_state_dict, tiny_config

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")

BLOCK_BYTES = {12: (256, 144), 14: (256, 210)}
# the formats gguf-py cannot quantize: random blocks (elements, bytes) and their fp16 fields
BLOCK_BYTES |= {10: (256, 84), 11: (256, 110), 13: (256, 176), 20: (32, 18), 23: (256, 136)}
SCALE_FIELDS = {12: (0, 2), 14: (208,), 10: (80, 82), 11: (108,), 13: (0, 2), 20: (0,), 23: (0,)}


def packed_weight(
    qtype: int, rows: int, cols: int, seed: int = 0, scale: tuple[float, float] = (0.001, 0.01)
) -> QuantTensor:
    """Random weights of `qtype`: quantized floats, or random K-quant blocks (every bit of the
    quants and the 6-bit or int8 sub-block scales random) with fp16 scales drawn from `scale`."""
    rng = np.random.default_rng(seed)
    t = GGMLQuantizationType(qtype)
    if qtype in BLOCK_BYTES:
        block, size = BLOCK_BYTES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for at in SCALE_FIELDS[qtype]:
            scales = rng.uniform(*scale, size=(rows, cols // block)).astype(np.float16)
            raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
        data = raw.reshape(rows, -1)
    else:  # (F16 and BF16 come as 2-byte values: their bytes)
        data = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, t)
        data = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(data)), qtype, cols)


def product(w: QuantTensor, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.rows)
    kernels.gemm_into(out, w, kernels.QuantizedActivations(x, lib), lib)
    return out


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 17])
@pytest.mark.parametrize("cols", [32, 224, 512])
def test_product_is_exact_when_activations_are_representable(qtype: int, rows: int, cols: int) -> None:
    """Integer activations with a 127 in every block quantize exactly, so only rounding of the
    float sums separates the kernel from dequantize-then-matmul (every row tile, block tail)."""
    cols = max(cols, BLOCK_BYTES.get(qtype, (32, 0))[0])
    w = packed_weight(qtype, 40, cols)
    x = torch.randint(-127, 128, (rows, cols)).float()
    x[:, ::32] = 127
    ref = x @ w.dequantize().T
    assert torch.allclose(product(w, x), ref, rtol=1e-5, atol=1e-3 * ref.abs().max().item())


needs_columns = pytest.mark.skipif(
    not kernels.available() or kernels.library().ft_repack_columns() == 0,
    reason="no column kernels on this CPU (they need AVX2 or AVX-512 VNNI)",
)


@needs_columns
@pytest.mark.parametrize("qtype", sorted(kernels.REPACKABLE))
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_repacked_weights_give_the_same_products_and_rows(qtype: int, rows: int) -> None:
    """The column kernels over repacked bytes give the row kernels' sums, and dequantizing a
    repacked weight gives the GGUF values back exactly. The same bytes, but for the 6-bit scales
    unpacked to a byte each (per 256 elements: Q4_K 148 bytes, not 144; Q5_K 180, not 176;
    IQ4_XS 138, not 136; Q3_K 114, not 110)."""
    if not kernels.library().ft_repacked_row_bytes(qtype, 512):
        pytest.skip("no column kernels for this type on this build")
    cols = 512 if qtype in BLOCK_BYTES else 224
    w = packed_weight(qtype, 48, cols, seed=4)
    r = kernels.repacked(w)
    unpacked = {Q4_K: (144, 148), Q5_K: (176, 180), IQ4_XS: (136, 138), Q3_K: (110, 114)}  # scales as bytes
    gguf, ours = unpacked.get(qtype, (1, 1))
    row_bytes = w.data.shape[1] // gguf * ours
    assert r.columns > 0 and r.data.shape == (48, row_bytes)
    x = torch.randint(-127, 128, (rows, cols)).float()
    x[:, ::32] = 127
    assert torch.allclose(
        product(r, x), product(w, x), rtol=1e-5, atol=1e-3 * product(w, x).abs().max().item()
    )
    assert torch.equal(r.dequantize(), w.dequantize())
    ids = torch.tensor([47, 0, 17, 17, 31])  # embedding lookups: single rows of groups
    assert torch.equal(kernels.dequantize_rows(r, ids), w.dequantize()[ids])
    y = torch.randn(rows, cols)
    assert ((product(r, y) - product(w, y)).norm() / product(w, y).norm()).item() < 1e-5


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K, Q5_K, IQ4_XS, IQ4_NL, Q5_0])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_k_quant_products_are_exact_in_every_tile_and_rows_stay_alone(qtype: int, layout: str) -> None:
    """Q4_K, Q6_K, Q5_K, IQ4_XS (and IQ4_NL, Q5_0 of the blocks of 32) on the row kernels (40
    rows: not whole groups of 16) and on repacked
    columns: for representable activations, dequantize-then-matmul up to float rounding at
    every M (tiles of 8, 4 and 1 rows and their tails), and every row's result is bitwise the
    one it gets alone: it does not depend on M or on its neighbours."""
    if layout == "columns" and not kernels.library().ft_repack_columns():
        pytest.skip("no column kernels on this CPU (they need AVX2 or AVX-512 VNNI)")
    w = packed_weight(qtype, 40 if layout == "rows" else 48, 768, seed=5)
    if layout == "columns":
        w = kernels.repacked(w)
        assert w.columns
    x = torch.randint(-127, 128, (17, 768)).float()
    x[:, ::32] = 127
    ref = x @ w.dequantize().T
    alone = torch.cat([product(w, x[m : m + 1]) for m in range(17)])
    for m in (1, 3, 4, 8, 9, 17):
        out = product(w, x[:m])
        assert torch.allclose(out, ref[:m], rtol=1e-5, atol=1e-4 * ref.abs().max().item()), m
        assert torch.equal(out, alone[:m]), m


def _cpu_has(flag: str) -> bool:
    try:
        return flag in pathlib.Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


BUILDS = [
    "native",
    "x86-64",  # plain C++: no column kernels
    "haswell",  # AVX2 without VNNI: columns of 8 through 16-bit pair sums
    pytest.param("alderlake", marks=pytest.mark.skipif(not _cpu_has("avx_vnni"), reason="no AVX-VNNI here")),
]


@pytest.mark.parametrize("qtype", sorted(kernels.REPACKABLE))
@pytest.mark.parametrize("march", BUILDS)
def test_products_of_every_build_and_layout_are_within_int8_rounding(qtype: int, march: str) -> None:
    """On every build, its row kernels and its column kernels (16 columns on AVX-512 VNNI, 8 on
    AVX2): representable activations give dequantize-then-matmul up to float rounding, float
    ones stay within the int8 rounding of the float product (the reference every CPU shares),
    repacked rows dequantize to the GGUF values, and a row's result never depends on M."""
    lib = kernels.library() if march == "native" else kernels.build_library(march)
    cols = 512
    w = packed_weight(qtype, 48, cols, seed=6)
    r = kernels.repacked(w, lib)
    if lib.ft_repacked_row_bytes(qtype, cols):
        assert r.columns == lib.ft_repack_columns() > 0
        assert torch.equal(kernels.dequantize_rows(r, torch.arange(48), lib), w.dequantize())
    wd = w.dequantize()
    xi = torch.randint(-127, 128, (17, cols)).float()
    xi[:, ::32] = 127
    for form in (w, r) if r.columns else (w,):
        ref = xi @ wd.T
        out = product(form, xi, lib)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item()), form.columns
        assert torch.equal(product(form, xi[:9], lib), out[:9]), form.columns
        assert torch.equal(product(form, xi[16:], lib), out[16:]), form.columns
        x = torch.randn(9, cols)
        ref = x @ wd.T
        assert ((product(form, x, lib) - ref).norm() / ref.norm()).item() < 0.02, form.columns


@needs_columns
@pytest.mark.parametrize("qtype", [Q4_K, Q6_K, Q5_K, IQ4_XS])
def test_repacked_k_quants_refuse_sizes_that_disagree(qtype: int) -> None:
    """A repacked weight described with the GGUF row bytes or another width, and a repack of
    rows that are not whole groups, are refused before any memory is read."""
    w = kernels.repacked(packed_weight(qtype, 32, 512))
    x = kernels.QuantizedActivations(torch.ones(1, 512))
    lib = kernels.library()
    gguf_bytes = 512 // 256 * BLOCK_BYTES[qtype][1]
    lies = [(w.data.shape[1] - 1, 512), (w.data.shape[1], 256), (w.data.shape[1], 1024)]
    if gguf_bytes != w.data.shape[1]:
        lies.append((gguf_bytes, 512))
    out = torch.empty(1, 32)
    for row_bytes, cols in lies:
        with pytest.raises(kernels.KernelError, match="bytes|blocks"):
            kernels.check(lib, lib.ft_gemm(
                qtype, w.data.data_ptr(), 32, cols, row_bytes, w.columns, x.qs.data_ptr(), x.d.data_ptr(),
                x.s.data_ptr(), x.sx.data_ptr(), 1, out.data_ptr(), 32, 1,
            ))  # fmt: skip
    src = packed_weight(qtype, 20, 512).data  # not whole groups of 8 or 16
    dst = torch.empty(20, lib.ft_repacked_row_bytes(qtype, 512), dtype=torch.uint8)
    with pytest.raises(kernels.KernelError, match="whole groups"):
        kernels.check(lib, lib.ft_repack(qtype, src.data_ptr(), 20, 512, src.shape[1], dst.data_ptr()))
    assert lib.ft_repacked_row_bytes(qtype, 500) == 0


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_other_builds_give_the_same_products(qtype: int, march: str) -> None:
    """The plain C++ paths (x86-64: no AVX2) and the AVX2 paths without VNNI (haswell: 16-bit
    saturating pair sums) give the native build's sums, on every type."""
    other = kernels.build_library(march)
    w = packed_weight(qtype, 24, 512, seed=3)
    x = torch.randint(-127, 128, (5, 512)).float()
    x[:, ::32] = 127
    out = torch.empty(5, 24)
    kernels.gemm_into(out, w, kernels.QuantizedActivations(x, other), other)
    assert torch.allclose(out, product(w, x), rtol=1e-5, atol=1e-3 * out.abs().max().item())


@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_every_build_quantizes_activations_alike(march: str) -> None:
    """The vector quantization (AVX-512) and the plain loop give the same int8 blocks, scales
    and sums, ties, NaN, infinities and subnormal blocks (whose 127 / amax overflows) included."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 256, generator=g) * torch.logspace(-3, 3, 12)[:, None]
    x[1, :32] = torch.arange(32) - 15.5  # halves, not ties: this block's scale is 127 / 16.5
    x[1, 32:64] = torch.arange(32) * 2 - 31.5  # halves at another scale (127 / 31.5)
    x[1, 64:96] = torch.arange(32) * 8 - 124.5  # every one a k + 0.5
    x[1, 64] = 127.0  # amax 127: scale 1, so the other 31 are ties
    x[2, 5] = float("nan")
    x[3, 40] = float("inf")
    x[4, 70] = float("-inf")
    x[5, :32] = 1e-42  # subnormal: 127 / amax is inf
    x[5, 3] = -3e-42
    x[6, 32:64] = 0.0
    x[7, 64:96] = -0.0
    x[8, 100] = 3.4e38
    ours = kernels.QuantizedActivations(x)
    theirs = kernels.QuantizedActivations(x, kernels.build_library(march))
    for name in ("qs", "sx"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    for name in ("d", "s"):
        assert torch.equal(getattr(ours, name).nan_to_num(), getattr(theirs, name).nan_to_num()), name
    assert int(ours.qs.min()) >= -127 and int(ours.qs.max()) <= 127
    # and both are torch's rounding (half to even) of x * 127 / amax, NaN to 0, within +-127
    blocks = x.view(12, -1, 32)
    amax = blocks.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    ref = (blocks * inv).nan_to_num(nan=0.0, posinf=127.0, neginf=-127.0).clamp(-127, 127).round()
    assert torch.equal(ours.qs.view(12, -1, 32).to(torch.float32), ref)
    assert int((blocks * inv)[1, 2].frac().abs().eq(0.5).sum()) == 31  # (the ties are there)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
def test_product_of_float_activations_is_within_int8_rounding(qtype: int) -> None:
    """Float activations are rounded to int8 per block of 32: about 0.5% relative error."""
    w = packed_weight(qtype, 64, 512, seed=1)
    x = torch.randn(5, 512)
    ref = x @ w.dequantize().T
    assert ((product(w, x) - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
def test_dequantized_rows_match_gguf(qtype: int) -> None:
    """The embedding lookup decodes blocks exactly as the gguf package does."""
    w = packed_weight(qtype, 12, 256, seed=2)
    ids = torch.tensor([3, 0, 11, 3])
    out = kernels.dequantize_rows(w, ids)
    ref = dequantize(w.data.numpy(), GGMLQuantizationType(qtype)).reshape(12, 256)[ids.numpy()]
    assert np.array_equal(out.numpy(), ref)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model", ["tiny_packed", "tiny_k_quants"])
def test_packed_decoder_matches_torch_decoder(
    request: pytest.FixtureRequest, model: str, kv_dtype: torch.dtype
) -> None:
    """Prefill chunks on top of cached positions and decode rows in one step give the hidden
    states of the float torch model over the same (dequantized) weights, within the int8
    rounding of the activations (and of a 16-bit KV cache): Q8_0 weights, and a Q4_K_M-like
    mix of Q4_K and Q6_K (repacked where this CPU has the column kernels)."""
    config, sd_packed, sd_float = request.getfixturevalue(model)
    page, pages = 4, 32
    shape = (config.num_layers, pages * page, config.num_kv_heads, config.head_dim)
    ref_model = build_model(config, sd_float, torch.float32)
    packed = QuantizedLlama(config, sd_packed)
    # seq 0: 6 prompt tokens then 1 decode; seq 1: 3 tokens, then a 5-token chunk on top.
    steps = [
        [(0, (5, 7, 9, 11, 13, 15), 0, (0, 1)), (1, (2, 4, 6), 0, (2, 3, 4))],
        [(0, (17,), 6, (0, 1)), (1, (8, 10, 12, 14, 16), 3, (2, 3, 4))],
    ]
    ref_caches = (torch.zeros(shape), torch.zeros(shape))
    caches = (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
    for step in steps:
        ids = torch.tensor([t for _, toks, _, _ in step for t in toks])
        spans = [SeqSpan(s, len(toks), p) for _, toks, s, p in step]
        index = step_index(step, page)
        with torch.inference_mode():
            ref = ref_model(ids, index.positions, *ref_caches, build_metadata(spans, page))
            out = packed.forward(ids, index, *caches, page)
        assert ((out - ref).norm() / ref.norm()).item() < 0.03


def step_index(step: list, page: int) -> StepIndex:
    """The packed decoder's index arrays for `(seq, tokens, start, pages)` entries."""
    slots = [p[q // page] * page + q % page for _, t, s, p in step for q in range(s, s + len(t))]
    tables = [list(p) + [0] * (3 - len(p)) for _, _, _, p in step]
    return StepIndex(
        slot_of=torch.tensor(slots),
        seq=torch.tensor([i for i, (_, t, _, _) in enumerate(step) for _ in t]),
        positions=torch.tensor([s + i for _, t, s, _ in step for i in range(len(t))]),
        block_tables=torch.tensor(tables, dtype=torch.int32),
    )


@pytest.fixture
def tiny_packed() -> tuple:
    config = tiny_config(hidden_size=64, intermediate_size=128, vocab_size=64)
    sd = random_hf_state_dict(config)
    packed: dict[str, torch.Tensor | QuantTensor] = {
        k: kernels.repacked(to_q8_0(v.numpy())) if v.dim() == 2 else v for k, v in sd.items()
    }
    dense = {k: v.dequantize() if isinstance(v, QuantTensor) else v for k, v in packed.items()}
    return config, packed, dense


@pytest.fixture
def tiny_k_quants() -> tuple:
    """Random Q4_K weights, with Q6_K for v_proj, down_proj and the (tied) embedding, as a
    Q4_K_M file has them; 128 kv rows (whole groups of 16) and 256 wide rows (whole blocks).
    Small scales (fp16 subnormals among them): larger random weights make this model's
    attention so sharp that the int8 activations of any format flip it in the second step."""
    config = tiny_config(hidden_size=256, intermediate_size=512, vocab_size=64, tie_word_embeddings=True)
    sd = random_hf_state_dict(config)
    packed: dict[str, torch.Tensor | QuantTensor] = {}
    for i, (k, v) in enumerate(sorted(sd.items())):
        if v.dim() != 2:
            packed[k] = v
            continue
        qtype = Q6_K if any(n in k for n in ("v_proj", "down_proj", "embed_tokens")) else Q4_K
        w = packed_weight(qtype, v.shape[0], v.shape[1], seed=i, scale=(2e-5, 5e-5))
        packed[k] = kernels.repacked(w)
    dense = {k: v.dequantize() if isinstance(v, QuantTensor) else v for k, v in packed.items()}
    return config, packed, dense


def test_packed_runner_rows_do_not_depend_on_the_batch(tiny_packed: tuple, tiny_dir: pathlib.Path) -> None:
    """A request's logits are bitwise the same alone, batched with decodes and other prompts,
    and with its prompt fed in other chunk sizes (as a prefix-cache hit or chunked prefill
    does); the mixed step returns its rows in order."""
    config, sd_packed, _ = tiny_packed
    spec = load_model(tiny_dir, torch.float32).tokenizer
    loaded = LoadedModel(config, sd_packed, spec, "tiny-packed", torch.float32)
    greedy = SamplingParams(temperature=0.0)
    prompt = (13, 14, 15, 16, 17, 18, 19)

    def work(seq: int, tokens: tuple[int, ...], start: int, pages: tuple[int, ...]) -> SeqWork:
        return SeqWork(seq, tokens, start, pages, True, greedy, 0)

    def fresh() -> TorchRunner:
        runner = build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32)
        runner.forward([work(1, (3, 4, 5, 6, 7), 0, (0, 1))])
        runner.forward([work(2, (8, 9, 10), 0, (2,))])
        return runner

    a = work(1, (11,), 5, (0, 1))
    b = work(2, (12,), 3, (2,))
    whole = work(3, prompt, 0, (3, 4))
    alone = [fresh().forward([w]) for w in (a, whole, b)]
    mixed = fresh().forward([a, whole, b])
    assert mixed is not None
    for row, single in zip(mixed, alone, strict=True):
        assert single is not None and torch.equal(row, single[0])
    for cut in (1, 4, 6):  # the first `cut` prompt tokens in an earlier step
        runner = fresh()
        runner.forward([work(3, prompt[:cut], 0, (3, 4))])
        tail = runner.forward([a, work(3, prompt[cut:], cut, (3, 4))])
        assert tail is not None and torch.equal(tail[1], mixed[1])


@pytest.mark.parametrize("page", [3, 4, 16])
@pytest.mark.parametrize("lengths", [(1,), (7, 8, 9), (33, 100)])
def test_paged_attention_matches_torch(lengths: tuple[int, ...], page: int) -> None:
    """The native attention (eight keys at a time, vectorized exp) gives torch's softmax
    attention for rows at any length, through scattered pages of any size (a power of two or
    not), with grouped query heads."""
    torch.manual_seed(0)
    nh, nkvh, hd = 6, 2, 64
    pages_per_seq = max(lengths) // page + 1
    num_pages = pages_per_seq * len(lengths)
    order = torch.randperm(num_pages)
    tables = order.view(len(lengths), pages_per_seq).to(torch.int32)
    k_cache = torch.randn(num_pages * page, nkvh, hd)
    v_cache = torch.randn(num_pages * page, nkvh, hd)
    q = torch.randn(len(lengths), nh * hd)
    seq = torch.arange(len(lengths))
    pos = torch.tensor([n - 1 for n in lengths])
    out = kernels.attention(q, k_cache, v_cache, seq, pos, tables, page, nh)
    for i, n in enumerate(lengths):
        slots = torch.tensor([int(tables[i, p // page]) * page + p % page for p in range(n)])
        k = k_cache[slots].repeat_interleave(nh // nkvh, dim=1).transpose(0, 1)  # [nh, n, hd]
        v = v_cache[slots].repeat_interleave(nh // nkvh, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[i].view(nh, 1, hd), k, v)
        assert torch.allclose(out[i].view(nh, 1, hd), ref, atol=2e-5, rtol=1e-4), (
            n,
            (out[i].view(nh, 1, hd) - ref).abs().max(),
        )


_DECODE_PEAK = """
import resource, torch
from ft.model import kernels
kernels.library()
page, pages, hd = 1024, 4096, 8  # one row at position 2^22 - 1, every page the same one
k, v, q = torch.randn(page, 1, hd), torch.randn(page, 1, hd), torch.randn(1, hd)
tables = torch.zeros(1, pages, dtype=torch.int32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kernels.attention(q, k, v, torch.tensor([0]), torch.tensor([page * pages - 1]), tables, page, 1)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


def test_a_decode_row_costs_its_own_scores_not_a_tile_of_eight() -> None:
    """One row at position 2^22 scores 2^22 positions (16 MiB): the attention's scratch holds
    that row's scores, not eight rows' worth cleared up front (it was 128 MiB per call)."""
    done = subprocess.run(
        [sys.executable, "-c", _DECODE_PEAK], capture_output=True, text=True, timeout=120, check=True
    )
    assert int(done.stdout.split()[-1]) < 48, done.stdout  # MiB of peak growth


@pytest.mark.parametrize(
    ("qtype", "expected"), [(GGMLQuantizationType.F32, False), (GGMLQuantizationType.Q8_0, True)]
)
def test_only_quantized_gguf_files_run_packed(
    tmp_path: pathlib.Path, qtype: GGMLQuantizationType, expected: bool
) -> None:
    """A GGUF of float weights stays float (not requantized to int8 behind the user's back)."""
    from gguf import GGUFWriter

    from ft.model.loader import is_quantized_gguf

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    data = weight if qtype == GGMLQuantizationType.F32 else quantize(weight, qtype)
    writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert is_quantized_gguf(path) is expected


def test_a_gguf_of_k_quants_loads_repacked_and_matches_its_float_load(tmp_path: pathlib.Path) -> None:
    """The loader keeps Q4_K and Q6_K layers as stored and repacks them for the column kernels
    of this build (whole groups of rows), and the packed model's hidden states stay within the
    int8 rounding of the activations of the same file loaded as float32."""
    from tests.support.gguf_files import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    packed = load_model(path, torch.float32, quantized=True)
    dense = load_model(path, torch.float32)
    columns = kernels.library().ft_repack_columns()
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):  # Q4_K, Q6_K, Q4_K
        w = packed.state_dict[f"model.layers.1.{name}.weight"]
        assert isinstance(w, QuantTensor) and w.qtype in (Q4_K, Q6_K) and w.columns == columns, name
    config = packed.config
    page, shape = 4, (config.num_layers, 32, config.num_kv_heads, config.head_dim)
    step = [(0, (5, 7, 9, 11, 13, 15), 0, (0, 1)), (1, (2, 4, 6), 0, (2, 3, 4))]
    ids = torch.tensor([t for _, toks, _, _ in step for t in toks])
    index = step_index(step, page)
    spans = [SeqSpan(s, len(toks), p) for _, toks, s, p in step]
    with torch.inference_mode():
        ref = build_model(config, dense.state_dict, torch.float32)(
            ids, index.positions, torch.zeros(shape), torch.zeros(shape), build_metadata(spans, page)
        )
        out = QuantizedLlama(config, packed.state_dict).forward(
            ids, index, torch.zeros(shape), torch.zeros(shape), page
        )
    assert ((out - ref).norm() / ref.norm()).item() < 0.03


def test_the_kernels_build_wherever_a_compiler_exists() -> None:
    """The packed-path tests skip without a C++ compiler; a compiler that fails to build the
    kernels (a broken kernels.cpp) must fail here instead of skipping them all."""
    try:
        kernels._compiler()
    except RuntimeError:
        pytest.skip("no C++ compiler")
    kernels.library()  # raises RuntimeError with the compiler's message


@pytest.mark.parametrize(
    ("which", "mirror"), [(0, kernels.Weight), (1, kernels.LayerArgs), (2, kernels.StepArgs)]
)
def test_the_ctypes_structs_match_the_compiled_ones_field_by_field(which: int, mirror: type) -> None:
    # A field one side adds, drops or reorders would shift every later one: the kernels would
    # read each layer's weights and norms from the wrong places, silently.
    out = (ctypes.c_int64 * 64)()
    names = kernels.library().ft_struct_layout(which, out, 64)
    assert names is not None
    c_fields = names.decode().rstrip(",").split(",")
    py_fields = [field[0] for field in mirror._fields_]
    assert py_fields == c_fields
    assert ctypes.sizeof(mirror) == out[0]
    for i, name in enumerate(py_fields):
        assert getattr(mirror, name).offset == out[1 + i], name
    assert kernels.library().ft_struct_layout(3, out, 64) is None
