"""Fixtures shared by more than one test folder."""

from __future__ import annotations

import pytest

from tests.support.gguf_files import RawGGUF, default_model_raw, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RawGGUF:
    """A tiny valid GGUF's header, ready to edit (`tests.support.gguf_files`)."""
    return RawGGUF.read(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def default_model() -> RawGGUF:
    """The default model's header (the file issue 19's cases edited); skips when not cached."""
    return default_model_raw()
