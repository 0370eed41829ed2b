"""`serve()` on the fake model in its own process, for signal and replica tests: prints its URL,
then serves until SIGINT/SIGTERM, then prints "exited cleanly".

Run it from the repository root as `python -m tests.support.serve_fake DRAIN_TIMEOUT_S [--port N]
[--log-format text|json] [--workers] [--step-s S] [--step-timeout S] [--hang-at-step N] [--endless]`;
`--workers` tokenizes in real worker processes (as `ft serve` does) instead of inline;
`--hang-at-step N` runs steps in the runner's thread, as the real model's are, and the Nth never
returns (a hung kernel); `--endless` writes "x" until `max_tokens` (a 70,000-token context).
Exits 1 when the engine fails, as `ft serve` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
from collections.abc import Callable
from functools import partial

import trio

from ft.config import EngineConfig
from ft.core.batch import Runner, Sampled, SeqWork
from ft.engine.fake import FakeRunner, byte_token, run_inline, text_script
from ft.engine.loading import ModelParts
from ft.logs import LOG_FORMATS, setup_logging
from ft.server import RunningServer, ServerSettings
from ft.server.app import EngineFailed, serve
from tests.support.engine import fake_hooks, fake_parts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("drain_timeout_s", type=float)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text")
    parser.add_argument("--workers", action="store_true")
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--hang-at-step", type=int, default=None)
    parser.add_argument("--endless", action="store_true", help="write 'x' until max_tokens (70k context)")
    return parser.parse_args()


@dataclasses.dataclass
class HangsInThread:
    """The fake model's synchronous steps, run in the runner actor's thread (no `astep`); the
    `hang_at`-th never returns, as a hung kernel would not."""

    runner: FakeRunner
    hang_at: int
    num_steps: int = 0

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def step(self, works: list[SeqWork]) -> list[Sampled]:
        self.num_steps += 1
        if self.num_steps == self.hang_at:
            threading.Event().wait()  # forever: only an abandoned thread gets past this
        return self.runner.step(works)


def hanging_parts(runner: FakeRunner, hang_at: int) -> Callable[[EngineConfig], ModelParts]:
    """A `load_model` hook: the fake model, stepped in a thread, hung at step `hang_at`."""
    load = fake_parts(runner)

    def hanging(config: EngineConfig) -> ModelParts:
        parts = load(config)

        def make_runner(num_pages: int, page_size: int) -> Runner:
            parts.make_runner(num_pages, page_size)
            return HangsInThread(runner, hang_at)

        return dataclasses.replace(parts, make_runner=make_runner)

    return hanging


async def main(args: argparse.Namespace) -> None:
    script = (lambda work: byte_token(ord("x"))) if args.endless else text_script("lorem ipsum " * 100)
    runner = FakeRunner(script=script, step_s=args.step_s)
    context = 70000 if args.endless else 2048
    load = hanging_parts(runner, args.hang_at_step) if args.hang_at_step else None
    hooks = fake_hooks(
        runner, executor=None if args.workers else run_inline, load_model=load, context_length=context
    )
    settings = ServerSettings(
        port=args.port,
        drain_timeout_s=args.drain_timeout_s,
        graceful_timeout_s=1.0,
        log_format=args.log_format,
    )
    async with trio.open_nursery() as nursery:
        server: RunningServer = await nursery.start(
            partial(
                serve,
                EngineConfig(
                    num_pages=context // 8,
                    tokenizer_workers=1,
                    step_timeout_s=args.step_timeout,
                    served_model_name="fake",
                ),
                settings,
                hooks=hooks,
            )
        )
        print(server.base_url, flush=True)


if __name__ == "__main__":
    arguments = parse_args()
    setup_logging("info", arguments.log_format)
    try:
        trio.run(main, arguments)
    except* EngineFailed as failed:
        print(f"the engine failed: {failed.exceptions[0]}", flush=True)
        sys.exit(1)
    print("exited cleanly", flush=True)
