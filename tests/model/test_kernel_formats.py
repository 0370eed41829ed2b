"""The GGUF formats the kernels multiply as stored beyond Q4_0/Q4_1/Q8_0/Q4_K/Q6_K: Q5_0, Q5_1,
IQ4_NL, Q2_K, Q3_K, Q5_K, IQ4_XS, F16, BF16. Random block bytes (every bit pattern of the packed
weights and sub-scales, finite fp16 scales) against gguf-py's dequantization, on the native, AVX2
(haswell) and portable (x86-64) builds, and a small GGUF of these types loaded as stored. The
column kernels of Q5_K, IQ4_XS, IQ4_NL, Q5_0, Q5_1, Q3_K, Q2_K, F16 and BF16 (repacked groups of
16 or 8 rows) on every build that has them: AVX-512 VNNI, AVX-VNNI (alderlake), AVX2 without VNNI
(haswell)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import pathlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from ft.model import kernels
from ft.model.attention import SeqSpan, build_metadata
from ft.model.gguf_file import ModelFileError
from ft.model.gguf_loader import load_gguf
from ft.model.llama import build_model
from ft.model.quant import (
    BF16,
    F16,
    IQ4_NL,
    IQ4_XS,
    KERNEL_TYPES,
    Q2_K,
    Q3_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q8_0,
    QuantTensor,
)
from ft.model.quantized_llama import QuantizedLlama, StepIndex
from tests.support.gguf_files import LAYER_TYPES, RawGGUF, write_tiny_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")

FORMATS = (Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q5_K, IQ4_XS, F16, BF16)
# fp16 fields (byte offsets in a block): the scales (and mins) of each format
SCALES = {Q5_0: (0,), Q5_1: (0, 2), IQ4_NL: (0,), Q2_K: (80, 82), Q3_K: (108,), Q5_K: (0, 2), IQ4_XS: (0,)}
FORMAT_NAMES = [KERNEL_TYPES[t] for t in FORMATS]


def random_weight(qtype: int, rows: int, cols: int, seed: int = 0, any_scale: bool = False) -> QuantTensor:
    """Random blocks of `qtype`; the fp16 fields are small positive scales, or with `any_scale`
    any finite fp16 (negative, subnormal, huge)."""
    rng = np.random.default_rng(seed)
    if qtype in (F16, BF16):
        return float_weight(qtype, rows, cols, rng, any_scale)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    nb = rows * cols // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for at in SCALES[qtype]:
        if any_scale:
            bits = rng.integers(0, 1 << 16, size=nb, dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # no Inf/NaN exponent
        else:
            bits = rng.uniform(0.0005, 0.004, size=nb).astype(np.float16).view(np.uint16)
        raw[:, at : at + 2] = bits.view(np.uint8).reshape(nb, 2)
    return QuantTensor(torch.from_numpy(raw.reshape(rows, -1).copy()), qtype, cols)


def float_weight(qtype: int, rows: int, cols: int, rng: np.random.Generator, any_value: bool) -> QuantTensor:
    """F16 or BF16 weights: small normal values, or with `any_value` any finite bit pattern."""
    if any_value:
        bits = rng.integers(0, 1 << 16, size=(rows, cols), dtype=np.uint16)
        exponent = 0x7C00 if qtype == F16 else 0x7F80
        bits[(bits & exponent) == exponent] &= 0xBFFF  # no Inf/NaN exponent
    else:
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        bits = values.astype(np.float16).view(np.uint16) if qtype == F16 else (values.view(np.uint32) >> 16)
    data = np.ascontiguousarray(bits.astype(np.uint16)).view(np.uint8).reshape(rows, 2 * cols)
    return QuantTensor(torch.from_numpy(data.copy()), qtype, cols)


def reference(w: QuantTensor) -> torch.Tensor:
    """gguf-py's dequantization of `w` as float32 `[rows, cols]`."""
    out = dequantize(w.data.numpy(), GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.array(out, dtype=np.float32)).reshape(w.rows, w.cols)


