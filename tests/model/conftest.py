"""Fixtures for the model tests."""

from __future__ import annotations

import pathlib

import pytest

from ft.model.pull import cached_model_path
from tests.support.gguf_files import RawGGUF, write_tiny_gguf
from tests.support.tiny_model import save_hf_dir, tiny_config


@pytest.fixture
def tiny_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama model saved as a Hugging Face directory."""
    save_hf_dir(tmp_path / "tiny", tiny_config())
    return tmp_path / "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RawGGUF:
    """The tiny valid model's header, ready to edit."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return RawGGUF.read(path)


@pytest.fixture(scope="module")
def default_model() -> RawGGUF:
    """The default model's header (the file issue 19's cases edited)."""
    path = cached_model_path()
    if not path.exists():
        pytest.skip("the default model is not cached (run `ft pull`)")
    return RawGGUF.read(path)
