"""The GGUF reader's memory: a loaded tensor's mapped pages leave the process once converted."""

from __future__ import annotations

import mmap
import pathlib

import numpy as np
import pytest

from ft.model.gguf_file import GGUFFile
from tests.support.gguf_files import write_tiny_gguf

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_DONTNEED"), reason="no madvise(MADV_DONTNEED) here")


def mapped_rss_kib(path: pathlib.Path) -> int:
    """Resident KiB of this process's mappings of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def test_release_drops_a_read_tensor_from_resident_memory(tmp_path: pathlib.Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    reader = GGUFFile(path)
    checksums = [int(np.asarray(t.data, dtype=np.uint8).sum()) for t in reader.tensors]  # touch every page
    touched = mapped_rss_kib(path)
    assert touched * 1024 > 0.5 * path.stat().st_size
    for tensor in reader.tensors:
        reader.release(tensor)
    assert mapped_rss_kib(path) * 1024 < 0.1 * path.stat().st_size
    # Released pages fault back in with the same bytes.
    assert [int(np.asarray(t.data, dtype=np.uint8).sum()) for t in reader.tensors] == checksums
