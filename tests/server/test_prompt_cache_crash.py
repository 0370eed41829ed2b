"""`ft serve --prompt-cache-dir`, killed with SIGKILL while it writes pages, ten times: each
restart serves, the answer after a restart is the cold answer, the directory stays in its
bound, and files torn by a kill are never served."""

from __future__ import annotations

import pathlib
import random
import re
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest
import trio

from ft.core.prompt_cache import HEADER, decode_page
from ft.model import kernels

pytestmark = [
    pytest.mark.slow,  # ten starts of the default model
    pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels"),
]

ROOT = pathlib.Path(__file__).parents[2]
KILLS = 10
BOUND = 48 << 20  # ~130 pages of the default model: writes also evict
PROBE = "Repeat the list: " + " ".join(str(i) for i in range(150))  # ~600 tokens
GREEDY: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def load(seed: int) -> str:
    """A prompt of ~700 tokens no other prompt shares (pages to write)."""
    rng = random.Random(seed)
    return "Sum these: " + " ".join(str(rng.randrange(1000)) for _ in range(180))


def intact(data: bytes) -> bool:
    """Whether a page file checks out (under the identity and key its header names)."""
    if len(data) < HEADER.size:
        return False
    _, _, identity, key, _ = HEADER.unpack_from(data)
    return decode_page(data, identity, int.from_bytes(key, "little")) is not None


async def start(cache: pathlib.Path, log: pathlib.Path) -> tuple[trio.Process, str]:
    """`ft serve` on `cache`, once `/health/ready` answers 200; (process, base URL)."""
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "ft.cli_serve", "--port", "0", "--compute-threads", "1",
             "--max-prefill-tokens", "256", "--prompt-cache-dir", str(cache),
             "--prompt-cache-size", str(BOUND)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    with trio.fail_after(120):
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                assert proc.poll() is None, log.read_text()
                match = re.search(r"listening on (http://[^\s,\"]+)", log.read_text())
                if match:
                    try:
                        if (await client.get(match.group(1) + "/health/ready")).status_code == 200:
                            return proc, match.group(1)
                    except httpx.TransportError:
                        pass
                await trio.sleep(0.05)


async def complete(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, int]:
    """The greedy completion of `prompt` and its cached prompt tokens."""
    response = await client.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def write_until_killed(client: httpx.AsyncClient, url: str, seed: int) -> None:
    """Requests whose pages keep the writer busy; they end when the server dies."""
    try:
        await client.post(url + "/v1/completions", json={"model": "m", "prompt": load(seed), **GREEDY})
    except httpx.TransportError:
        pass  # killed under it


async def wait_writing(client: httpx.AsyncClient, url: str, writes: int) -> None:
    """Return once the server has written a page past `writes` (its writer is busy then)."""
    with trio.move_on_after(60):
        while (await client.get(url + "/v1/stats")).json()["prompt_cache"]["disk"]["writes"] <= writes:
            await trio.sleep(0.01)


# Eleven `ft serve` starts, each loading the default model: past the suite's 300 s cap (meant
# for one hung step) at a load average of 6-8 on 2 cores.
@pytest.mark.timeout(1800)
async def test_kill_9_while_writing_pages_ten_times_never_serves_anything_wrong(
    tmp_path: pathlib.Path,
) -> None:
    cache = tmp_path / "cache"
    rng = random.Random(25)
    cold: str | None = None
    disk_hits = torn = 0
    async with httpx.AsyncClient(timeout=60) as client:
        for kill in range(KILLS + 1):
            proc, url = await start(cache, tmp_path / f"serve-{kill}.log")
            try:
                text, cached = await complete(client, url, PROBE)
                if cold is None:
                    cold = text
                    assert cached == 0
                assert text == cold, f"restart {kill}: {text!r} != cold {cold!r} ({cached} cached)"
                stats = (await client.get(url + "/v1/stats")).json()["prompt_cache"]["disk"]
                disk_hits += stats["hit_tokens"]
                assert stats["bytes"] <= BOUND and stats["enabled"]
                if kill == KILLS:
                    metrics = (await client.get(url + "/metrics")).text
                    assert re.search(
                        r'ft_prompt_cache_hit_tokens_total\{model="[^"]+",tier="disk"\} [1-9]', metrics
                    )
                    assert "ft_prompt_cache_disk_files" in metrics
                    break
                async with trio.open_nursery() as nursery:
                    for i in range(2):
                        nursery.start_soon(write_until_killed, client, url, kill * 10 + i)
                    await wait_writing(client, url, stats["writes"])
                    await trio.sleep(rng.uniform(0.0, 0.05))  # while the writer writes
                    proc.send_signal(signal.SIGKILL)
                await proc.wait()
                torn += len(list(cache.glob("v*-*/*.tmp")))
                files = [p for p in cache.glob("v*-*/*.kv") if p.is_file()]
                assert sum(p.stat().st_size for p in files) <= BOUND
                for path in files:  # a kill tears temporary files only: every page file checks out
                    assert intact(path.read_bytes()), path
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                    with trio.move_on_after(20):
                        await proc.wait()
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
    # The probe's pages were read back from disk after restarts (its RAM copy died with the
    # server); whether some kills tore a file depends on timing, reported but not asserted.
    assert disk_hits > 0
    print(f"{KILLS} kills: {disk_hits} probe tokens from disk, {torn} torn temporary files left")
