"""Fixtures for the model tests."""

from __future__ import annotations

import pathlib

import pytest

from tests.support.gguf_files import RawGGUF, default_model_raw, write_tiny_gguf
from tests.support.tiny_model import save_hf_dir, tiny_config


@pytest.fixture
def tiny_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama model saved as a Hugging Face directory."""
    save_hf_dir(tmp_path / "tiny", tiny_config())
    return tmp_path / "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RawGGUF:
    """The tiny valid GGUF's header, ready to edit."""
    return RawGGUF.read(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def default_model() -> RawGGUF:
    """The default model's header (the file issue 19's cases edited); skips when not cached."""
    return default_model_raw()
