"""The chat page's Markdown renderer against hostile model output, run in node
(`markdown_check.mjs`: `<script>`, `<img onerror>`, `javascript:` links, nested backticks,
random and very large inputs). Skips without node; the browser test runs it in Chromium too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RENDERER = HERE.parents[2] / "ft" / "server" / "web" / "static" / "markdown.js"


def test_the_renderer_builds_only_allowed_elements_and_safe_links() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    done = subprocess.run(
        [node, str(HERE / "markdown_check.mjs"), str(RENDERER)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout
