"""The kernels under AddressSanitizer and UBSan (`FT_KERNELS_SANITIZE=1`): a correct load and
decode, issue 19's corrupt files and the kernels driven with lying sizes all run without a
report (a report ends the probe process, which fails the test).

The probe process loads the sanitized library through ctypes, so it starts with the ASan runtime
preloaded (`LD_PRELOAD`, from `kernels.sanitizer_runtime`); leak checking is off (the Python
interpreter itself keeps memory to exit).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from ft.model import kernels
from ft.model.quant import KERNEL_TYPES
from tests.model.test_kernel_formats import LOADER_CASES
from tests.support.gguf_files import DEFAULT_CASES, TINY_CASES, RawGGUF, write_tiny_gguf
from tests.support.gguf_probe import Prober, assert_clean, assert_refused

RUNTIME = kernels.sanitizer_runtime()
pytestmark = [
    pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels"),
    pytest.mark.skipif(RUNTIME is None, reason="the C++ compiler has no AddressSanitizer runtime (libasan)"),
]
TIMEOUT_S = 600  # the first call builds the sanitized library (tens of seconds on a busy machine)


@pytest.fixture(scope="module")
def sanitized() -> Iterator[Prober]:
    """A probe process running the ASan/UBSan build of the kernels."""
    assert RUNTIME is not None
    p = Prober(
        sanitized=True,
        env={
            "FT_KERNELS_SANITIZE": "1",
            "LD_PRELOAD": RUNTIME,
            "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        },
    )
    yield p
    p.close()


def test_the_sanitizer_reports_an_overflow_the_kernels_cannot_see(sanitized: Prober) -> None:
    """The harness is live: a kernel call told of a buffer larger than it is (the kernels get
    pointers, not buffers) dies with an AddressSanitizer report."""
    outcome = sanitized.ask("overflow", TIMEOUT_S)
    assert outcome.kind == "exit" and "AddressSanitizer" in outcome.detail, outcome


def test_a_correct_load_and_decode_run_clean(
    sanitized: Prober, tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """The tiny model (every packed type) loads and decodes a few steps without a report."""
    tiny.write(tmp_path / "tiny.gguf")
    outcome = sanitized.run(tmp_path / "tiny.gguf", timeout_s=TIMEOUT_S)
    assert outcome.kind == "loaded", outcome.detail
    assert_clean(outcome)


def test_corrupt_files_and_lying_sizes_run_clean(
    sanitized: Prober, tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """Issue 19's edits are refused at load, and the kernels refuse every lying size, without a
    sanitizer report."""
    for case, (edit, name) in sorted(TINY_CASES.items()):
        edit(tiny).write(tmp_path / "evil.gguf")
        outcome = sanitized.run(tmp_path / "evil.gguf", timeout_s=TIMEOUT_S)
        assert outcome.kind == "refused", (case, outcome)
        assert_refused(outcome, name)
    tiny.write(tmp_path / "tiny.gguf")
    outcome = sanitized.ask(f"lies {tmp_path / 'tiny.gguf'}", TIMEOUT_S)
    assert outcome.kind == "refused", outcome.detail


def test_every_kernel_type_multiplies_within_its_buffers(sanitized: Prober) -> None:
    """Products of every type the kernels multiply as stored (tiles of 1 to 9 rows, K of one
    super-block and more) and their row lookups run without a report."""
    outcome = sanitized.ask("formats", TIMEOUT_S)
    assert outcome.kind == "loaded", outcome.detail
    assert set(outcome.detail.split()) == set(KERNEL_TYPES.values()), outcome.detail


def test_non_finite_activations_quantize_without_undefined_casts(sanitized: Prober) -> None:
    """NaN and infinite activations become defined int8 blocks (UBSan's float-cast-overflow
    check is on in this build)."""
    outcome = sanitized.ask("nonfinite", TIMEOUT_S)
    assert outcome.kind == "loaded", outcome.detail


@pytest.mark.parametrize("case", sorted(LOADER_CASES))
@pytest.mark.parametrize("kv", ["auto", "q8_0"])
def test_a_gguf_of_the_newer_formats_decodes_clean(
    sanitized: Prober, tmp_path: pathlib.Path, case: str, kv: str
) -> None:
    """Tiny GGUFs of Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q5_K, IQ4_XS (or F16 and BF16 among older
    types) load and decode over float16 and q8_0 KV, and refuse lying sizes, without a report."""
    layers, embedding = LOADER_CASES[case]
    path = write_tiny_gguf(tmp_path / "formats.gguf", layer_types=layers, embedding_type=embedding)
    outcome = sanitized.run(path, timeout_s=TIMEOUT_S, kv=kv)
    assert outcome.kind == "loaded", outcome.detail
    assert_clean(outcome)
    if kv == "auto":
        outcome = sanitized.ask(f"lies {path}", TIMEOUT_S)
        assert outcome.kind == "refused", outcome.detail


@pytest.mark.slow
def test_the_default_model_and_its_corrupt_copies_run_clean(
    sanitized: Prober, default_model: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """The default model decodes without a report; each of the issue's edits of it is refused."""
    outcome = sanitized.run(default_model.source, timeout_s=TIMEOUT_S)
    assert outcome.kind == "loaded", outcome.detail
    for case, (edit, name) in sorted(DEFAULT_CASES.items()):
        edit(default_model).write(tmp_path / "evil.gguf")
        outcome = sanitized.run(tmp_path / "evil.gguf", timeout_s=TIMEOUT_S)
        assert outcome.kind == "refused", (case, outcome)
        assert_refused(outcome, name)