def product(w: QuantTensor, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.rows)
    kernels.gemm_into(out, w, kernels.QuantizedActivations(x, lib), lib)
    return out


def integer_activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Integers with a 127 in every block of 32: they quantize to int8 exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, cols), generator=g).float()
    x[:, ::32] = 127
    return x


@pytest.mark.parametrize("qtype", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize("any_scale", [False, True])
def test_dequantize_is_gguf_py_exactly(qtype: int, any_scale: bool) -> None:
    """ft's decoding of every block (embedding lookups, `dequantize_rows`) is gguf-py's, bit for
    bit, for any finite scale (negative and subnormal fp16 included)."""
    w = random_weight(qtype, 11, 512, seed=qtype, any_scale=any_scale)
    ids = torch.tensor([0, 10, 3, 3, 7])
    out = kernels.dequantize_rows(w, ids)
    assert np.array_equal(out.numpy(), reference(w)[ids].numpy())


@pytest.mark.parametrize("qtype", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_product_is_exact_when_activations_are_representable(qtype: int, rows: int) -> None:
    """With exactly quantized activations only float summation order separates the kernel from
    gguf-py's dequantize-then-matmul: every row tile (4 and 1), odd N, several super-blocks."""
    w = random_weight(qtype, 37, 768, seed=qtype + 1)
    x = integer_activations(rows, 768, seed=rows)
    ref = (x.double() @ reference(w).double().T).float()
    out = product(w, x)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item()), (out - ref).abs().max()


@pytest.mark.parametrize("qtype", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"])
def test_every_build_is_within_int8_rounding_of_the_float_product(qtype: int, march: str) -> None:
    """Native, AVX2 without VNNI (haswell: 16-bit pair sums) and portable C++ (x86-64) each give
    the float product of gguf-py's weights within the int8 rounding of float activations, and
    the same sums on exactly quantized activations."""
    lib = kernels.library() if march == "native" else kernels.build_library(march)
    w = random_weight(qtype, 29, 512, seed=qtype + 2)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(qtype))
    ref = x.double() @ reference(w).double().T
    out = product(w, x, lib).double()
    assert ((out - ref).norm() / ref.norm()).item() < 0.02
    xi = integer_activations(4, 512, seed=qtype)
    refi = (xi.double() @ reference(w).double().T).float()
    assert torch.allclose(product(w, xi, lib), refi, rtol=1e-5, atol=1e-4 * refi.abs().max().item())


@pytest.mark.parametrize("qtype", FORMATS, ids=FORMAT_NAMES)
def test_sizes_that_are_not_whole_blocks_are_refused(qtype: int) -> None:
    """The native checks know each format's block: a row of the wrong byte count, or a K that
    is not whole (super-)blocks, is an error naming the sizes, never a read past the row."""
    w = random_weight(qtype, 4, 512, seed=5)
    x = kernels.QuantizedActivations(torch.randn(2, 512))
    lib = kernels.library()
    out = torch.empty(2, 4)
    short = w.data[:, :-2].contiguous()
    code = lib.ft_gemm(qtype, short.data_ptr(), 4, 512, short.shape[1], 0, x.qs.data_ptr(), x.d.data_ptr(),
                       x.s.data_ptr(), x.sx.data_ptr(), 2, out.data_ptr(), 4, 1)  # fmt: skip
    assert code != 0 and b"bytes" in lib.ft_last_error()
    if GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] == 256:
        x96 = kernels.QuantizedActivations(torch.randn(2, 96))
        code = lib.ft_gemm(qtype, w.data.data_ptr(), 4, 96, w.data.shape[1], 0, x96.qs.data_ptr(),
                           x96.d.data_ptr(), x96.s.data_ptr(), x96.sx.data_ptr(), 2, out.data_ptr(), 4,
                           1)  # fmt: skip
        assert code != 0 and b"whole blocks of 256" in lib.ft_last_error()


