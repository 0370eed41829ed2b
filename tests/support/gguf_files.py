"""GGUF files for the untrusted-input tests: a tiny valid model, and byte-level edits of any GGUF.

`write_tiny_gguf` builds a 2-layer Llama with `gguf.GGUFWriter`, its weights by default in
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and F16 (any other types with `layer_types`). `RawGGUF` reads any
GGUF's header into editable records (typed metadata payloads, tensor infos) and writes it back
with the tensor bytes copied verbatim, so one edit changes one field and nothing else, as an
attacker's would.
"""

from __future__ import annotations

import pathlib
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from ft.tokenizer.spec import bytes_to_unicode

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FORMATS = {
    U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
    U64: "<Q", I64: "<q", F64: "<d",
}  # fmt: skip

TINY_HIDDEN, TINY_HEADS, TINY_KV_HEADS, TINY_FFN, TINY_LAYERS = 256, 4, 2, 512, 2
TINY_HEAD_DIM = TINY_HIDDEN // TINY_HEADS
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Default layer weight types: the first packed kernel types, and F16.
LAYER_TYPES = {
    "attn_q": GGMLQuantizationType.Q4_K,
    "attn_k": GGMLQuantizationType.Q4_0,
    "attn_v": GGMLQuantizationType.Q4_1,
    "attn_output": GGMLQuantizationType.Q6_K,
    "ffn_gate": GGMLQuantizationType.Q8_0,
    "ffn_up": GGMLQuantizationType.F16,
    "ffn_down": GGMLQuantizationType.Q4_K,
}
_K_SCALES = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}
# fp16 scale fields (byte offsets in a block) of the other types gguf-py cannot quantize
_K_SCALES |= {
    GGMLQuantizationType.Q2_K: (80, 82), GGMLQuantizationType.Q3_K: (108,), GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.IQ4_XS: (0,), GGMLQuantizationType.IQ4_NL: (0,), GGMLQuantizationType.IQ2_XXS: (0,),
}  # fmt: skip


