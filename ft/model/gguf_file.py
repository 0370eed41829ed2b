"""A lean GGUF reader: metadata and tensor views straight from a memory map.

`gguf.GGUFReader` builds a numpy object per array element (every vocabulary string), which costs
seconds on a 49k-token vocabulary; this reads the same file in a fraction of that.

A GGUF is untrusted input: every count, length, type, dimension and offset is checked against
the bytes that are actually there before it is used, so any file reads in time and memory
bounded by its length, and a malformed one raises `ModelFileError` naming the key or tensor.
Each tensor's data must lie in the file, aligned, on bytes no other tensor claims.
"""

from __future__ import annotations

import math
import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_INTEGER_KINDS = (0, 1, 2, 3, 4, 5, 10, 11)

MAX_ARRAY_DEPTH = 4  # metadata arrays of arrays deeper than this are refused (files use 1)
MAX_KEY_BYTES = 65535  # the GGUF spec's bound on key length
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20
# Items in all metadata arrays together: each becomes a Python object (~7 µs and ~60 bytes a
# string here), so a file of 10^8 tiny strings or numbers would take minutes and gigabytes. Real
# files hold well under a million (Gemma 3: 262k tokens, scores and types; Llama 3: 128k tokens
# and 280k merges).
MAX_METADATA_ITEMS = 1 << 22

# Bounds on a model's numbers in its metadata: far above any real model, low enough that no size
# derived from them overflows or allocates without bound before the tensors are compared with them.
MAX_WIDTH = 1 << 20  # hidden size, ffn length
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 12
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 24


