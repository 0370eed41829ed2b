"""Model files are untrusted input: a GGUF whose metadata or tensors lie ends in a named error or a
correct load and generation, never a signal, a hang or unbounded memory.

Every file is loaded in a probe process (`tests.support.gguf_probe`) under a timeout and an
address-space limit, so a crash is a failed test, not a dead pytest. The cases of issue 19's
table (found on the default model) run on a tiny random model in the fast suite and on the
default model itself under `slow`; hypothesis picks further one-field edits of either.
"""

from __future__ import annotations

import math
import pathlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.model import kernels
from ft.model.gguf_file import MAX_METADATA_ITEMS
from tests.support.gguf_files import (
    ARRAY,
    BOOL,
    DEFAULT_CASES,
    F32,
    F64,
    I32,
    STRING,
    TINY_CASES,
    TINY_FFN,
    TINY_HEADS,
    TINY_KV_HEADS,
    TINY_LAYERS,
    U8,
    U32,
    U64,
    RawGGUF,
    array,
    nested_array,
    scalar,
    string,
    u32,
)
from tests.support.gguf_probe import Outcome, Prober, assert_clean, assert_refused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")


def load(prober: Prober, raw: RawGGUF, path: pathlib.Path, dtype: str = "auto", **write: int) -> Outcome:
    """Write `raw` to `path` and load it in the probe process."""
    raw.write(path, **write)
    return prober.run(path, dtype)


