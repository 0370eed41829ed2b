#!/usr/bin/env python3
"""Send the ten "unpackable field" shapes to a running server and judge each one (stdlib only).

A field a serializer cannot pack (an integer >= 2**64 or < -2**63, a lone UTF-16 surrogate) once
made a comparable server answer 500 and leak one `requests.active` forever. For each shape this
sends the bad request, expects 400 `invalid_request_error` naming the field, checks that
`requests.active` returns to its baseline, then sends the same request with a packable value
and expects 200.

    python tools/repro_unpackable_fields.py [--base-url http://127.0.0.1:1941] [--api-key KEY]

Exit status 0 when every shape passes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

BIG = 2**64
SMALL = -(2**63) - 1
SURROGATE = "\ud800"


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4} | extra


def completion(**extra: Any) -> dict[str, Any]:
    return {"prompt": "Say hi.", "max_tokens": 4} | extra


def message(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4} | extra


def response(**extra: Any) -> dict[str, Any]:
    return {"input": "Say hi.", "max_output_tokens": 16} | extra


# (name, route, field, bad body, control body)
SHAPES: list[tuple[str, str, str, dict[str, Any], dict[str, Any]]] = [
    (
        "chat chat_template_kwargs >= 2**64",
        "/v1/chat/completions",
        "chat_template_kwargs",
        chat(chat_template_kwargs={"n": BIG}),
        chat(chat_template_kwargs={"n": 1}),
    ),
    (
        "chat chat_template_kwargs < -2**63",
        "/v1/chat/completions",
        "chat_template_kwargs",
        chat(chat_template_kwargs={"n": SMALL}),
        chat(chat_template_kwargs={"n": -1}),
    ),
    ("chat top_k 2**64", "/v1/chat/completions", "top_k", chat(top_k=BIG), chat(top_k=40)),
    ("chat max_tokens 2**64", "/v1/chat/completions", "max_tokens", chat(max_tokens=BIG), chat(max_tokens=4)),
    ("chat stop lone surrogate", "/v1/chat/completions", "stop", chat(stop=[SURROGATE]), chat(stop=["\n\n"])),
    (
        "completions max_tokens 2**64",
        "/v1/completions",
        "max_tokens",
        completion(max_tokens=BIG),
        completion(max_tokens=4),
    ),
    ("completions top_k 2**64", "/v1/completions", "top_k", completion(top_k=BIG), completion(top_k=40)),
    ("messages top_k 2**64", "/v1/messages", "top_k", message(top_k=BIG), message(top_k=40)),
    (
        "messages stop_sequences lone surrogate",
        "/v1/messages",
        "stop_sequences",
        message(stop_sequences=[SURROGATE]),
        message(stop_sequences=["\n\n"]),
    ),
    ("responses top_k 2**64", "/v1/responses", "top_k", response(top_k=BIG), response(top_k=40)),
]


def call(base: str, method: str, path: str, body: Any, key: str | None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON body or the raw text)."""
    data = None if body is None else json.dumps(body).encode("ascii")
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
        req.add_header("x-api-key", key)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def active(base: str, key: str | None) -> int:
    """`requests.active` from /v1/stats."""
    _, stats = call(base, "GET", "/v1/stats", None, key)
    return int(stats["requests"]["active"])


def wait_active(base: str, key: str | None, target: int, timeout_s: float = 10.0) -> int:
    """Poll until `requests.active` is back to `target` (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    value = active(base, key)
    while value != target and time.monotonic() < deadline:
        time.sleep(0.1)
        value = active(base, key)
    return value


def error_of(body: Any) -> tuple[str | None, str]:
    """(type, message-with-param) of an OpenAI- or Anthropic-shaped error body."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None, ""
    err = body["error"]
    return err.get("type"), f"{err.get('param') or ''} {err.get('message') or ''}"


def judge(base: str, key: str | None, shape: tuple[str, str, str, dict, dict]) -> list[str]:
    """Problems found for one shape (empty: PASS)."""
    _, route, field, bad, control = shape
    problems = []
    baseline = active(base, key)
    status, body = call(base, "POST", route, bad, key)
    etype, text = error_of(body)
    if status != 400:
        problems.append(f"bad value answered {status}, want 400")
    if etype != "invalid_request_error":
        problems.append(f"error type {etype!r}, want 'invalid_request_error'")
    if field not in text:
        problems.append(f"error does not name {field!r}: {text.strip()!r}")
    after = wait_active(base, key, baseline)
    if after != baseline:
        problems.append(f"requests.active {baseline} -> {after}: leaked")
    status, body = call(base, "POST", route, control, key)
    if status != 200:
        problems.append(f"control with a packable value answered {status}: {body!r}"[:300])
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:1941")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    failures = 0
    for shape in SHAPES:
        problems = judge(base, args.api_key, shape)
        failures += bool(problems)
        print(f"{'PASS' if not problems else 'FAIL'}  {shape[0]}")
        for p in problems:
            print(f"      {p}")
    print(f"{len(SHAPES) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
