"""Fixtures shared by more than one test folder."""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.support.gguf_files import RawGGUF, default_model_raw, write_tiny_gguf

# NOTE: no per-example deadline: on a 2-core machine shared with other work one example of a
# property test took 276 ms against hypothesis' default 200 ms and failed as "flaky". Speed is
# measured by benchmarks, never by a test's clock.
settings.register_profile("ft", deadline=None)
settings.load_profile("ft")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RawGGUF:
    """A tiny valid GGUF's header, ready to edit (`tests.support.gguf_files`)."""
    return RawGGUF.read(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def default_model() -> RawGGUF:
    """The default model's header (the file issue 19's cases edited); skips when not cached."""
    return default_model_raw()