# ---- The column kernels of these formats (repacked groups of RC rows) ----
COLUMN_FORMATS = (Q5_K, IQ4_XS, IQ4_NL, Q5_0, Q5_1, Q3_K, Q2_K, F16, BF16)
COLUMN_NAMES = [KERNEL_TYPES[t] for t in COLUMN_FORMATS]
# a repacked row's bytes per GGUF block (the 6-bit scales of Q5_K, IQ4_XS, Q3_K unpacked to bytes;
# F16 and BF16 blocks are one element)
COLUMN_BLOCK_BYTES = {
    Q5_K: 180, IQ4_XS: 138, IQ4_NL: 18, Q5_0: 22, Q5_1: 24, Q3_K: 114, Q2_K: 84, F16: 2, BF16: 2,
}  # fmt: skip
# NaN, +Inf, -Inf as each format's fp16 scale (or F16 / BF16 weight)
NON_FINITE = {BF16: (0x7FC0, 0x7F80, 0xFF80)}


def _cpu_has(flag: str) -> bool:
    try:
        return flag in pathlib.Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


COLUMN_BUILDS = [
    "native",  # AVX-512 VNNI here: 16 columns (or whatever this CPU has)
    pytest.param("haswell", marks=pytest.mark.skipif(not _cpu_has("avx2"), reason="no AVX2 here")),
    pytest.param("alderlake", marks=pytest.mark.skipif(not _cpu_has("avx_vnni"), reason="no AVX-VNNI here")),
]


def column_library(march: str) -> ctypes.CDLL:
    """The build for `march`, skipping where it has no column kernels (a CPU without AVX2); with
    `FT_KERNELS_SANITIZE=1` (and the ASan runtime preloaded) every build is the sanitized one."""
    sanitize = os.environ.get("FT_KERNELS_SANITIZE") == "1"
    lib = kernels.library() if march == "native" else kernels.build_library(march, sanitize=sanitize)
    if not lib.ft_repack_columns():
        pytest.skip("no column kernels on this build")
    return lib


@pytest.mark.parametrize("qtype", COLUMN_FORMATS, ids=COLUMN_NAMES)
@pytest.mark.parametrize("any_scale", [False, True])
@pytest.mark.parametrize("march", COLUMN_BUILDS)
def test_repacked_rows_are_gguf_py_exactly(qtype: int, any_scale: bool, march: str) -> None:
    """A repacked weight (whole groups of 16 or 8 rows) holds the GGUF values: every row decodes
    to gguf-py's floats bit for bit, for any finite scale (negative, subnormal, 65504), and the
    bytes are the file's but for the 6-bit scales of Q5_K, IQ4_XS and Q3_K unpacked to a byte each."""
    lib = column_library(march)
    w = random_weight(qtype, 48, 512, seed=qtype + 7, any_scale=any_scale)
    r = kernels.repacked(w, lib)
    assert r.columns == lib.ft_repack_columns() and r.qtype == qtype
    block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]
    assert r.data.shape == (48, 512 // block * COLUMN_BLOCK_BYTES[qtype])
    out = kernels.dequantize_rows(r, torch.arange(48), lib)
    assert np.array_equal(out.numpy(), reference(w).numpy())
    ids = torch.tensor([47, 0, 17, 17, 31])  # embedding lookups: single rows of groups
    assert torch.equal(kernels.dequantize_rows(r, ids, lib), out[ids])


@pytest.mark.parametrize("qtype", COLUMN_FORMATS, ids=COLUMN_NAMES)
@pytest.mark.parametrize("march", COLUMN_BUILDS)
def test_column_products_are_gguf_py_in_every_tile_and_rows_stay_alone(qtype: int, march: str) -> None:
    """The column kernels against gguf-py's dequantize-then-matmul: exact up to float summation
    order for representable activations at every M (tiles of 8, 4 and 1 rows and their tails),
    every row bitwise the one it gets alone, the row kernels' sums, and float activations within
    the int8 rounding of the float product."""
    lib = column_library(march)
    w = random_weight(qtype, 48, 768, seed=qtype + 8)
    r = kernels.repacked(w, lib)
    assert r.columns
    ref_w = reference(w).double()
    x = integer_activations(33, 768, seed=qtype)
    ref = (x.double() @ ref_w.T).float()
    alone = torch.cat([product(r, x[m : m + 1], lib) for m in range(33)])
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33):
        out = product(r, x[:m], lib)
        assert torch.allclose(out, ref[:m], rtol=1e-5, atol=1e-4 * ref.abs().max().item()), m
        assert torch.equal(out, alone[:m]), m
    rows = product(w, x, lib)
    assert torch.allclose(alone, rows, rtol=1e-5, atol=1e-5 * rows.abs().max().item())
    xf = torch.randn(9, 768, generator=torch.Generator().manual_seed(qtype))
    ref_f = xf.double() @ ref_w.T
    assert ((product(r, xf, lib).double() - ref_f).norm() / ref_f.norm()).item() < 0.02


