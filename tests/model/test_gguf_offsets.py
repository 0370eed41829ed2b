"""A tensor's data offset is untrusted: moved anywhere, it ends in a named refusal or a clean load.

A moved offset used to read a neighbour's bytes as weights: `blk.1.ffn_norm.weight` 32 bytes
on read packed blocks as a norm of 1e30, the default model then loaded and generated garbage
until its context ended (8,161 tokens, minutes on a CPU) instead of failing. Each file is loaded
in a probe process (`tests.support.gguf_probe`) under a guard against "never" (60 s).
"""

from __future__ import annotations

import math
import pathlib

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.model import kernels
from tests.support.gguf_files import RawGGUF, TensorInfo
from tests.support.gguf_probe import Prober, assert_clean, assert_refused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")


def nbytes(t: TensorInfo) -> int:
    """The bytes tensor `t`'s dims and type take."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.kind)]
    return math.prod(t.dims) // block * size


def overlapped(raw: RawGGUF, name: str, offset: int) -> set[str]:
    """The other tensors whose bytes `name` would share at data offset `offset`."""
    end = offset + nbytes(raw.tensor(name))
    return {
        t.name for t in raw.tensors if t.name != name and t.offset < end and offset < t.offset + nbytes(t)
    }


def moved(raw: RawGGUF, name: str, delta: int) -> RawGGUF:
    """`raw` with tensor `name`'s data offset moved by `delta` bytes."""
    return raw.retensor(name, offset=raw.tensor(name).offset + delta)


@pytest.mark.parametrize(
    ("name", "delta"),
    [("blk.0.attn_q.weight", 4096), ("blk.1.ffn_norm.weight", 32), ("blk.0.attn_q.weight", -4096)],
)
def test_a_tensor_moved_onto_another_tensors_bytes_is_refused_naming_both(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, name: str, delta: int
) -> None:
    """The fuzzer's edits (a load that generated garbage before): refused, naming the moved
    tensor and the one whose bytes it would read."""
    edited = moved(tiny, name, delta)
    others = overlapped(edited, name, edited.tensor(name).offset)
    edited.write(tmp_path / "moved.gguf")
    outcome = prober.run(tmp_path / "moved.gguf")
    assert_refused(outcome, name, "overlaps")
    assert any(other in outcome.detail for other in others), outcome.detail


@pytest.mark.parametrize("offset", [2**40, 2**64 - 32])
def test_an_offset_past_the_end_of_the_file_is_refused_naming_the_tensor(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, offset: int
) -> None:
    """An offset beyond the data section names the tensor and the end of the file."""
    tiny.retensor("blk.0.attn_v.weight", offset=offset).write(tmp_path / "far.gguf")
    assert_refused(prober.run(tmp_path / "far.gguf"), "blk.0.attn_v.weight", "past the end")


def test_a_misaligned_offset_is_refused_naming_the_tensor(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """An offset that is not a multiple of the alignment names the tensor and the alignment."""
    moved(tiny, "blk.1.ffn_up.weight", 1).write(tmp_path / "odd.gguf")
    assert_refused(prober.run(tmp_path / "odd.gguf"), "blk.1.ffn_up.weight", "alignment")


@st.composite
def shifts(draw: st.DrawFn, raw: RawGGUF) -> tuple[str, int]:
    """Any tensor, and any shift that keeps its offset a u64: a few bytes, a few aligned steps
    onto its neighbours, or anywhere at all."""
    name = draw(st.sampled_from([t.name for t in raw.tensors]))
    offset = raw.tensor(name).offset
    steps = offset // raw.alignment
    delta = draw(
        st.one_of(
            st.integers(max(-64, -offset), 64),
            st.integers(max(-4096, -steps), 4096).map(lambda k: k * raw.alignment),
            st.integers(-offset, 2**64 - 1 - offset),
        )
    )
    return name, delta


@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_tensor_shifted_by_any_amount_is_refused_or_loads_cleanly(
    prober: Prober, tiny: RawGGUF, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """Misaligned, past the end or on another tensor's bytes: refused naming the tensor (and
    the other); otherwise (its own bytes and padding) a clean load or a named error."""
    name, delta = data.draw(shifts(tiny))
    edited = moved(tiny, name, delta)
    offset = edited.tensor(name).offset
    data_size = edited.write(tmp_path / "shifted.gguf").end - edited.header()[1].data
    outcome = prober.run(tmp_path / "shifted.gguf")
    others = overlapped(edited, name, offset)
    if offset % edited.alignment:
        assert_refused(outcome, name, "alignment")
    elif offset + nbytes(edited.tensor(name)) > data_size:
        assert_refused(outcome, name, "past the end")
    elif others:
        assert_refused(outcome, name, "overlaps")
        assert any(other in outcome.detail for other in others), outcome.detail
    else:
        assert_clean(outcome)
