"""Capacity: admission by need against whole-budget reservation, plus a preemption pressure run.

    python3 tools/bench_capacity.py                      # the real run (16 clients, 32 requests)
    python3 tools/bench_capacity.py --clients 4 --requests 4 --max-tokens 16   # a quick smoke check

Starts `ft serve` three times on 127.0.0.1 (a free port each time) and drives the same load
through it: `--clients` streaming chat clients, closed loop, `--requests` requests in all, no
`max_tokens` (as most OpenAI clients send), temperature 0.

1. **before**: `--admission reserve` (the old policy: a request reserves pages for prompt +
   max_tokens, i.e. up to the end of the context when max_tokens is absent);
2. **after**: `--admission need` (the default: admit on what a request needs now, preempt by
   recompute when the pool runs short);
3. **pressure**: `--admission need --num-pages {--pressure-pages}`, a pool small enough that
   preemption happens often. Every request must complete with status 200 and a finish reason,
   and `requests.active` and `kv.used_pages` must return to 0.

Prints one JSON line per phase (output tok/s, TTFT p50/mean, e2e p50, peak running requests and
KV pages seen in /v1/stats, preemptions and recomputed tokens), then one line of ratios
after/before. Exits 1 if the pressure run fails a check. Stops only the servers it started.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Name five animals that live in the Arctic.",
    "Explain what a prime number is.",
    "What causes the seasons on Earth?",
    "How do I convert Celsius to Fahrenheit?",
    "Suggest a name for a friendly robot.",
    "Why do leaves change color in autumn?",
    "List three benefits of regular exercise.",
    "What is the tallest mountain in the world?",
    "What is the Pythagorean theorem?",
    "Give me an idea for a weekend hobby.",
    "Why do we need to drink water?",
    "What is the speed of light?",
    "Describe a sunset in one sentence.",
    "Why is the sky blue?",
]


@dataclass
class Result:
    """One request's outcome."""

    index: int
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0


@dataclass
class Phase:
    """One server run: its results and what /v1/stats showed."""

    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    peak_running: int = 0
    peak_used_pages: int = 0
    final_stats: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`ft serve` in a child process, on 127.0.0.1 only."""

    def __init__(self, extra: list[str]) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "ft.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = cmd + extra
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        print(f"starting: {shlex.join(self.cmd)}", file=sys.stderr)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"ft serve exited with {self.proc.returncode}: {shlex.join(self.cmd)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).json().get("status") == "ok":
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise SystemExit("ft serve did not report /health ok in time")

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def one_request(client: httpx.AsyncClient, index: int, max_tokens: int | None) -> Result:
    """One streaming chat request; record TTFT (first content), tokens, text and finish reason."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    result = Result(index)
    started = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        result.status = r.status_code
        if r.status_code != 200:
            result.error = (await r.aread()).decode("utf-8", "replace")[:300]
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                result.error = json.dumps(event["error"])[:300]
                continue
            if event.get("usage"):
                result.tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if result.ttft_s is None:
                        result.ttft_s = time.monotonic() - started
                    result.text += content
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
    result.e2e_s = time.monotonic() - started
    return result


async def drive(url: str, name: str, clients: int, requests: int, max_tokens: int | None) -> Phase:
    """Run the load against `url`; watch /v1/stats while it runs; wait for idle afterwards."""
    phase = Phase(name)
    todo = iter(range(requests))
    timeout = httpx.Timeout(3600, connect=30)
    async with httpx.AsyncClient(
        base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=64)
    ) as client:

        async def worker() -> None:
            for index in todo:
                try:
                    phase.results.append(await one_request(client, index, max_tokens))
                except httpx.HTTPError as e:
                    phase.results.append(Result(index, error=f"{type(e).__name__}: {e}"))

        async def watch(cancel: trio.CancelScope) -> None:
            with cancel:
                while True:
                    snap = (await client.get("/v1/stats")).json()
                    phase.peak_running = max(phase.peak_running, snap["requests"]["running"])
                    phase.peak_used_pages = max(phase.peak_used_pages, snap["kv"]["used_pages"])
                    await trio.sleep(0.25)

        started = time.monotonic()
        watcher = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, watcher)
            async with trio.open_nursery() as workers:
                for _ in range(clients):
                    workers.start_soon(worker)
            watcher.cancel()
        phase.wall_s = time.monotonic() - started
        with trio.move_on_after(30):
            while True:
                phase.final_stats = (await client.get("/v1/stats")).json()
                if (
                    phase.final_stats["requests"]["active"] == 0
                    and phase.final_stats["kv"]["used_pages"] == 0
                ):
                    break
                await trio.sleep(0.2)
    return phase