@pytest.mark.parametrize("qtype", COLUMN_FORMATS, ids=COLUMN_NAMES)
@pytest.mark.parametrize("march", COLUMN_BUILDS)
def test_extreme_and_non_finite_scales_stay_in_their_own_column(qtype: int, march: str) -> None:
    """Huge, negative and subnormal finite scales (any F16 / BF16 weight) give the row kernels'
    products; a NaN or an infinite scale (a block the loader would refuse, passed straight to the
    kernel) makes only its own row's outputs non-finite: the other columns of its group are
    bitwise unchanged."""
    lib = column_library(march)
    w = random_weight(qtype, 32, 512, seed=qtype + 9, any_scale=True)
    if qtype == BF16:  # exponents under 2^64 (and tiny): no product overflows float32
        w.data.view(torch.int16).bitwise_and_(~0x2000)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    rows, cols = product(w, x, lib), product(kernels.repacked(w, lib), x, lib)
    assert torch.isfinite(rows).all()
    assert torch.allclose(cols, rows, rtol=1e-4, atol=1e-5 * rows.abs().max().item())

    raw = w.data.clone()
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    # NaN, +Inf, -Inf in the second block's d (F16 / BF16: its weight)
    poisoned = dict(zip((3, 12, 21), NON_FINITE.get(qtype, (0x7E00, 0x7C00, 0xFC00)), strict=True))
    at = size + SCALES.get(qtype, (0,))[0]
    for row, bits in poisoned.items():
        raw[row, at : at + 2] = torch.tensor([bits & 0xFF, bits >> 8], dtype=torch.uint8)
    bad = kernels.repacked(QuantTensor(raw, qtype, 512), lib)
    out = product(bad, x, lib)
    clean = [c for c in range(32) if c not in poisoned]
    assert torch.equal(out[:, clean], cols[:, clean])
    assert not torch.isfinite(out[:, sorted(poisoned)]).any()
    assert math.isnan(kernels.dequantize_rows(bad, torch.tensor([3]), lib)[0, block].item())


