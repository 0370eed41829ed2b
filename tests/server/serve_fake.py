"""`serve()` on the fake model in its own process, for signal tests: prints its URL, then serves."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).parents[1]))

from fakes import fake_parts

from ft.config import EngineConfig
from ft.engine.fake import FakeRunner, run_inline, text_script
from ft.engine.loading import EngineHooks
from ft.server import RunningServer, ServerSettings
from ft.server.app import serve


async def main() -> None:
    runner = FakeRunner(script=text_script("lorem ipsum " * 100), step_s=0.02)
    hooks = EngineHooks(load_model=fake_parts(runner), tokenize_executor=run_inline)
    settings = ServerSettings(port=0, shutdown_timeout_s=float(sys.argv[1]), graceful_timeout_s=1.0)
    async with trio.open_nursery() as nursery:
        server: RunningServer = await nursery.start(
            partial(serve, EngineConfig(num_pages=64), settings, hooks=hooks)
        )
        print(server.base_url, flush=True)


if __name__ == "__main__":
    trio.run(main)
    print("exited cleanly", flush=True)
