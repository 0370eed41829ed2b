"""Quantized GGUF matrix products on the CPU: build `kernels.cpp` once, call it through ctypes.

The library is compiled at first use with the machine's own instruction set (`-march=native`:
AVX-512 VNNI, AVX2 or plain C++) into `$FT_CACHE_DIR/kernels/`, keyed by the source, the
compiler and the CPU, and shares torch's OpenMP runtime. Where no C++ compiler is found,
`available()` is False and the loader falls back to float weights.

Every entry point checks its arguments and returns an error code instead of letting a C++
exception cross `extern "C"`; the wrappers here raise it as `KernelError`. With
`FT_KERNELS_SANITIZE=1` the library is built with AddressSanitizer and UBSan (slow; for the
tests, in a process started with the ASan runtime preloaded: see `sanitizer_runtime`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import torch

from ft.model.quant import (
    BF16,
    F16,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QuantTensor,
)

SOURCE = pathlib.Path(__file__).with_name("kernels.cpp")
# The parts kernels.cpp includes, one file per concern (part of the build's cache key, as the
# source itself): every file of csrc/, so a new part cannot be left out of the key.
INCLUDES = tuple(sorted(SOURCE.with_name("csrc").glob("*.inc")))
QK = 32  # elements per activation block

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
SANITIZE_FLAGS = [
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    "-fsanitize=address,undefined,float-cast-overflow",  # (the last: a NaN or huge float cast to int)
    "-fno-sanitize-recover=all",
]


class KernelError(RuntimeError):
    """A kernel refused its arguments (or ran out of memory): nothing was written past a buffer."""


def _cpu_key() -> str:
    try:
        flags = next(
            line
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


class Weight(ctypes.Structure):
    """One projection as the kernels read it (`Weight` in kernels.cpp): rows of GGUF blocks, or
    groups of `columns` repacked rows."""

    _fields_ = [
        ("type", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("columns", ctypes.c_int64),
    ]


class LayerArgs(ctypes.Structure):
    """One decoder layer's constant parts (`LayerArgs` in kernels.cpp, field by field; its
    comments say what each holds): built once per layer, every pointer kept alive by its owner.
    A family's new field goes at the end of both, zero / null meaning "as Llama"; the tests check
    every offset against the compiled struct's (`ft_struct_layout`)."""

    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("norm1", ctypes.c_void_p),
        ("norm1_len", ctypes.c_int64),
        ("norm2", ctypes.c_void_p),
        ("norm2_len", ctypes.c_int64),
        ("w", Weight * 7),  # q, k, v, o, gate, up, down
        ("bias", ctypes.c_void_p),
        ("bias_len", ctypes.c_int64),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qk_norm_len", ctypes.c_int64),
        # Gemma 2/3 and sliding windows
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("post_norm_len", ctypes.c_int64),
        ("gelu", ctypes.c_int64),
        ("query_scale", ctypes.c_float),
        ("attn_softcap", ctypes.c_float),
        ("window", ctypes.c_int64),
        # mixture of experts: stop after the attention residual (w[4..6] and inter 0)
        ("attention_only", ctypes.c_int64),
        # OLMoE: q_norm / k_norm over the whole projections (qk_norm_len q's width, k_norm_len k's)
        ("qk_norm_whole", ctypes.c_int64),
        ("k_norm_len", ctypes.c_int64),
        # Phi-3 / SmolLM3 / Granite
        ("rotary_dim", ctypes.c_int64),  # 0: head_dim
        ("no_rope", ctypes.c_int64),  # 1: the layer skips the rotary
        ("residual_scale", ctypes.c_float),  # 0: 1
        ("attn_scale", ctypes.c_float),  # 0: 1 / sqrt(head_dim)
    ]