@pytest.mark.parametrize("qtype", COLUMN_FORMATS, ids=COLUMN_NAMES)
def test_repacked_sizes_that_disagree_are_refused(qtype: int) -> None:
    """A repacked weight described with the GGUF row bytes (where they differ) or another width,
    and a repack of rows that are not whole groups, are refused before any memory is read."""
    lib = column_library("native")
    w = kernels.repacked(random_weight(qtype, 32, 512), lib)
    x = kernels.QuantizedActivations(torch.ones(1, 512), lib)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    lies = [(w.data.shape[1] - 1, 512), (w.data.shape[1], 256), (w.data.shape[1], 1024)]
    if size != COLUMN_BLOCK_BYTES[qtype]:
        lies.append((512 // block * size, 512))
    out = torch.empty(1, 32)
    for row_bytes, cols in lies:
        with pytest.raises(kernels.KernelError, match="bytes|blocks"):
            kernels.check(lib, lib.ft_gemm(
                qtype, w.data.data_ptr(), 32, cols, row_bytes, w.columns, x.qs.data_ptr(), x.d.data_ptr(),
                x.s.data_ptr(), x.sx.data_ptr(), 1, out.data_ptr(), 32, 1,
            ))  # fmt: skip
    src = random_weight(qtype, 20, 512).data  # not whole groups of 8 or 16
    dst = torch.empty(20, lib.ft_repacked_row_bytes(qtype, 512), dtype=torch.uint8)
    with pytest.raises(kernels.KernelError, match="whole groups"):
        kernels.check(lib, lib.ft_repack(qtype, src.data_ptr(), 20, 512, src.shape[1], dst.data_ptr()))
    assert lib.ft_repacked_row_bytes(qtype, 500) == 0
    assert kernels.repacked(QuantTensor(src, qtype, 512), lib).columns == 0  # stays rows


# Each layer weight of the tiny model in one of the new formats (and the embedding in IQ4_NL).
FORMAT_LAYERS = {
    "attn_q": GGMLQuantizationType.Q5_K,
    "attn_k": GGMLQuantizationType.Q5_0,
    "attn_v": GGMLQuantizationType.Q5_1,
    "attn_output": GGMLQuantizationType.IQ4_XS,
    "ffn_gate": GGMLQuantizationType.Q3_K,
    "ffn_up": GGMLQuantizationType.Q2_K,
    "ffn_down": GGMLQuantizationType.IQ4_NL,
}
# ... and float weights (F16, BF16) among quantized ones, the embedding in F16.
FLOAT_LAYERS = LAYER_TYPES | {"attn_q": GGMLQuantizationType.BF16, "ffn_up": GGMLQuantizationType.F16}
LOADER_CASES = {
    "quants": (FORMAT_LAYERS, GGMLQuantizationType.IQ4_NL),
    "floats": (FLOAT_LAYERS, GGMLQuantizationType.F16),
}
assert FORMAT_LAYERS.keys() == LAYER_TYPES.keys() == FLOAT_LAYERS.keys()
assert {int(t) for layers, _ in LOADER_CASES.values() for t in layers.values()} >= set(FORMATS)


@pytest.mark.parametrize("case", sorted(LOADER_CASES))
def test_a_gguf_of_the_new_formats_loads_as_stored_and_matches_the_float_model(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Every weight stays in its file's format (no Q8_0 copy, no requantization logged), and the
    packed model's logits are the float model's over the same dequantized weights within the
    int8 rounding of the activations."""
    layers, embedding = LOADER_CASES[case]
    path = write_tiny_gguf(tmp_path / "formats.gguf", layer_types=layers, embedding_type=embedding)
    with caplog.at_level(logging.WARNING, logger="ft.model"):
        config, sd_packed, _, _ = load_gguf(path, torch.float32, quantized=True)
    assert not [r for r in caplog.records if "requantized" in r.getMessage()]
    columns = kernels.library().ft_repack_columns()
    for part, qtype in layers.items():
        for name, w in sd_packed.items():
            if name.endswith(f"{_HF[part]}.weight"):
                assert isinstance(w, QuantTensor) and w.qtype == int(qtype), (name, w)
                # the types with column kernels are repacked wherever the rows are whole groups
                repack = columns and w.qtype in kernels.REPACKABLE and w.rows % columns == 0
                assert w.columns == (columns if repack else 0), (name, w.rows, w.columns)
    embed = sd_packed["model.embed_tokens.weight"]
    assert isinstance(embed, QuantTensor) and embed.qtype == int(embedding)
    config_f, sd_float, _, _ = load_gguf(path, torch.float32)
    assert config_f == config

    ids = torch.tensor([5, 70, 9, 200, 13, 42])
    spans = [SeqSpan(0, len(ids), (0,))]
    page = 8
    shape = (config.num_layers, page, config.num_kv_heads, config.head_dim)
    index = StepIndex(
        slot_of=torch.arange(len(ids)),
        seq=torch.zeros(len(ids), dtype=torch.int64),
        positions=torch.arange(len(ids)),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
    )
    ref_model = build_model(config, sd_float, torch.float32)
    packed = QuantizedLlama(config, sd_packed)
    with torch.inference_mode():
        meta = build_metadata(spans, page)
        ref = ref_model.logits(ref_model(ids, index.positions, torch.zeros(shape), torch.zeros(shape), meta))
        hidden = packed.forward(ids, index, torch.zeros(shape), torch.zeros(shape), page)
        out = packed.logits(hidden)
    assert torch.isfinite(out).all() and ref.abs().max() > 0
    assert ((out - ref).norm() / ref.norm()).item() < 0.05


_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def test_a_type_without_a_kernel_is_requantized_and_logged(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """IQ2_XXS has no kernel: such a weight becomes Q8_0 (within its rounding of the stored
    values), and the load says which type and how many tensors."""
    layers = LAYER_TYPES | {"ffn_up": GGMLQuantizationType.IQ2_XXS}
    path = write_tiny_gguf(tmp_path / "iq2.gguf", layer_types=layers)
    with caplog.at_level(logging.WARNING, logger="ft.model"):
        _, sd, _, _ = load_gguf(path, torch.float32, quantized=True)
        _, sd_float, _, _ = load_gguf(path, torch.float32)
    up = sd["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, QuantTensor) and up.qtype == Q8_0
    ref = sd_float["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(ref, torch.Tensor)
    assert ((up.dequantize() - ref).norm() / ref.norm()).item() < 0.01
    messages = [r.getMessage() for r in caplog.records if "requantized to Q8_0" in r.getMessage()]
    assert len(messages) == 1 and "2 tensors of IQ2_XXS" in messages[0], messages


@pytest.mark.parametrize("bits", [0x7E00, 0x7C00, 0xFC00], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("part", "at"), [(part, at) for part, t in FORMAT_LAYERS.items() for at in SCALES[int(t)]]
)
def test_a_non_finite_scale_in_a_new_format_is_a_named_error(
    tmp_path: pathlib.Path, part: str, at: int, bits: int
) -> None:
    """NaN or Inf in any fp16 scale (or min) of a block of these formats is refused at load,
    naming the tensor, before any kernel multiplies it."""
    path = write_tiny_gguf(tmp_path / "nan.gguf", layer_types=FORMAT_LAYERS)
    raw = RawGGUF.read(path)
    name = f"blk.1.{part}.weight"
    _, size = GGML_QUANT_SIZES[FORMAT_LAYERS[part]]
    with path.open("r+b") as f:
        f.seek(raw.header()[1].data + raw.tensor(name).offset + 3 * size + at)  # the fourth block
        f.write(bits.to_bytes(2, "little"))
    with pytest.raises(ModelFileError, match=name):
        load_gguf(path, torch.float32, quantized=True)


@pytest.mark.parametrize("quantized", [True, False], ids=["packed", "floats"])
def test_a_type_gguf_py_cannot_dequantize_is_a_named_error(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, quantized: bool
) -> None:
    """Q8_1 has no kernel and no gguf-py dequantization: the load names the tensor and its type
    (never a crash, never a silent requantization)."""
    from tests.support import gguf_files

    monkeypatch.setitem(gguf_files._K_SCALES, GGMLQuantizationType.Q8_1, (0, 2))  # random blocks
    path = write_tiny_gguf(
        tmp_path / "q8_1.gguf", layer_types=LAYER_TYPES | {"ffn_up": GGMLQuantizationType.Q8_1}
    )
    with pytest.raises(
        ModelFileError, match="blk.0.ffn_up.weight has type Q8_1, which cannot be dequantized"
    ):
        load_gguf(path, torch.float32, quantized=quantized)