class ModelFileError(ValueError):
    """A model file is malformed or disagrees with itself; the message names the key or tensor
    and what was expected."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: its name, type, element shape (slowest dimension first, as torch has it) and
    raw data shaped as `gguf.quants.dequantize` expects."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class _Info:
    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int
    nbytes: int


class GGUFFile:
    """Metadata dict and tensors of one GGUF (v2/v3) file.

    Raises:
        ModelFileError: the file is not a well-formed GGUF (truncated, a count or length larger
            than the file, an unknown type, a tensor outside the data section or overlapping
            another, ...).
    """

    def __init__(self, path: pathlib.Path) -> None:
        size = path.stat().st_size
        if size < 24:
            raise ModelFileError(f"the file has {size} bytes, too few for a GGUF header (truncated?)")
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)
        self._spans: dict[str, tuple[int, int]] = {}
        self.pos = 0
        if bytes(self.buf[:4]) != b"GGUF":
            raise ModelFileError("bad magic (not a GGUF file)")
        self.pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ModelFileError(f"unsupported GGUF version {version}")
        num_tensors, num_kv = self._scalar(10), self._scalar(10)
        self._room("the header's metadata count", num_kv, 13)  # each pair takes at least 13 bytes
        self.fields: dict[str, Any] = {}
        self.kinds: dict[str, int] = {}
        self._items_left = MAX_METADATA_ITEMS
        for i in range(num_kv):
            key = self._string(f"metadata key {i}", MAX_KEY_BYTES)
            if key in self.fields:
                raise ModelFileError(f"metadata key {key!r} appears twice")
            try:
                kind = self._scalar(4)
                self.kinds[key] = kind
                self.fields[key] = self._value(kind, 0)
            except ModelFileError as e:
                raise ModelFileError(f"metadata key {key!r}: {e}") from None
        self._room("the header's tensor count", num_tensors, 24)  # name, dims, type, offset
        infos = [self._info(i) for i in range(num_tensors)]
        align = self._alignment()
        start = -(-self.pos // align) * align
        self.data_start = start
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for info in infos:
            if info.name in seen:
                raise ModelFileError(f"tensor {info.name} appears twice")
            seen.add(info.name)
            if info.offset % align:
                raise ModelFileError(
                    f"tensor {info.name}: data offset {info.offset} is not a multiple of the "
                    f"alignment {align}"
                )
            if start + info.offset + info.nbytes > len(self.buf):
                raise ModelFileError(
                    f"tensor {info.name}: {info.nbytes} bytes at offset {info.offset} run past the end "
                    f"of the file ({len(self.buf)} bytes; truncated download?)"
                )
        _check_disjoint(infos)
        for info in infos:
            raw = self.buf[start + info.offset : start + info.offset + info.nbytes]
            self._spans[info.name] = (start + info.offset, info.nbytes)
            self.tensors.append(GGUFTensor(info.name, info.tensor_type, info.shape, _shaped(raw, info)))

    def release(self, tensor: GGUFTensor) -> None:
        """Drop `tensor`'s pages from this process's resident memory once it has been read or
        converted: a load then holds each weight once (its converted copy) instead of the copy
        plus the mapped file. The pages stay in the page cache and fault back in if read again,
        so releasing early is never wrong, only slower."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, nbytes = self._spans[tensor.name]
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(len(self.buf), -(-(start + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _info(self, i: int) -> _Info:
        name = self._string(f"tensor {i}'s name", MAX_KEY_BYTES)
        n_dims = self._scalar(4)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelFileError(f"tensor {name}: {n_dims} dimensions (expected 1 to {MAX_DIMS})")
        dims = [self._scalar(10) for _ in range(n_dims)]
        code = self._scalar(4)
        try:
            tensor_type = GGMLQuantizationType(code)
            block, type_size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise ModelFileError(f"tensor {name}: unknown tensor type {code}") from None
        offset = self._scalar(10)
        if dims[0] % block:
            raise ModelFileError(
                f"tensor {name}: a row of {dims[0]} elements is not whole {tensor_type.name} "
                f"blocks of {block}"
            )
        nbytes = math.prod(dims) // block * type_size  # Python ints: no overflow
        shape = tuple(reversed(dims))  # GGUF lists the fastest dimension first
        return _Info(name, shape, tensor_type, offset, nbytes)

    def _alignment(self) -> int:
        if "general.alignment" not in self.fields:
            return 32
        align = self.fields["general.alignment"]
        if self.kinds["general.alignment"] not in _INTEGER_KINDS or not 1 <= align <= MAX_ALIGNMENT:
            raise ModelFileError(
                f"metadata key 'general.alignment': expected a power of two from 1 to {MAX_ALIGNMENT}, "
                f"found {align!r}"
            )
        if align & (align - 1):
            raise ModelFileError(f"metadata key 'general.alignment': {align} is not a power of two")
        return int(align)

    def _room(self, what: str, count: int, min_bytes: int) -> None:
        """Refuse a count whose items cannot fit in the rest of the file (before allocating)."""
        left = len(self.buf) - self.pos
        if count * min_bytes > left:
            raise ModelFileError(
                f"{what} is {count}, but only {left} bytes follow (room for at most {left // min_bytes}; "
                "truncated file?)"
            )

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ModelFileError("unexpected end of GGUF header (truncated file?)")
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def _scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self, what: str = "a string", limit: int | None = None) -> str:
        n = self._scalar(10)
        if limit is not None and n > limit:
            raise ModelFileError(f"{what} is {n} bytes long (at most {limit})")
        self._room(f"{what}'s length", n, 1)
        return self._take(n).decode("utf-8", errors="replace")

    def _value(self, kind: int, depth: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ModelFileError(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
            item, count = self._scalar(4), self._scalar(10)
            self._items_left -= count
            if self._items_left < 0:
                raise ModelFileError(f"the metadata's arrays hold more than {MAX_METADATA_ITEMS} items")
            if item == _STRING:
                self._room("an array of strings' length", count, 8)
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                self._room("an array of arrays' length", count, 12)
                return [self._value(_ARRAY, depth + 1) for _ in range(count)]
            if item not in _NUMPY:
                raise ModelFileError(f"unknown array item type {item}")
            dt = np.dtype(_NUMPY[item])
            self._room("an array's length", count, dt.itemsize)
            return np.frombuffer(self._take(dt.itemsize * count), dtype=dt).tolist()
        if kind not in _SCALARS:
            raise ModelFileError(f"unknown value type {kind}")
        return self._scalar(kind)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default`."""
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value; a clear error when missing."""
        if key not in self.fields:
            raise ModelFileError(f"GGUF file lacks required metadata key {key!r}")
        return self.fields[key]

    def integer(self, key: str, low: int, high: int, default: int | None = None) -> int:
        """An integer value of `key` in [low, high] (`default` when absent; required if None)."""
        if key not in self.fields and default is not None:
            return default
        value = self.require(key)
        if self.kinds[key] not in _INTEGER_KINDS or not low <= value <= high:
            raise ModelFileError(
                f"metadata key {key!r}: expected an integer from {low} to {high}, found {value!r}"
            )
        return int(value)

    def number(self, key: str, low: float, high: float, default: float) -> float:
        """A finite number value of `key` in [low, high] (`default` when absent)."""
        if key not in self.fields:
            return default
        value = self.fields[key]
        if (
            self.kinds[key] not in (*_INTEGER_KINDS, 6, 12)
            or not math.isfinite(value)
            or not low <= value <= high
        ):
            raise ModelFileError(
                f"metadata key {key!r}: expected a finite number from {low:g} to {high:g}, found {value!r}"
            )
        return float(value)

    def text(self, key: str, default: str | None = None) -> str | None:
        """A string value of `key` (`default` when absent)."""
        if key not in self.fields:
            return default
        if self.kinds[key] != _STRING:
            raise ModelFileError(f"metadata key {key!r}: expected a string, found {self.fields[key]!r:.80}")
        return str(self.fields[key])


def _check_disjoint(infos: list[_Info]) -> None:
    """No two tensors share a byte of the data section (sorted by offset: O(n log n)).

    NOTE: a writer gives each tensor its own bytes (llama.cpp even requires each to start where
    the one before it ends, padded); an offset moved onto a neighbour's bytes reads them as
    weights (a norm of 1e30 read from packed blocks), and the model then generates garbage until
    its context ends instead of failing.

    Raises:
        ModelFileError: naming both tensors and their byte ranges.
    """
    furthest: _Info | None = None  # of the tensors so far, the one whose data ends last
    for info in sorted((i for i in infos if i.nbytes), key=lambda i: i.offset):
        if furthest is not None and info.offset < furthest.offset + furthest.nbytes:
            raise ModelFileError(
                f"tensor {info.name}: its data (bytes {info.offset} to {info.offset + info.nbytes} of the "
                f"data section) overlaps tensor {furthest.name}'s ({furthest.offset} to "
                f"{furthest.offset + furthest.nbytes}); each tensor must have bytes of its own"
            )
        if furthest is None or info.offset + info.nbytes > furthest.offset + furthest.nbytes:
            furthest = info


def _shaped(raw: np.ndarray, info: _Info) -> np.ndarray:
    """A tensor's bytes viewed as its floats, or as rows of its blocks."""
    if info.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if info.tensor_type == GGMLQuantizationType.F32 else np.float16
        return raw.view(dtype).reshape(info.shape)
    block, type_size = GGML_QUANT_SIZES[info.tensor_type]
    return raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
