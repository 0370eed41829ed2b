"""`serve()` on the fake model in its own process, for signal tests: prints its URL, then serves.

Run it from the repository root as `python -m tests.support.serve_fake DRAIN_TIMEOUT_S`.
"""

from __future__ import annotations

import sys
from functools import partial

import trio

from ft.config import EngineConfig
from ft.engine.fake import FakeRunner, text_script
from ft.server import RunningServer, ServerSettings
from ft.server.app import serve
from tests.support.engine import fake_hooks


async def main() -> None:
    runner = FakeRunner(script=text_script("lorem ipsum " * 100), step_s=0.02)
    hooks = fake_hooks(runner)
    settings = ServerSettings(port=0, drain_timeout_s=float(sys.argv[1]), graceful_timeout_s=1.0)
    async with trio.open_nursery() as nursery:
        server: RunningServer = await nursery.start(
            partial(serve, EngineConfig(num_pages=64), settings, hooks=hooks)
        )
        print(server.base_url, flush=True)


if __name__ == "__main__":
    trio.run(main)
    print("exited cleanly", flush=True)
