"""`ft serve | generate | chat | bench | pull | --version`."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import TypeVar

import trio

from ft.bench import add_bench_arguments, run_bench
from ft.cli_serve import add_serve_arguments, run_serve
from ft.config import EngineConfig, add_model_arguments, model_config_fields, positive_int
from ft.errors import FtError
from ft.params import SamplingParams
from ft.prompt import PromptSpec

T = TypeVar("T")


def _version() -> str:
    try:
        return version("ft")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**model_config_fields(args))


async def _generate(args: argparse.Namespace) -> None:
    from ft.engine.engine import open_engine

    async with open_engine(_engine_config(args)) as engine:
        prompt = (
            PromptSpec(messages=[{"role": "user", "content": args.prompt}])
            if args.chat
            else PromptSpec(text=args.prompt)
        )
        async with engine.open_request(prompt, params=_params(args)) as stream:
            async for delta in stream:
                print(delta.text, end="", flush=True)
        print()


CHAT_HELP = (
    "/reset clears the conversation; Ctrl-C stops an answer; an empty line, Ctrl-D or Ctrl-C here quits"
)


async def _chat(args: argparse.Namespace) -> None:
    from ft.engine.engine import open_engine

    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, object]] = list(system)
    async with open_engine(_engine_config(args)) as engine:
        print(f"{engine.model_id} — {CHAT_HELP}", file=sys.stderr)
        with trio.open_signal_receiver(signal.SIGINT) as interrupts:
            while True:
                line, interrupted = await _until_interrupted(
                    interrupts, partial(trio.to_thread.run_sync, _read_line, abandon_on_cancel=True)
                )
                if interrupted or line is None or not line.strip():
                    break
                if line.strip() == "/reset":
                    messages = list(system)
                    print("(conversation cleared)", file=sys.stderr)
                    continue
                messages.append({"role": "user", "content": line})
                reply: list[str] = []

                async def answer(turn: list[dict[str, object]] = messages, reply: list[str] = reply) -> None:
                    async with engine.open_request(PromptSpec(messages=turn), params=_params(args)) as stream:
                        async for delta in stream:
                            reply.append(delta.text)
                            print(delta.text, end="", flush=True)

                _, interrupted = await _until_interrupted(interrupts, answer)
                print()
                if interrupted:  # the request's scope has closed: the engine has let it go
                    print("(stopped)", file=sys.stderr)
                messages.append({"role": "assistant", "content": "".join(reply)})


def _read_line() -> str | None:
    """A line from the terminal (None at end of input)."""
    try:
        return input("> ")
    except EOFError:
        return None


async def _until_interrupted(
    interrupts: AsyncIterator[int], work: Callable[[], Awaitable[T]]
) -> tuple[T | None, bool]:
    """Run `work` until it returns or a signal arrives on `interrupts` (which cancels it).

    Returns its result (None when interrupted) and whether it was interrupted.
    """
    result: list[T] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            result.append(await work())
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            await interrupts.__anext__()
            nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        nursery.start_soon(watch)
    return (result[0], False) if result else (None, True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ft` command."""
    parser = argparse.ArgumentParser(prog="ft", description="LLM inference engine and server")
    parser.add_argument("--version", action="version", version=f"ft {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    add_serve_arguments(sub.add_parser("serve", help="serve the OpenAI and Anthropic APIs"))

    gen = sub.add_parser("generate", help="complete one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_model_arguments(gen)
    _add_sampling_arguments(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None)
    add_model_arguments(chat)
    _add_sampling_arguments(chat)

    add_bench_arguments(sub.add_parser("bench", help="output tokens/s at several concurrency levels (JSON)"))

    pull = sub.add_parser("pull", help="download the default model into the cache")
    pull.add_argument("--quiet", action="store_true")
    pull.add_argument("--force", action="store_true", help="download again even if cached")

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BaseException as exc:  # the top: errors arrive here wrapped by the nurseries
        leaf = _first_leaf(exc)
        if isinstance(leaf, KeyboardInterrupt):
            return 130
        if isinstance(leaf, FtError):
            print(f"error: {leaf.message}", file=sys.stderr)
            return 2
        if isinstance(leaf, (RuntimeError, ValueError, OSError)):
            print(f"error: {leaf}", file=sys.stderr)
            return 1
        raise


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return run_serve(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "pull":
        from ft.model.pull import ModelNotFound, cached_model_path, check_model_file, pull_default_model

        path = cached_model_path()
        try:
            if args.force or not path.exists():
                raise ModelNotFound("not cached")
            check_model_file(path)
        except ModelNotFound:  # missing, corrupt or --force: (re)download
            path = pull_default_model(progress=not args.quiet)
        print(path)
        return 0
    trio.run(_generate if args.command == "generate" else _chat, args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
