"""`serve()` on the fake model in its own process, for signal and replica tests: prints its URL,
then serves until SIGINT/SIGTERM, then prints "exited cleanly".

Run it from the repository root as `python -m tests.support.serve_fake DRAIN_TIMEOUT_S [--port N]
[--log-format text|json] [--workers] [--step-s S] [--endless]`; `--workers` tokenizes in real worker
processes (as `ft serve` does) instead of inline.
"""

from __future__ import annotations

import argparse
from functools import partial

import trio

from ft.config import EngineConfig
from ft.engine.fake import FakeRunner, byte_token, text_script
from ft.logs import LOG_FORMATS, setup_logging
from ft.server import RunningServer, ServerSettings
from ft.server.app import serve
from tests.support.engine import fake_hooks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("drain_timeout_s", type=float)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text")
    parser.add_argument("--workers", action="store_true")
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--endless", action="store_true", help="write 'x' until max_tokens (70k context)")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    script = (lambda work: byte_token(ord("x"))) if args.endless else text_script("lorem ipsum " * 100)
    runner = FakeRunner(script=script, step_s=args.step_s)
    context = 70000 if args.endless else 2048
    hooks = fake_hooks(runner, context_length=context, **({"executor": None} if args.workers else {}))
    settings = ServerSettings(
        port=args.port,
        drain_timeout_s=args.drain_timeout_s,
        graceful_timeout_s=1.0,
        log_format=args.log_format,
    )
    async with trio.open_nursery() as nursery:
        server: RunningServer = await nursery.start(
            partial(serve, EngineConfig(num_pages=context // 8, tokenizer_workers=1), settings, hooks=hooks)
        )
        print(server.base_url, flush=True)


if __name__ == "__main__":
    arguments = parse_args()
    setup_logging("info", arguments.log_format)
    trio.run(main, arguments)
    print("exited cleanly", flush=True)