def test_the_tiny_model_loads_and_generates_the_same_tokens_packed_and_float(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """The corpus' starting point is a correct file: packed and float32 loads generate."""
    packed = load(prober, tiny, tmp_path / "tiny.gguf")
    floats = prober.run(tmp_path / "tiny.gguf", "float32")
    assert_clean(packed)
    assert packed.kind == "loaded" and packed.tokens == floats.tokens


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_issue_cases_are_named_errors_on_the_tiny_model(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, case: str, dtype: str
) -> None:
    """Each edit of issue 19's table (heap writes on the packed path) is refused at load,
    naming the tensor or key, on the packed path and on the float path."""
    edit, name = TINY_CASES[case]
    assert_refused(load(prober, edit(tiny), tmp_path / "evil.gguf", dtype), name)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("case", sorted(DEFAULT_CASES))
def test_issue_cases_are_named_errors_on_the_default_model(
    prober: Prober, default_model: RawGGUF, tmp_path: pathlib.Path, case: str, dtype: str
) -> None:
    """The same edits of the default model's file, which crashed `ft generate` (SIGSEGV,
    SIGABRT) or generated garbage before."""
    edit, name = DEFAULT_CASES[case]
    assert_refused(load(prober, edit(default_model), tmp_path / "evil.gguf", dtype), name)


@pytest.mark.parametrize("key", ["head_count_kv", "head_count", "feed_forward_length"])
def test_per_layer_arrays_of_one_value_load_like_the_scalar(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, key: str
) -> None:
    """llama.cpp reads head counts and ffn lengths as a scalar or one value per layer; a file
    with an array of equal values loads and generates what the scalar file does, and layers of
    different sizes (or an array that is not one per layer) are a named error."""
    key = ("llama." if key == "feed_forward_length" else "llama.attention.") + key
    value = {"llama.attention.head_count_kv": TINY_KV_HEADS, "llama.attention.head_count": TINY_HEADS}.get(
        key, TINY_FFN
    )
    scalar_run = load(prober, tiny, tmp_path / "scalar.gguf")
    per_layer = array(U32, [scalar(U32, value)] * TINY_LAYERS)
    array_run = load(prober, tiny.set(key, ARRAY, per_layer), tmp_path / "arrays.gguf")
    assert array_run.kind == "loaded", array_run.detail
    assert array_run.tokens == scalar_run.tokens
    uneven = array(U32, [scalar(U32, value), scalar(U32, value // 2)])
    assert_refused(load(prober, tiny.set(key, ARRAY, uneven), tmp_path / "uneven.gguf"), key, "different")
    short = array(U32, [scalar(U32, value)] * (TINY_LAYERS + 1))
    assert_refused(load(prober, tiny.set(key, ARRAY, short), tmp_path / "short.gguf"), key, "per layer")


@pytest.mark.parametrize("context", [1, 2])
def test_a_context_of_a_token_or_two_loads_and_runs_within_it(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, context: int
) -> None:
    """(The corpus drew `llama.context_length = 1`: the probe then fed past it.)"""
    outcome = load(prober, u32("llama.context_length", context)(tiny), tmp_path / "c.gguf")
    assert outcome.kind == "loaded", outcome.detail
    assert_clean(outcome)


def test_alignment_zero_is_a_named_error(prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path) -> None:
    """`general.alignment = 0` (a ZeroDivisionError before) names the key."""
    assert_refused(load(prober, u32("general.alignment", 0)(tiny), tmp_path / "a.gguf"), "general.alignment")


def test_deeply_nested_metadata_is_a_named_error(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """An array nested 100,000 deep (a RecursionError before) names its key and the depth."""
    raw = tiny.set("general.evil", ARRAY, nested_array(100_000))
    assert_refused(load(prober, raw, tmp_path / "deep.gguf"), "general.evil", "nested")


@pytest.mark.parametrize(
    ("what", "payload", "kind"),
    [
        ("string", struct.pack("<Q", 1 << 40) + b"x", STRING),
        ("array of u8", array(U8, [scalar(U8, 1)], count=1 << 40), ARRAY),
        ("array of strings", array(STRING, [string("x")], count=1 << 40), ARRAY),
        ("array of arrays", array(ARRAY, [array(U8, [])], count=1 << 40), ARRAY),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_huge_claimed_lengths_are_refused_before_reading(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, what: str, payload: bytes, kind: int
) -> None:
    """A length of 2^40 with a few bytes behind it is refused at once (bounded time and memory:
    the probe runs under an address-space limit), naming the key."""
    raw = tiny.set("general.evil", kind, payload)
    assert_refused(load(prober, raw, tmp_path / "huge.gguf"), "general.evil")


def test_a_real_huge_string_and_array_load(prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path) -> None:
    """Large values that are really there (4 MiB) cost what they weigh and the model loads."""
    raw = tiny.set("general.description", STRING, string("x" * (4 << 20)))
    raw = raw.set("general.evil", ARRAY, array(U8, [scalar(U8, 7)] * (1 << 20)))
    assert_clean(load(prober, raw, tmp_path / "big.gguf"))


def test_metadata_arrays_of_millions_of_items_are_refused_while_reading(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """A file of 5 million tiny strings (~40 MiB) is refused before they become 5 million
    Python objects: they cost ~7 µs and ~60 bytes each (a 1 GB file of them, minutes and GBs)."""
    raw = tiny.set("general.evil", ARRAY, array(STRING, [string("")] * (MAX_METADATA_ITEMS + 1)))
    assert_refused(load(prober, raw, tmp_path / "items.gguf"), "metadata", "items")


@pytest.mark.parametrize("region", ["header", "kv", "tensor_infos", "data"])
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_a_file_truncated_anywhere_is_a_named_error(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, region: str, where: float
) -> None:
    """Cut at the start, middle or end of every region: "truncated" or a named tensor."""
    _, regions = tiny.header()
    end = tiny.write(tmp_path / "full.gguf").end
    bounds = {
        "header": (4, regions.kv),
        "kv": (regions.kv, regions.tensor_infos),
        "tensor_infos": (regions.tensor_infos, regions.data),
        "data": (regions.data, end),
    }
    low, high = bounds[region]
    cut = low + int((high - low) * where)
    outcome = load(prober, tiny, tmp_path / "cut.gguf", truncate_at=cut)
    assert_refused(outcome)
    assert "truncated" in outcome.detail or "past the end" in outcome.detail, outcome.detail


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "tensor", ["blk.0.attn_norm.weight", "blk.0.attn_v.weight", "blk.1.attn_output.weight"]
)
def test_non_finite_weights_are_named_errors(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, tensor: str, value: float
) -> None:
    """A NaN or Inf in a norm (F32) or in a block's fp16 scale (Q4_1, Q6_K) names the tensor."""
    info = tiny.tensor(tensor)
    at = {0: 0, 3: 0, 14: 208}[info.kind]  # the first value, or the first block's scale
    patch = struct.pack("<f", value) if info.kind == 0 else struct.pack("<e", value)
    path = tmp_path / "nan.gguf"
    tiny.write(path)
    with path.open("r+b") as f:
        f.seek(tiny.header()[1].data + info.offset + at)
        f.write(patch)
    assert_refused(prober.run(path), tensor)


@pytest.mark.parametrize(
    ("key", "kind", "payload"),
    [
        ("llama.rope.freq_base", F32, scalar(F32, math.nan)),
        ("llama.rope.freq_base", F32, scalar(F32, math.inf)),
        ("llama.attention.layer_norm_rms_epsilon", F32, scalar(F32, math.nan)),
        ("llama.attention.layer_norm_rms_epsilon", F64, scalar(F64, -1.0)),
        ("llama.context_length", U64, scalar(U64, 1 << 62)),
        ("llama.block_count", U32, scalar(U32, 0)),
        ("llama.attention.head_count", U32, scalar(U32, 0)),
        ("llama.attention.head_count", STRING, string("9")),
        ("llama.embedding_length", BOOL, scalar(BOOL, True)),
        ("llama.attention.head_count_kv", U32, scalar(U32, 3)),
        ("llama.rope.dimension_count", U32, scalar(U32, 32)),
        ("tokenizer.ggml.eos_token_id", I32, scalar(I32, -1)),
        ("tokenizer.ggml.bos_token_id", U32, scalar(U32, 10**6)),
        ("tokenizer.ggml.tokens", ARRAY, array(U8, [scalar(U8, 1)])),
        ("tokenizer.ggml.merges", ARRAY, array(STRING, [string("nospace")])),
        ("tokenizer.ggml.token_type", ARRAY, array(I32, [scalar(I32, 1)])),
        ("general.architecture", U32, scalar(U32, 1)),
    ],
    ids=lambda v: v if isinstance(v, str) else str(v) if isinstance(v, int) else "",
)
def test_bad_metadata_values_name_their_key(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, key: str, kind: int, payload: bytes
) -> None:
    """Non-finite, out-of-range, mistyped or inconsistent values of keys the loader reads."""
    assert_refused(load(prober, tiny.set(key, kind, payload), tmp_path / "meta.gguf"), key)


def test_native_entry_points_refuse_sizes_that_disagree(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """With the loader's checks bypassed, the kernels refuse every lying size with KernelError
    (heads, kv heads, head size, ffn, slots, pages, sequences, positions, q8_0 slot bytes, row ids,
    row bytes)."""
    tiny.write(tmp_path / "tiny.gguf")
    outcome = prober.ask(f"lies {tmp_path / 'tiny.gguf'}")
    assert outcome.kind == "refused", outcome.detail


# ---- the corpus: one random edit each ----

LOADER_KEYS = (
    "general.architecture", "general.alignment", "general.name", "llama.block_count", "llama.context_length",
    "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
    "llama.attention.head_count_kv", "llama.attention.key_length", "llama.attention.value_length",
    "llama.rope.dimension_count", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.rope.scaling.original_context_length",
    "llama.vocab_size", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
)  # fmt: skip
INTS = st.sampled_from(
    [0, 1, 2, 3, 7, 32, 64, 128, 255, 256, 512, 4096, 2**31 - 1, 2**32 - 1, 2**40, 2**63 - 1]
)
VALUES = st.one_of(
    INTS.map(lambda v: (U32 if v < 2**32 else U64, scalar(U32 if v < 2**32 else U64, v))),
    st.integers(-(2**31), -1).map(lambda v: (I32, scalar(I32, v))),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-30, 1e30]).map(
        lambda v: (F32, scalar(F32, v))
    ),
    st.text(max_size=8).map(lambda v: (STRING, string(v))),
    st.booleans().map(lambda v: (BOOL, scalar(BOOL, v))),
    st.lists(INTS.filter(lambda v: v < 256), max_size=4).map(
        lambda vs: (ARRAY, array(U8, [scalar(U8, v) for v in vs]))
    ),
    st.integers(2, 10).map(lambda d: (ARRAY, nested_array(d))),
)
DIMS = st.lists(
    st.sampled_from([0, 1, 2, 31, 32, 64, 128, 256, 512, 4096, 2**20, 2**40]), min_size=1, max_size=5
)
TYPES = st.sampled_from([0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 24, 30, 39, 99, 2**31])


@st.composite
def edits(draw: st.DrawFn, raw: RawGGUF) -> tuple[str, RawGGUF, int | None]:
    """One edit of `raw`: a metadata value, a tensor's dims, type or offset, a dropped key or
    tensor, a lying count, or a truncation. Returns (description, edited, truncate_at)."""
    what = draw(st.sampled_from(["value", "drop", "dims", "type", "offset", "drop tensor", "count", "cut"]))
    names = [t.name for t in raw.tensors]
    if what == "value":
        key = draw(st.sampled_from(LOADER_KEYS))
        kind, payload = draw(VALUES)
        return f"{key} = {payload[:16]!r} ({kind})", raw.set(key, kind, payload), None
    if what == "drop":
        key = draw(st.sampled_from(LOADER_KEYS))
        return f"drop {key}", raw.drop(key), None
    if what in ("dims", "type", "offset"):
        name = draw(st.sampled_from(names))
        info = raw.tensor(name)
        if what == "dims":
            new = tuple(draw(DIMS))
            return f"{name} dims {new}", raw.retensor(name, dims=new), None
        if what == "type":
            kind = draw(TYPES)
            return f"{name} type {kind}", raw.retensor(name, kind=kind), None
        offset = draw(st.sampled_from([info.offset + 1, info.offset + 32, 0, 2**40, 2**64 - 32]))
        return f"{name} offset {offset}", raw.retensor(name, offset=offset), None
    if what == "drop tensor":
        name = draw(st.sampled_from(names))
        out = raw.copy()
        out.tensors = [t for t in out.tensors if t.name != name]
        return f"drop tensor {name}", out, None
    if what == "count":
        out = raw.copy()
        field = draw(st.sampled_from(["num_kv", "num_tensors"]))
        value = draw(st.sampled_from([0, len(raw.kvs) + 1, len(raw.tensors) + 1, 2**40, 2**64 - 1]))
        setattr(out, field, value)
        return f"{field} = {value}", out, None
    _, regions = raw.header()
    cut = draw(st.integers(0, regions.data + 4096))
    return f"truncate at {cut}", raw, cut


def corpus_case(prober: Prober, data: st.DataObject, raw: RawGGUF, path: pathlib.Path) -> None:
    """One drawn edit of `raw`, loaded packed (mostly) or as floats."""
    description, edited, cut = data.draw(edits(raw))
    dtype = data.draw(st.sampled_from(["auto", "auto", "auto", "float32"]))
    outcome = load(prober, edited, path, dtype, **({} if cut is None else {"truncate_at": cut}))
    assert outcome.kind in ("loaded", "refused"), (
        f"{description} ({dtype}) -> {outcome.kind}: {outcome.detail}"
    )
    if outcome.kind == "loaded":
        assert_clean(outcome)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corpus_of_one_field_edits_of_the_tiny_model(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """A few random one-field edits: each a named error or a correct load (fast suite)."""
    corpus_case(prober, data, tiny, tmp_path / "edit.gguf")


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corpus_of_one_field_edits_of_the_tiny_model_at_length(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """The same corpus, many more edits."""
    corpus_case(prober, data, tiny, tmp_path / "edit.gguf")


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corpus_of_one_field_edits_of_the_default_model(
    prober: Prober, default_model: RawGGUF, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """Random one-field edits of the default model's file."""
    corpus_case(prober, data, default_model, tmp_path / "edit.gguf")
