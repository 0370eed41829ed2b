"""Resident memory of a router-mode server around each model's load and unload.

For each model (two tiny random-weight GGUFs and the default model): RSS before its load,
after its load and one chat request, and after its unload (the router collects and trims the
heap), twice, so a leak across cycles shows. Prints one line per cycle and how much of the
load's growth came back.

    python tools/measure_router_rss.py [--cycles 2]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import httpx
import trio

from ft.config import EngineConfig
from ft.model.pull import default_model_path
from ft.server.app import open_server
from ft.server.models import RouterSettings, ServedModel, rss_bytes
from ft.server.settings import ServerSettings

MiB = 2**20


def tiny_models(root: pathlib.Path) -> list[ServedModel]:
    """Two different tiny GGUFs (the tests' builders)."""
    from tests.support.gguf_files import write_tiny_gguf
    from tests.support.tiny_qwen3 import qwen3_model, write_qwen3_gguf

    llama = write_tiny_gguf(root / "tiny-llama.gguf", seed=0)
    qwen = write_qwen3_gguf(root / "tiny-qwen3.gguf", qwen3_model(seed=1))
    return [ServedModel("tiny-llama", str(llama)), ServedModel("tiny-qwen3", str(qwen))]


def report_leftovers() -> None:
    """Print how many engines and tensors are still alive (none should be, after an unload)."""
    import gc

    import torch

    from ft.engine.engine import Engine

    objects = gc.get_objects()
    engines = sum(isinstance(o, Engine) for o in objects)
    tensors = [o for o in objects if isinstance(o, torch.Tensor) and not o.is_meta]
    size = sum(t.numel() * t.element_size() for t in tensors) / MiB
    print(f"  alive after the unload: {engines} engines, {len(tensors)} tensors ({size:.1f} MiB)")


async def measure(models: list[ServedModel], cycles: int, debug: bool = False) -> None:
    routing = RouterSettings(models=tuple(models), unload_timeout_s=1.0)
    settings = ServerSettings(port=0)
    async with open_server(EngineConfig(), settings, router=routing) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            for cycle in range(cycles):
                for m in models:
                    before = rss_bytes()
                    r = await client.post(
                        "/v1/chat/completions",
                        json={
                            "model": m.name,
                            "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 8,
                        },
                    )
                    assert r.status_code == 200, r.text
                    loaded = rss_bytes()
                    r = await client.post("/v1/models/unload", json={"model": m.name})
                    assert r.json()["model"]["status"]["value"] == "unloaded", r.text
                    after = rss_bytes()
                    if debug:
                        report_leftovers()
                    growth = loaded - before
                    back = (loaded - after) / growth if growth > 0 else float("nan")
                    print(
                        f"cycle {cycle} {m.name:12s} before {before / MiB:7.1f} MiB"
                        f"  loaded {loaded / MiB:7.1f} MiB (+{growth / MiB:6.1f})"
                        f"  unloaded {after / MiB:7.1f} MiB"
                        f"  ({100 * back:5.1f}% of the growth back; {(after - before) / MiB:+.1f} MiB kept)",
                        flush=True,
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--debug", action="store_true", help="list what still holds an engine")
    parser.add_argument("--no-trim", action="store_true", help="gc.collect only, no malloc_trim (to compare)")
    args = parser.parse_args()
    if args.no_trim:
        import gc

        from ft.server.models import slot

        slot.release_memory = gc.collect  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        models = [
            *tiny_models(pathlib.Path(tmp)),
            ServedModel("default", str(default_model_path(progress=False))),
        ]
        trio.run(measure, models, args.cycles, args.debug)


if __name__ == "__main__":
    main()