class StepArgs(ctypes.Structure):
    """One step's rows and where they go, shared by every layer (`StepArgs` in kernels.cpp)."""

    _fields_ = [
        ("rows", ctypes.c_int64),
        ("slot_of", ctypes.c_void_p),
        ("seq", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int64),
        ("pos", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("max_pages", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("num_slots", ctypes.c_int64),
        ("kv_slot_bytes", ctypes.c_int64),
        ("kv_type", ctypes.c_int64),
        ("threads", ctypes.c_int64),
    ]


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("FT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ft")
    return pathlib.Path(root) / "kernels"


def build_library(march: str = "native", sanitize: bool = False) -> ctypes.CDLL:
    """Compile (once per source, compiler, CPU, `march` and `sanitize`) and load the kernels.

    `march="x86-64"` builds the portable C++ paths (no AVX2): the tests check them against the
    native build. `sanitize` builds with AddressSanitizer and UBSan (`SANITIZE_FLAGS`); loading
    that library needs the ASan runtime preloaded into the process (`sanitizer_runtime`).
    """
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    flags = SANITIZE_FLAGS if sanitize else ["-O3"]
    digest = hashlib.sha256(
        b"".join(path.read_bytes() for path in (SOURCE, *INCLUDES))
        + version.encode()
        + _cpu_key().encode()
        + march.encode()
        + " ".join(flags).encode()
    )
    key = digest.hexdigest()[:16]
    target = _cache_dir() / f"ftkernels-{key}{'-asan' if sanitize else ''}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = pathlib.Path(tmp) / target.name
            cmd = [
                cxx,
                *flags,
                f"-march={march}",
                "-fopenmp",
                "-shared",
                "-fPIC",
                "-o",
                str(out),
                str(SOURCE),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-400:]}")
            os.replace(out, target)  # atomic: concurrent builders leave one complete file
    lib = ctypes.CDLL(str(target))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.ft_last_error.argtypes = []
    lib.ft_last_error.restype = ctypes.c_char_p
    lib.ft_quantize_q8.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i32]
    lib.ft_gemm.argtypes = [i32, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i32]
    lib.ft_dequantize_rows.argtypes = [i32, ptr, i64, i64, i64, i64, ptr, i64, ptr]
    lib.ft_repack_columns.argtypes = []
    lib.ft_repack.argtypes = [i32, ptr, i64, i64, i64, ptr]
    lib.ft_repacked_row_bytes.argtypes = [i32, i64]
    lib.ft_repacked_row_bytes.restype = i64
    lib.ft_rms_norm.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.c_float, ptr]
    lib.ft_decoder_layer.argtypes = [
        ctypes.POINTER(LayerArgs), ctypes.POINTER(StepArgs), ptr, i64, ptr, ptr, i64, ptr, ptr,
    ]  # fmt: skip
    lib.ft_attention.argtypes = [
        ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, i32,
    ]  # fmt: skip
    lib.ft_struct_layout.argtypes = [i32, ptr, i64]
    lib.ft_struct_layout.restype = ctypes.c_char_p
    for name in ("ft_quantize_q8", "ft_gemm", "ft_dequantize_rows", "ft_repack_columns", "ft_repack",
                 "ft_rms_norm", "ft_decoder_layer", "ft_attention"):  # fmt: skip
        getattr(lib, name).restype = i32
    return lib


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++)")
    return cxx


def sanitizer_runtime() -> str | None:
    """What a process must preload (`LD_PRELOAD`) to load the sanitized kernels, or None when
    the compiler has no ASan runtime (then the sanitized build cannot run here).

    NOTE: the ASan runtime must come first; libstdc++ comes with it because ASan resolves its
    `__cxa_throw` interceptor when it starts, and Python is not linked with libstdc++ (without
    it, the first exception a kernel throws ends the process in an ASan CHECK).
    """
    try:
        cxx = _compiler()
    except RuntimeError:
        return None
    paths = []
    for lib in ("libasan.so", "libstdc++.so"):
        done = subprocess.run([cxx, f"-print-file-name={lib}"], capture_output=True, text=True, check=False)
        path = done.stdout.strip()
        if done.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
            return None
        paths.append(os.path.realpath(path))
    return " ".join(paths)


def check(lib: ctypes.CDLL, code: int) -> None:
    """Raise the error a kernel call returned (its code is not 0).

    Raises:
        KernelError: with the kernel's message.
    """
    if code:
        message = lib.ft_last_error().decode(errors="replace")
        raise KernelError(f"{message} (code {code})")


def library() -> ctypes.CDLL:
    """The compiled kernels (built on first call).

    Raises:
        RuntimeError: no compiler, or the build failed (the message says which).
    """
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                # FT_KERNELS_MARCH (e.g. haswell, x86-64) builds for another instruction set:
                # how the suite is run as it would on another CPU.
                _lib = build_library(
                    os.environ.get("FT_KERNELS_MARCH") or "native",
                    sanitize=os.environ.get("FT_KERNELS_SANITIZE") == "1",
                )
            except (RuntimeError, OSError) as exc:
                _error = str(exc)
        if _lib is None:
            raise RuntimeError(f"quantized kernels unavailable: {_error}")
        return _lib


def build_error() -> str | None:
    """Why the kernels could not be built here (None: they were, or no one tried yet)."""
    return _error


def available() -> bool:
    """Whether the kernels can be built and loaded here."""
    try:
        library()
    except RuntimeError:
        return False
    return True


