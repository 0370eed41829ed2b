#!/usr/bin/env python3
"""How long an honest request's preparation waits behind another client's hostile ones.

Starts `ft serve` on the default model (one server per scenario, on 127.0.0.1, port 0) and
sends, from one loopback address (127.0.0.2, and 127.0.0.4 for a second hostile client), the
hostile requests of a scenario, then from another (127.0.0.3) one honest request, and prints
how long the honest one took against its time alone (the median of three):

- `huge`: chat prompts of `--huge-mb` MB each (~5 bytes a token: far past the 8,192-token
  context), refused with `context_length_exceeded`; the honest request is a 1-token chat.
- `template`: the default model with a chat template that loops on the message "hang" and
  `--template-timeout 1`: `--hostile` such chats, each refused by the template's deadline;
  the honest request is a 1-token chat.
- `schemas`: `--hostile` JSON schemas whose compile crashes llguidance (a chain of 1,000
  `$ref`s overflows its stack), from two clients; the honest request is a new small schema.

    python tools/repro_prepare_fairness.py [--scenario all|huge|template|schemas] [--huge-mb 2]
        [--hostile N]

Needs the default model (`ft pull`) and the repository on PYTHONPATH (it imports
`tests.support` to write the hostile template's model file).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOSTILE, HONEST, HOSTILE_2 = "127.0.0.2", "127.0.0.3", "127.0.0.4"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@asynccontextmanager
async def serve(args: list[str], log: pathlib.Path) -> AsyncIterator[str]:
    """`ft serve --port 0 ARGS` until the block exits; yields its URL once the model is ready."""
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "ft.cli_serve", "--port", "0", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        with trio.fail_after(300):
            while not (match := re.search(r"listening on (http://[^\s,\"]+)", log.read_text())):
                if proc.returncode is not None:
                    raise RuntimeError(log.read_text())
                await trio.sleep(0.1)
            url = match.group(1)
            async with httpx.AsyncClient(base_url=url) as client:
                while (await client.get("/health")).json().get("status") != "ok":
                    await trio.sleep(0.1)
        yield url
    finally:
        proc.kill()
        await proc.wait()


def client_from(address: str, url: str) -> httpx.AsyncClient:
    """An HTTP client whose connections come from the loopback `address`."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=url, transport=transport, timeout=600)


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1} | extra


async def timed(send: Callable[[], Awaitable[httpx.Response]]) -> tuple[float, int]:
    start = time.perf_counter()
    response = await send()
    return time.perf_counter() - start, response.status_code


async def measure(
    url: str,
    hostile: list[tuple[str, dict[str, Any]]],
    honest: Callable[[int], dict[str, Any]],
) -> dict[str, Any]:
    """The honest request's time alone (median of 3), then behind the `hostile` bodies (each
    sent from its address), and what the hostile ones got."""
    async with client_from(HONEST, url) as me:
        alone = []
        for k in range(3):
            alone.append((await timed(lambda k=k: me.post("/v1/chat/completions", json=honest(k))))[0])
        results: list[tuple[float, int]] = []

        async def attack(address: str, body: dict[str, Any]) -> None:
            async with client_from(address, url) as them:
                results.append(await timed(lambda: them.post("/v1/chat/completions", json=body)))

        async with trio.open_nursery() as nursery:
            for address, body in hostile:
                nursery.start_soon(attack, address, body)
            await trio.sleep(1.0)  # the hostile requests are read and waiting or in a worker
            behind, status = await timed(lambda: me.post("/v1/chat/completions", json=honest(99)))
    median = statistics.median(alone)
    return {
        "honest_alone_s": round(median, 3),
        "honest_behind_s": round(behind, 3),
        "ratio": round(behind / median, 1),
        "honest_status": status,
        "hostile_statuses": dict(Counter(s for _, s in results)),
        "hostile_last_s": round(max(t for t, _ in results), 2),
    }


async def huge(tmp: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    size = int(args.huge_mb * 1e6)
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa " * (size // 55 + 1))[:size]
    bodies = [(HOSTILE, chat(f"{k} {words}")) for k in range(4)]
    async with serve([], tmp / "huge.log") as url:
        return await measure(url, bodies, lambda k: chat(f"Hi {k}"))


async def template(tmp: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from ft.model.gguf_file import GGUFFile
    from ft.model.pull import default_model_path
    from tests.support.gguf_template import with_chat_template

    source = default_model_path(progress=False)
    original = GGUFFile(source).require("tokenizer.chat_template")
    hostile = f"{{% if messages[-1]['content'] == 'hang' %}}{LOOP}{{% endif %}}{original}"
    model = with_chat_template(source, tmp / "hostile.gguf", hostile)
    bodies = [(HOSTILE, chat("hang")) for _ in range(args.hostile or 8)]
    async with serve(["--model", str(model), "--template-timeout", "1"], tmp / "template.log") as url:
        return await measure(url, bodies, lambda k: chat(f"Hi {k}"))


def crashing_schema(k: int) -> dict[str, Any]:
    """A JSON schema whose chain of 1,000 `$ref`s overflows llguidance's stack (a segfault)."""
    n = 1000
    defs: dict[str, Any] = {
        f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}, "required": ["x"]}
        for i in range(n)
    }
    defs[f"a{n}"] = {"type": "string", "description": f"variant {k}"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def with_schema(schema: dict[str, Any], content: str) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return chat(content, response_format=fmt)


async def schemas(tmp: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    count = args.hostile or 16
    bodies = [(HOSTILE if k % 2 else HOSTILE_2, with_schema(crashing_schema(k), "Hi")) for k in range(count)]

    def honest(k: int) -> dict[str, Any]:
        schema = {"type": "object", "properties": {f"field_{k}_{time.time_ns()}": {"type": "integer"}}}
        return with_schema(schema, "Hi")

    async with serve([], tmp / "schemas.log") as url:
        return await measure(url, bodies, honest)


SCENARIOS = {"huge": huge, "template": template, "schemas": schemas}


async def main(args: argparse.Namespace) -> None:
    chosen = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory(prefix="ft-fairness-") as tmp:
        for name in chosen:
            result = await SCENARIOS[name](pathlib.Path(tmp), args)
            print(json.dumps({"scenario": name, **result}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["all", *SCENARIOS], default="all")
    parser.add_argument("--huge-mb", type=float, default=2.0, help="MB of each huge prompt")
    parser.add_argument("--hostile", type=int, help="hostile requests (template: 8, schemas: 16)")
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    trio.run(main, parser.parse_args())
