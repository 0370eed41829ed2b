"""Soak a running ft server: N clients for T seconds of mixed, hostile and abandoned requests.

    python tools/soak.py --base-url http://127.0.0.1:1941 --clients 8 --duration 600

Each client loops over a weighted mix: normal chat, streaming chat, completions, Anthropic
messages, hostile bodies (must get a 4xx JSON error), streams dropped after the first chunk,
and bursts past the queue limit (503 is the expected answer). Afterwards it waits for the
server to go idle and prints one JSON report: requests by kind and status, the 5xx count
(must be 0: nothing here injects faults), `requests.active` and `kv.used_pages` against their
baseline, and the server's RSS growth after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
import trio

CHAT = "/v1/chat/completions"
HOSTILE: list[tuple[str, bytes]] = [
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 18446744073709551616}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}'),
    (CHAT, b'{"messages": [{"role": "wizard", "content": "hi"}]}'),
    (CHAT, b'{"messages": []}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "n": 100000}'),
    (CHAT, b"[" * 5000 + b"]" * 5000),
    (CHAT, b"\xff\xfe not utf-8"),
    (CHAT, b"not json at all"),
    ("/v1/completions", b'{"prompt": [[1, 2, 99999999]], "max_tokens": 2}'),
    (
        "/v1/messages",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 18446744073709551616}',
    ),
    ("/v1/responses", b'{"input": "hi", "top_k": 18446744073709551616}'),
]
KINDS = {"chat": 4, "stream": 4, "completion": 2, "messages": 2, "hostile": 4, "drop": 2, "burst": 1}


def chat_body(stream: bool) -> dict[str, Any]:
    words = random.choice(["Say hi.", "Count to five.", "Name a color.", "What is 2+2?"])
    return {
        "messages": [{"role": "user", "content": words}],
        "max_tokens": random.randint(1, 24),
        "temperature": random.choice([0, 0.7, 1.0]),
        "stream": stream,
    }


class Soak:
    """Counts outcomes across all clients."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.outcomes: Counter[str] = Counter()
        self.server_errors: list[str] = []

    def note(self, kind: str, status: int, body: str = "") -> None:
        """Count an outcome; a 5xx other than overload (503 `overloaded_error`) is a failure."""
        if status == 503 and "overloaded_error" in body:
            self.outcomes[f"{kind}:503-overloaded"] += 1
            return
        self.outcomes[f"{kind}:{status}"] += 1
        if status >= 500:
            self.server_errors.append(f"{kind} {status} {body[:200]}")

    async def one(self, kind: str) -> None:
        c = self.client
        if kind in ("chat", "completion", "messages"):
            if kind == "chat":
                r = await c.post(CHAT, json=chat_body(False))
            elif kind == "completion":
                r = await c.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 8})
            else:
                r = await c.post(
                    "/v1/messages", json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
                )
            self.note(kind, r.status_code, r.text)
        elif kind == "hostile":
            path, body = random.choice(HOSTILE)
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
            if not 400 <= r.status_code < 500:
                self.server_errors.append(f"hostile {path} {body[:60]!r} -> {r.status_code}")
            self.note(kind, r.status_code)
        elif kind in ("stream", "drop"):
            async with c.stream("POST", CHAT, json=chat_body(True)) as r:
                if r.status_code != 200:
                    self.note(kind, r.status_code, (await r.aread()).decode("utf-8", "replace"))
                    return
                self.note(kind, r.status_code)
                async for line in r.aiter_lines():
                    if kind == "drop" and line.startswith("data:"):
                        break  # leave mid-stream: the server must abort and free it
                    if line.startswith("data:") and '"error"' in line and "server_error" in line:
                        self.server_errors.append(f"in-stream server_error: {line[:200]}")
        elif kind == "burst":
            async with trio.open_nursery() as nursery:
                for _ in range(random.randint(4, 24)):
                    nursery.start_soon(self.one, "chat")

    async def client_loop(self, deadline: float) -> None:
        names, weights = zip(*KINDS.items(), strict=True)
        while time.monotonic() < deadline:
            kind = random.choices(names, weights)[0]
            try:
                await self.one(kind)
            except httpx.HTTPError as e:
                self.outcomes[f"{kind}:transport-{type(e).__name__}"] += 1


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    return dict((await client.get("/v1/stats")).json())


async def run_soak(
    base_url: str, clients: int, duration_s: float, warmup_s: float = 5.0, api_key: str | None = None
) -> dict[str, Any]:
    """Run the soak; return the report (see the module docstring)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients * 32)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=headers, limits=limits) as client:
        before = await stats(client)
        soak = Soak(client)
        started = time.monotonic()
        rss_after_warmup: int | None = None
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(soak.client_loop, started + duration_s)
            await trio.sleep(min(warmup_s, duration_s))
            rss_after_warmup = (await stats(client)).get("process", {}).get("rss_bytes")
        with trio.move_on_after(30):
            while True:
                after = await stats(client)
                if after["requests"]["active"] == 0 and after["kv"]["used_pages"] == 0:
                    break
                await trio.sleep(0.2)
    rss_end = after.get("process", {}).get("rss_bytes")
    report = {
        "duration_s": round(time.monotonic() - started, 1),
        "clients": clients,
        "requests": sum(soak.outcomes.values()),
        "outcomes": dict(sorted(soak.outcomes.items())),
        "server_errors_5xx": len(soak.server_errors),
        "server_error_samples": soak.server_errors[:5],
        "active_before_after": [before["requests"]["active"], after["requests"]["active"]],
        "used_pages_before_after": [before["kv"]["used_pages"], after["kv"]["used_pages"]],
        "rss_growth_after_warmup_mb": (
            round((rss_end - rss_after_warmup) / 2**20, 1) if rss_end and rss_after_warmup else None
        ),
    }
    report["ok"] = (
        report["server_errors_5xx"] == 0
        and after["requests"]["active"] == before["requests"]["active"]
        and after["kv"]["used_pages"] == before["kv"]["used_pages"]
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:1941")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    report = trio.run(run_soak, args.base_url, args.clients, args.duration, args.warmup, args.api_key)
    print(json.dumps(report))
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
