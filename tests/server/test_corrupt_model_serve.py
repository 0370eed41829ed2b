"""`ft serve --model CORRUPT.gguf` exits 1 naming the problem: never a signal, never ready.

Before, a GGUF whose metadata lied loaded, `/health` said ok, and the first chat request killed
the server with a heap corruption (issue 19).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import httpx
import pytest
import trio

from tests.support.gguf_files import DEFAULT_CASES, TINY_CASES, RawGGUF

ROOT = pathlib.Path(__file__).parents[2]


async def serve_until_exit(model: pathlib.Path, log: pathlib.Path) -> tuple[int, list[str], str]:
    """Run `ft serve --model MODEL` until it exits (at most 180 s), polling `/health` and
    `/health/ready` while it runs. Returns its exit code, every `/health` status seen (and
    "ready" for any 200 from `/health/ready`), and its output."""
    statuses: list[str] = []
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "ft.cli_serve", "--port", "0", "--model", str(model)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    try:
        with trio.fail_after(180):
            async with httpx.AsyncClient(timeout=5) as client:
                while proc.poll() is None:
                    match = re.search(r"listening on (http://[^\s,\"]+)", log.read_text())
                    if match:
                        try:
                            health = await client.get(match.group(1) + "/health")
                            statuses.append(health.json()["status"])
                            if (await client.get(match.group(1) + "/health/ready")).status_code == 200:
                                statuses.append("ready")
                        except httpx.TransportError:
                            pass  # it is stopping
                    await trio.sleep(0.05)
        return await proc.wait(), statuses, log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_serve_exits_1_naming_the_tensor_of_a_corrupt_gguf(
    tiny: RawGGUF, tmp_path: pathlib.Path
) -> None:
    """A GGUF whose kv heads lie (heap writes before) ends `ft serve` with exit 1, a message
    naming the tensor, and `/health` never ok."""
    edit, name = TINY_CASES["head_count_kv 1"]
    edit(tiny).write(tmp_path / "evil.gguf")
    code, statuses, output = await serve_until_exit(tmp_path / "evil.gguf", tmp_path / "serve.log")
    assert code == 1, output
    assert "ok" not in statuses and "ready" not in statuses, statuses
    assert "ft serve: the engine failed: ModelFileError" in output and name in output, output
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["head_count_kv 1", "attn_v as many rows as attn_q", "feed_forward_length 2^40"]
)
async def test_serve_exits_1_on_the_issues_corrupt_default_model(
    default_model: RawGGUF, tmp_path: pathlib.Path, case: str
) -> None:
    """The issue's own files (copies of the default model with one field changed)."""
    edit, name = DEFAULT_CASES[case]
    edit(default_model).write(tmp_path / "evil.gguf")
    code, statuses, output = await serve_until_exit(tmp_path / "evil.gguf", tmp_path / "serve.log")
    assert code == 1, output
    assert "ok" not in statuses and "ready" not in statuses, statuses
    assert "ModelFileError" in output and name in output, output