def _packed(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights `[rows, cols]` as GGUF blocks of `qtype` (uint8 `[rows, row_bytes]`)."""
    if qtype == GGMLQuantizationType.F16:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)
    if qtype == GGMLQuantizationType.BF16:
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return np.ascontiguousarray((values.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
    if qtype in _K_SCALES:  # gguf-py cannot quantize K-quants: random blocks with sane scales
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        scales = rng.uniform(0.0005, 0.002, size=(rows, cols // block)).astype(np.float16)
        for at in _K_SCALES[qtype]:
            raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
        return raw.reshape(rows, -1)
    return np.asarray(quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype))


def tiny_tokens() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the specials, the 256 byte symbols and a few merges."""
    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "e l", "el l", "ell o", "H ell"]
    merged = ["Ġt", "he", "Ġthe", "el", "ell", "ello", "Hell"]
    tokens = [*SPECIALS, *symbols, *merged]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def write_tiny_gguf(
    path: pathlib.Path,
    *,
    seed: int = 0,
    tied: bool = False,
    layer_types: dict[str, GGMLQuantizationType] | None = None,
    embedding_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    pooling_type: int | None = None,
) -> pathlib.Path:
    """A tiny random-weight Llama GGUF (2 layers, hidden 256, GQA 4/2) at `path`; its layer
    weights of `layer_types` (default `LAYER_TYPES`), its embedding of `embedding_type`; with
    `pooling_type`, its `llama.pooling_type` (llama.cpp's numbering: 1 mean, 2 cls, 3 last)."""
    layer_types = layer_types or LAYER_TYPES
    rng = np.random.default_rng(seed)
    tokens, merges, types = tiny_tokens()
    vocab = len(tokens)
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-untrusted")
    w.add_block_count(TINY_LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(TINY_HIDDEN)
    w.add_feed_forward_length(TINY_FFN)
    w.add_head_count(TINY_HEADS)
    w.add_head_count_kv(TINY_KV_HEADS)
    w.add_rope_dimension_count(TINY_HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    if pooling_type is not None:
        w.add_uint32("llama.pooling_type", pooling_type)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add(name: str, qtype: GGMLQuantizationType, rows: int, cols: int) -> None:
        data = _packed(qtype, rows, cols, rng)
        raw_dtype = None if qtype == GGMLQuantizationType.F16 else qtype
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    add("token_embd.weight", embedding_type, vocab, TINY_HIDDEN)
    q, kv = TINY_HEADS * TINY_HEAD_DIM, TINY_KV_HEADS * TINY_HEAD_DIM
    shapes = {
        "attn_q": (q, TINY_HIDDEN), "attn_k": (kv, TINY_HIDDEN), "attn_v": (kv, TINY_HIDDEN),
        "attn_output": (TINY_HIDDEN, q), "ffn_gate": (TINY_FFN, TINY_HIDDEN),
        "ffn_up": (TINY_FFN, TINY_HIDDEN), "ffn_down": (TINY_HIDDEN, TINY_FFN),
    }  # fmt: skip
    for i in range(TINY_LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm(TINY_HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm(TINY_HIDDEN))
        for part, (rows, cols) in shapes.items():
            add(f"blk.{i}.{part}.weight", layer_types[part], rows, cols)
    w.add_tensor("output_norm.weight", norm(TINY_HIDDEN))
    if not tied:
        add("output.weight", GGMLQuantizationType.Q6_K, vocab, TINY_HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def default_model_raw() -> RawGGUF:
    """The cached default model's header (skips the test when it is not cached)."""
    import pytest

    from ft.model.pull import cached_model_path

    path = cached_model_path()
    if not path.exists():
        pytest.skip("the default model is not cached (run `ft pull`)")
    return RawGGUF.read(path)


# ---- byte-level edits ----


def scalar(kind: int, value: float | int | bool) -> bytes:
    """The payload of one scalar value."""
    return struct.pack(SCALAR_FORMATS[kind], value)


def string(text: str | bytes) -> bytes:
    """The payload of one string value (a u64 length, then the bytes)."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def array(item: int, payloads: list[bytes], count: int | None = None) -> bytes:
    """The payload of an array of `item` values (`count` may lie about how many follow)."""
    return struct.pack("<IQ", item, len(payloads) if count is None else count) + b"".join(payloads)


def nested_array(depth: int) -> bytes:
    """An array of one array of one array ... `depth` deep, with one u8 at the bottom."""
    payload = array(U8, [scalar(U8, 7)])
    for _ in range(depth - 1):
        payload = array(ARRAY, [payload])
    return payload


@dataclass(frozen=True, slots=True)
class KV:
    """One metadata pair: its key, value type and encoded value."""

    key: str
    kind: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor info: name, dims (fastest first, as stored), type and data offset."""

    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int


@dataclass(frozen=True, slots=True)
class Regions:
    """Where each part of a written file starts (the end of one is the start of the next)."""

    kv: int
    tensor_infos: int
    data: int
    end: int


@dataclass(slots=True)
class RawGGUF:
    """A GGUF file's header as editable records; tensor bytes stay in `source`."""

    source: pathlib.Path
    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    data_start: int  # in `source`
    alignment: int = 32
    num_kv: int | None = None  # None: len(kvs); else what the header claims
    num_tensors: int | None = None

    @classmethod
    def read(cls, path: pathlib.Path) -> RawGGUF:
        """Parse a (valid) GGUF's header."""
        buf = _head(path)
        pos = 4
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, pos)
        pos += 20
        kvs = []
        for _ in range(num_kv):
            key, pos = _read_string(buf, pos)
            kind = struct.unpack_from("<I", buf, pos)[0]
            end = _skip_value(buf, pos + 4, kind)
            kvs.append(KV(key.decode(), kind, buf[pos + 4 : end]))
            pos = end
        tensors = []
        for _ in range(num_tensors):
            name, pos = _read_string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            kind, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            tensors.append(TensorInfo(name.decode(), tuple(dims), kind, offset))
        raw = cls(path, version, kvs, tensors, 0)
        align_kv = raw.get("general.alignment")
        raw.alignment = struct.unpack("<I", align_kv.payload)[0] if align_kv else 32
        raw.data_start = -(-pos // raw.alignment) * raw.alignment
        return raw

    def get(self, key: str) -> KV | None:
        """The pair named `key`, if any."""
        return next((kv for kv in self.kvs if kv.key == key), None)

    def set(self, key: str, kind: int, payload: bytes) -> RawGGUF:
        """Replace (or append) the value of `key`."""
        out = self.copy()
        new = KV(key, kind, payload)
        at = [i for i, kv in enumerate(out.kvs) if kv.key == key]
        if at:
            out.kvs[at[0]] = new
        else:
            out.kvs.append(new)
        return out

    def drop(self, key: str) -> RawGGUF:
        """Remove `key`."""
        out = self.copy()
        out.kvs = [kv for kv in out.kvs if kv.key != key]
        return out

    def retensor(self, name: str, **changes: object) -> RawGGUF:
        """Change one tensor info's `dims`, `kind` or `offset` (its bytes stay where they are)."""
        out = self.copy()
        out.tensors = [replace(t, **changes) if t.name == name else t for t in out.tensors]  # type: ignore[arg-type]
        return out

    def copy(self) -> RawGGUF:
        """An independent copy of the records."""
        return replace(self, kvs=list(self.kvs), tensors=list(self.tensors))

    def tensor(self, name: str) -> TensorInfo:
        """The info of tensor `name`."""
        return next(t for t in self.tensors if t.name == name)

    def header(self) -> tuple[bytes, Regions]:
        """The header bytes, padded to the data section, and where each region starts."""
        out = bytearray(b"GGUF")
        num_kv = len(self.kvs) if self.num_kv is None else self.num_kv
        num_tensors = len(self.tensors) if self.num_tensors is None else self.num_tensors
        out += struct.pack("<IQQ", self.version, num_tensors, num_kv)
        kv_at = len(out)
        for kv in self.kvs:
            out += string(kv.key) + struct.pack("<I", kv.kind) + kv.payload
        infos_at = len(out)
        for t in self.tensors:
            out += string(t.name) + struct.pack("<I", len(t.dims))
            out += struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", t.kind, t.offset)
        data_at = -(-len(out) // self.alignment) * self.alignment
        out += bytes(data_at - len(out))
        return bytes(out), Regions(kv_at, infos_at, data_at, 0)

    def write(self, path: pathlib.Path, truncate_at: int | None = None) -> Regions:
        """Write header + the source's tensor bytes verbatim (cut at `truncate_at` bytes)."""
        head, regions = self.header()
        with path.open("wb") as out, self.source.open("rb") as src:
            out.write(head)
            src.seek(self.data_start)
            shutil.copyfileobj(src, out, 1 << 22)
            end = out.tell()
            if truncate_at is not None:
                out.truncate(truncate_at)
        return replace(regions, end=end)


def _head(path: pathlib.Path) -> bytes:
    """The first bytes of a large file: enough for any header we read (metadata + infos)."""
    with path.open("rb") as f:
        return f.read(64 << 20)


def _read_string(buf: bytes, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8 : pos + 8 + n], pos + 8 + n


def _skip_value(buf: bytes, pos: int, kind: int) -> int:
    if kind == STRING:
        return _read_string(buf, pos)[1]
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in SCALAR_FORMATS:
            return pos + count * struct.calcsize(SCALAR_FORMATS[item])
        for _ in range(count):
            pos = _skip_value(buf, pos, item)
        return pos
    return pos + struct.calcsize(SCALAR_FORMATS[kind])


# ---- issue 19's table ----

Edit = Callable[["RawGGUF"], "RawGGUF"]


def u32(key: str, value: int) -> Edit:
    """Set `key` to a u32."""
    return lambda raw: raw.set(key, U32, scalar(U32, value))


def u64(key: str, value: int) -> Edit:
    """Set `key` to a u64."""
    return lambda raw: raw.set(key, U64, scalar(U64, value))


def dims(name: str, *new: int) -> Edit:
    """Make tensor `name` claim dims `new` (fastest first)."""
    return lambda raw: raw.retensor(name, dims=new)


def issue_cases(hidden: int, ffn: int, kv_heads: int, heads: int) -> dict[str, tuple[Edit, str]]:
    """Issue 19's table, for a model of these sizes: each edit and the name its error must give."""
    return {
        "embedding_length doubled": (u32("llama.embedding_length", 2 * hidden), "llama.embedding_length"),
        "embedding_length x4096": (u32("llama.embedding_length", hidden * 4096), "llama.embedding_length"),
        "token_embd half as wide": (
            lambda r: r.retensor(
                "token_embd.weight", dims=(hidden // 2, r.tensor("token_embd.weight").dims[1])
            ),
            "token_embd.weight",
        ),
        "feed_forward_length x256": (u32("llama.feed_forward_length", ffn * 256), "ffn_gate.weight"),
        "feed_forward_length 2^40": (u64("llama.feed_forward_length", 1 << 40), "llama.feed_forward_length"),
        "head_count_kv 1": (u32("llama.attention.head_count_kv", 1), "blk.0.attn_k.weight"),
        "attn_v as many rows as attn_q": (
            lambda r: r.retensor("blk.0.attn_v.weight", dims=r.tensor("blk.0.attn_q.weight").dims),
            "blk.0.attn_v.weight",
        ),
        "attn_norm of 0 elements": (dims("blk.0.attn_norm.weight", 0), "blk.0.attn_norm.weight"),
        "head_count doubled": (u32("llama.attention.head_count", 2 * heads), "llama.attention.head_count"),
        "a norm of 1 element": (dims("blk.1.ffn_norm.weight", 1), "blk.1.ffn_norm.weight"),
    }


TINY_CASES = issue_cases(TINY_HIDDEN, TINY_FFN, TINY_KV_HEADS, TINY_HEADS)
DEFAULT_CASES = issue_cases(576, 1536, 3, 9)