class QuantizedActivations:
    """`x` `[M, K]` as int8 blocks of 32 with a scale, a scaled sum and an integer sum per block."""

    __slots__ = ("qs", "d", "s", "sx", "rows", "cols")

    def __init__(self, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> None:
        assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape)
        self.rows, self.cols = x.shape
        if self.cols % QK:
            raise ValueError(f"row length {self.cols} is not a multiple of {QK}")
        self.qs = torch.empty(self.rows, self.cols, dtype=torch.int8)
        self.d = torch.empty(self.rows, self.cols // QK, dtype=torch.float32)
        self.s = torch.empty_like(self.d)
        self.sx = torch.empty(self.rows, self.cols // QK, dtype=torch.int32)
        lib = lib or library()
        check(lib, lib.ft_quantize_q8(
            x.data_ptr(), self.rows, self.cols, x.stride(0), self.qs.data_ptr(), self.d.data_ptr(),
            self.s.data_ptr(), self.sx.data_ptr(), torch.get_num_threads(),
        ))  # fmt: skip


def gemm_into(
    out: torch.Tensor,  # [M, >= N] float32, row-major rows (a column slice is fine)
    weight: QuantTensor,
    x: QuantizedActivations,
    lib: ctypes.CDLL | None = None,
) -> None:
    """`out[:, :N] = x @ W.T` for `W` stored as GGUF blocks (or repacked groups of them)."""
    data = weight.data
    lib = lib or library()
    if weight.columns and lib.ft_repack_columns() != weight.columns:
        raise ValueError(f"weights repacked for {weight.columns} columns, this build multiplies rows")
    assert out.dtype == torch.float32 and out.stride(1) == 1 and out.shape[0] == x.rows
    assert data.dtype == torch.uint8 and data.is_contiguous() and weight.cols == x.cols
    check(lib, lib.ft_gemm(
        weight.qtype, data.data_ptr(), weight.rows, weight.cols, data.shape[1], weight.columns,
        x.qs.data_ptr(), x.d.data_ptr(), x.s.data_ptr(), x.sx.data_ptr(), x.rows, out.data_ptr(),
        out.stride(0), torch.get_num_threads(),
    ))  # fmt: skip


# the types with column kernels
REPACKABLE = (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, Q5_K, IQ4_XS, IQ4_NL, Q5_0, Q5_1, Q3_K, Q2_K, F16, BF16)
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # KV cache element types
# --kv-cache-dtype q8_0 (packed path only): each head of a slot is head_dim / 32 blocks of GGUF's
# Q8_0 layout, an IEEE half scale d then 32 int8 values (element = value * d), 34 bytes per 32
# elements; the caches are uint8 `[layers, num_slots, kv_heads, head_dim // 32 * 34]`.
Q8_0_KV = "q8_0"  # ft.config.Q8_0_KV_PATH says where it runs
Q8_0_KV_CODE = 3
Q8_0_KV_BLOCK_BYTES = 34
KVDtype = torch.dtype | str  # a torch dtype, or Q8_0_KV


def kv_code(kv_dtype: KVDtype) -> int:
    """The kernels' KV type of `kv_dtype`.

    Raises:
        ValueError: the packed kernels cannot store it.
    """
    if kv_dtype == Q8_0_KV:
        return Q8_0_KV_CODE
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in KV_TYPES:
        return KV_TYPES[kv_dtype]
    raise ValueError(f"the packed kernels store no KV cache of {kv_dtype}")


def kv_head_bytes(kv_dtype: KVDtype, head_dim: int) -> int:
    """Bytes one head of one slot takes in a KV cache of `kv_dtype`.

    Raises:
        ValueError: q8_0 with a head_dim that is not a multiple of 32.
    """
    if kv_dtype == Q8_0_KV:
        if head_dim % QK:
            raise ValueError(
                f"--kv-cache-dtype q8_0 stores blocks of {QK}; this model's heads of {head_dim} are "
                f"not a multiple of {QK} (use float16)"
            )
        return head_dim // QK * Q8_0_KV_BLOCK_BYTES
    assert isinstance(kv_dtype, torch.dtype), kv_dtype
    return head_dim * torch.empty(0, dtype=kv_dtype).element_size()


def kv_cache_layout(kv_dtype: KVDtype, head_dim: int) -> tuple[int, torch.dtype]:
    """The last dimension and element dtype of a cache `[..., kv_heads, last]` of `kv_dtype`."""
    if kv_dtype == Q8_0_KV:
        return kv_head_bytes(kv_dtype, head_dim), torch.uint8
    assert isinstance(kv_dtype, torch.dtype), kv_dtype
    return head_dim, kv_dtype


def kv_code_of(cache: torch.Tensor) -> int:
    """The kernels' KV type of a cache tensor (uint8: q8_0 blocks)."""
    return Q8_0_KV_CODE if cache.dtype == torch.uint8 else kv_code(cache.dtype)


def dequantize_q8_0_kv(cache: torch.Tensor) -> torch.Tensor:
    """A q8_0 cache `[..., B * 34]` uint8 as float32 `[..., B * 32]` (tests, measurements)."""
    blocks = cache.contiguous().view(*cache.shape[:-1], -1, Q8_0_KV_BLOCK_BYTES)  # [..., B, 34]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., B, 1]
    qs = blocks[..., 2:].contiguous().view(torch.int8).float()  # [..., B, 32]
    return (qs * d).flatten(-2)


def repacked(weight: QuantTensor, lib: ctypes.CDLL | None = None) -> QuantTensor:
    """`weight` in the interleaved layout of the column kernels of this build (16 columns with
    AVX-512 VNNI, 8 with AVX2) when its type and row count allow; otherwise unchanged. The same
    bytes reordered, but for the 6-bit scales unpacked to bytes: Q4_K 148 bytes per 256, not 144;
    Q5_K 180, not 176; IQ4_XS 138, not 136; Q3_K 114, not 110."""
    lib = lib or library()
    columns = lib.ft_repack_columns()
    if weight.columns or not columns or weight.qtype not in REPACKABLE or weight.rows % columns:
        return weight
    row_bytes = lib.ft_repacked_row_bytes(weight.qtype, weight.cols)
    if not row_bytes:  # no column kernels for this type on this build
        return weight
    src = weight.data.contiguous()
    dst = torch.empty(weight.rows, row_bytes, dtype=torch.uint8)
    check(
        lib,
        lib.ft_repack(weight.qtype, src.data_ptr(), weight.rows, weight.cols, src.shape[1], dst.data_ptr()),
    )
    return QuantTensor(dst, weight.qtype, weight.cols, columns)


def expert_views(
    stack: np.ndarray, qtype: int, cols: int, lib: ctypes.CDLL | None = None
) -> list[QuantTensor]:
    """Each expert of a GGUF expert stack (uint8 `[experts, rows, row_bytes]` blocks of `qtype`,
    e.g. a view of the mapped file) as a `QuantTensor` view into one buffer: repacked for this
    build's column kernels where `repacked` would repack one of them, else the bytes copied once."""
    experts, rows, row_bytes = stack.shape
    lib = lib or library()
    columns = lib.ft_repack_columns()
    repackable = columns and qtype in REPACKABLE and rows % columns == 0
    repacked_bytes = lib.ft_repacked_row_bytes(qtype, cols) if repackable else 0
    if not repacked_bytes:
        data = torch.from_numpy(np.array(stack, dtype=np.uint8, copy=True))
        return [QuantTensor(data[e], qtype, cols) for e in range(experts)]
    src = np.ascontiguousarray(stack)
    dst = torch.empty(experts, rows, repacked_bytes, dtype=torch.uint8)
    for e in range(experts):
        check(lib, lib.ft_repack(qtype, src[e].ctypes.data, rows, cols, row_bytes, dst[e].data_ptr()))
    return [QuantTensor(dst[e], qtype, cols, columns) for e in range(experts)]


def dequantize_rows(weight: QuantTensor, ids: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows `ids` `[T]` of `weight` as float32 `[T, cols]`."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], weight.cols)
    lib = lib or library()
    check(lib, lib.ft_dequantize_rows(
        weight.qtype, weight.data.data_ptr(), weight.rows, weight.data.shape[1], weight.columns, weight.cols,
        ids.data_ptr(), ids.shape[0], out.data_ptr(),
    ))  # fmt: skip
    return out


def attention(
    q: torch.Tensor,  # [T, nh * hd] float32
    k_cache: torch.Tensor,  # [num_slots, nkvh, hd] float32/float16/bfloat16; q8_0: uint8 [.., hd // 32 * 34]
    v_cache: torch.Tensor,
    seq: torch.Tensor,  # [T] int64: the row's sequence (a row of block_tables)
    pos: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [S, max_pages] int32
    page_size: int,
    num_heads: int,
) -> torch.Tensor:
    """Paged attention of each row over positions 0..pos of its sequence → `[T, nh * hd]`."""
    assert q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dim() == 2
    q, seq, pos, tables = q.contiguous(), seq.contiguous(), pos.contiguous(), block_tables.contiguous()
    kv_type = kv_code_of(k_cache)
    num_slots, kv_heads, last = k_cache.shape
    head_dim = last // Q8_0_KV_BLOCK_BYTES * QK if kv_type == Q8_0_KV_CODE else last
    if q.shape[1] != num_heads * head_dim:
        raise KernelError(f"queries of {q.shape[1]} for {num_heads} heads of {head_dim}")
    out = torch.empty_like(q)
    lib = library()
    check(lib, lib.ft_attention(
        q.data_ptr(), q.shape[0], k_cache.data_ptr(), v_cache.data_ptr(), num_slots,
        k_cache[0].numel() * k_cache.element_size(), seq.data_ptr(), tables.shape[0], pos.data_ptr(),
        tables.data_ptr(), tables.shape[1], page_size, num_heads, kv_heads, head_dim, out.data_ptr(), kv_type,
    ))  # fmt: skip
    return out