def summary(phase: Phase) -> dict[str, Any]:
    """The phase as one JSON-able record."""
    ok = [r for r in phase.results if r.status == 200 and r.error is None and r.finish_reason]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.tokens for r in ok)
    stats = phase.final_stats
    return {
        "phase": phase.name,
        "requests": len(phase.results),
        "completed_200": len(ok),
        "errors": [r.error for r in phase.results if r.error][:3],
        "output_tokens": tokens,
        "wall_s": round(phase.wall_s, 2),
        "output_tok_s": round(tokens / phase.wall_s, 2) if phase.wall_s else 0.0,
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_mean_s": round(statistics.fmean(ttfts), 3) if ttfts else None,
        "e2e_p50_s": round(statistics.median(r.e2e_s for r in ok), 3) if ok else None,
        "mean_answer_tokens": round(tokens / len(ok), 1) if ok else 0.0,
        "peak_running": phase.peak_running,
        "peak_used_pages": phase.peak_used_pages,
        "total_pages": stats.get("kv", {}).get("total_pages"),
        "preemptions": stats.get("scheduler", {}).get("preemptions"),
        "recomputed_tokens": stats.get("scheduler", {}).get("recomputed_tokens"),
        "active_after": stats.get("requests", {}).get("active"),
        "used_pages_after": stats.get("kv", {}).get("used_pages"),
    }


def run_phase(name: str, extra: list[str], args: argparse.Namespace) -> Phase:
    with Server(extra + shlex.split(args.serve_args)) as server:
        return trio.run(drive, server.url, name, args.clients, args.requests, args.max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32, help="requests in all, per phase")
    parser.add_argument("--pressure-pages", type=int, default=64, help="KV pages in the pressure run")
    parser.add_argument("--max-tokens", type=int, default=None, help="only for a quick smoke check")
    parser.add_argument("--serve-args", default="", help="extra `ft serve` options for every phase")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    before = summary(run_phase("before (reserve whole budget)", ["--admission", "reserve"], args))
    print(json.dumps(before), flush=True)
    after_phase = run_phase("after (admit by need)", ["--admission", "need"], args)
    after = summary(after_phase)
    print(json.dumps(after), flush=True)
    pressure_phase = run_phase(
        "pressure (admit by need, small pool)",
        ["--admission", "need", "--num-pages", str(args.pressure_pages)],
        args,
    )
    pressure = summary(pressure_phase)
    # Greedy answers under preemption, compared with the roomy run's (information: batch
    # composition can flip a near-tie).
    roomy = {r.index: r.text for r in after_phase.results}
    pressure["same_text_as_after"] = sum(r.text == roomy.get(r.index) for r in pressure_phase.results)
    checks = {
        "all_200_with_finish_reason": pressure["completed_200"] == args.requests,
        "preempted": (pressure["preemptions"] or 0) > 0,
        "active_back_to_0": pressure["active_after"] == 0,
        "used_pages_back_to_0": pressure["used_pages_after"] == 0,
    }
    pressure["checks"] = checks
    print(json.dumps(pressure), flush=True)

    def ratio(key: str) -> float | None:
        a, b = after.get(key), before.get(key)
        return round(a / b, 2) if a and b else None

    print(
        json.dumps(
            {
                "after/before": {
                    "output_tok_s": ratio("output_tok_s"),
                    "ttft_p50": ratio("ttft_p50_s"),
                    "ttft_mean": ratio("ttft_mean_s"),
                    "e2e_p50": ratio("e2e_p50_s"),
                    "peak_running": ratio("peak_running"),
                },
                "pressure_ok": all(checks.values()),
            }
        )
    )
    raise SystemExit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
