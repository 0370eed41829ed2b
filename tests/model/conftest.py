"""Fixtures for the model tests."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.support.gguf_probe import Prober
from tests.support.tiny_model import save_hf_dir, tiny_config


@pytest.fixture
def tiny_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama model saved as a Hugging Face directory."""
    save_hf_dir(tmp_path / "tiny", tiny_config())
    return tmp_path / "tiny"


@pytest.fixture(scope="module")
def prober() -> Iterator[Prober]:
    """One probe process per test module (restarted after any case that kills it)."""
    p = Prober()
    yield p
    p.close()
