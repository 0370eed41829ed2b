"""Reading a request body as JSON that the engine can represent, or a 4xx naming the problem.

Python's `json` accepts `NaN`/`Infinity`, integers of any size and arbitrarily deep nesting,
and decodes `"\\ud800"` to a lone surrogate. All of those are refused here, before pydantic or
the engine see the value: constants and non-finite floats are refused while parsing, nesting
past the interpreter's recursion limit while parsing, and one iterative walk of the parsed value
finds nesting deeper than `MAX_DEPTH`, lone surrogates (in values and keys) and integers outside
64 bits, naming the field. Every step is linear in the body's size (a regex that rescans from
each quote was quadratic: 80 KB of `\\"` took 24.8 s), the walk builds a field's path only for
a value it refuses, and bodies past `INLINE_BODY_BYTES` are parsed in a thread, `PARSE_THREADS`
at a time, so no body, and no flood of them, holds up the event loop.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import trio
from quart import Request

from ft.errors import InvalidRequest
from ft.params import has_lone_surrogate
from ft.server.edge.http_errors import HttpError

MAX_DEPTH = 64
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones
# in a thread, so the loop keeps serving `/health` and streams meanwhile.
INLINE_BODY_BYTES = 16 * 1024
# Threads parsing bodies at once. Parsing holds the GIL, so each thread makes the loop's thread
# wait longer for its turn: 100 bodies in up to 40 threads held `/health` for 6.7-29.8 s; in 2,
# p99 0.5-1.1 s; in 1, p99 0.1-0.4 s (a flood then takes longer to parse, ~2x, not the loop).
PARSE_THREADS = 1
# The walk over a parsed body gives up the GIL after each this many values (~0.2 ms of work),
# so the loop's thread never waits a whole switch interval for it (see `yield_gil`).
WALK_SLICE = 2048
_parse_limiter: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("ft_parse_limiter")
# Tool-call arguments up to this size are re-parsed into objects for chat templates; longer
# ones are handed to the template as the string the client sent (that work runs on the loop).
MAX_REPARSED_ARGUMENTS = 64 * 1024

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
JSON_MIMETYPES = frozenset({"application/json"})


def too_large(limit: int) -> HttpError:
    """The 413 error for a body over `limit` bytes."""
    return HttpError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def require_json_content_type(request: Request) -> None:
    """Raise 415 unless the request says its body is JSON (`Content-Type: application/json`).

    A browser can send a cross-site POST without a CORS preflight only as `text/plain`,
    `application/x-www-form-urlencoded` or `multipart/form-data`; refusing those keeps web
    pages from driving the API of a server on their visitor's machine.
    """
    mimetype = request.mimetype
    if mimetype not in JSON_MIMETYPES and not mimetype.endswith("+json"):
        shown = f"'{mimetype[:80]}'" if mimetype else "none"
        raise HttpError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json' (got {shown})",
            code="unsupported_media_type",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 when its declared or actual size exceeds `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    data = await request.get_data(cache=False)
    assert isinstance(data, bytes)
    if len(data) > limit:
        raise too_large(limit)
    return data


def parse_limiter() -> trio.CapacityLimiter:
    """The limiter of this trio run's body-parsing threads (`PARSE_THREADS` at once)."""
    try:
        return _parse_limiter.get()
    except LookupError:
        limiter = trio.CapacityLimiter(PARSE_THREADS)
        _parse_limiter.set(limiter)
        return limiter


async def run_sized(size: int, fn: Any, *args: Any) -> Any:
    """`fn(*args)` inline when `size` is small, else in a thread (work linear in `size`), at
    most `PARSE_THREADS` of them at once; the others wait their turn without a thread."""
    if size <= INLINE_BODY_BYTES:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=parse_limiter())


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"{name} is not valid JSON (numbers must be finite)", code="invalid_json")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequest(f"the number {text[:40]} is out of range", code="invalid_json")
    return value


def _too_deep(max_depth: int) -> InvalidRequest:
    return InvalidRequest(f"the request body is nested deeper than {max_depth} levels", code="invalid_json")


def parse_json(data: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a JSON body strictly, in time linear in its size.

    Raises `InvalidRequest` (400) for anything unusable.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8", code="invalid_body") from None
    if not text.strip():
        raise InvalidRequest("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except InvalidRequest:
        raise
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as e:
        reason = str(e).split(":")[0] if isinstance(e, json.JSONDecodeError) else "invalid value"
        raise InvalidRequest(
            f"the request body is not valid JSON ({reason[:200]})", code="invalid_json"
        ) from None
    check_value(value, max_depth=max_depth, surrogates=_SURROGATE_ESCAPE.search(text) is not None)
    return value


def parse_arguments(text: str) -> Any:
    """Tool-call `arguments` as an object for a chat template, or `text` as it came.

    Strings past `MAX_REPARSED_ARGUMENTS`, invalid JSON and non-objects stay strings.
    """
    if len(text) > MAX_REPARSED_ARGUMENTS:
        return text
    try:
        value = parse_json(text.encode("utf-8", errors="surrogatepass"))
    except InvalidRequest:
        return text
    return value if isinstance(value, dict) else text


def check_value(value: Any, *, max_depth: int = MAX_DEPTH, surrogates: bool = True) -> None:
    """Raise `InvalidRequest` for nesting past `max_depth`, or naming the first string with a
    lone surrogate (checked when `surrogates`) or integer past 64 bits.

    Iterative and linear in the value's size, so no nesting depth can raise RecursionError.
    The walk that accepts a value builds no paths; only a value it refuses is walked again to
    name the field (a path string per list element cost 250 ms for 300,000 integers).
    """
    if not _is_refused(value, max_depth, surrogates):
        return
    raise _first_problem(value, max_depth, surrogates)


def _is_refused(value: Any, max_depth: int, surrogates: bool) -> bool:
    """Whether `value` holds anything `check_value` refuses: one pass, no allocation per scalar."""
    if not isinstance(value, (dict, list, tuple)):
        return _is_refused_scalar(value, surrogates)
    stack: list[tuple[Any, int]] = [(value, 0)]
    walked = 0
    while stack:
        item, depth = stack.pop()
        if depth >= max_depth:
            return True
        if isinstance(item, dict):
            if surrogates and any(isinstance(k, str) and has_lone_surrogate(k) for k in item):
                return True
            children: list[Any] | tuple[Any, ...] = list(item.values())
        else:
            children = item
        if len(children) > WALK_SLICE:  # walked a slice at a time, at the same depth
            stack.extend((children[i : i + WALK_SLICE], depth) for i in range(0, len(children), WALK_SLICE))
            continue
        walked += len(children)
        if walked >= WALK_SLICE:
            walked = 0
            yield_gil()
        for child in children:
            kind = type(child)
            if kind is int:
                if not INT_MIN <= child <= INT_MAX:
                    return True
            elif kind is str:
                if surrogates and has_lone_surrogate(child):
                    return True
            elif kind is float or kind is bool or child is None:
                continue
            elif isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
            elif _is_refused_scalar(child, surrogates):
                return True
    return False


def yield_gil() -> None:
    """Let a thread waiting for the GIL (the event loop's) take it now.

    A thread running Python keeps the GIL for up to `sys.getswitchinterval()` (5 ms) each time
    another asks for it; the event loop asks after every system call, so a walk that never
    yields makes each of the loop's reads wait, and a flood of bodies stretches that to seconds.
    """
    time.sleep(0)


def _is_refused_scalar(value: Any, surrogates: bool) -> bool:
    if isinstance(value, str):
        return surrogates and has_lone_surrogate(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return not INT_MIN <= value <= INT_MAX


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _first_problem(value: Any, max_depth: int, surrogates: bool) -> InvalidRequest:
    """The error naming the first refused field of a value `_is_refused` refused (the slow walk)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    walked = 0
    while stack:
        item, where, depth = stack.pop()
        walked += 1
        if walked >= WALK_SLICE:
            walked = 0
            yield_gil()
        if isinstance(item, str):
            if surrogates and has_lone_surrogate(item):
                return InvalidRequest(
                    f"{where or 'the body'} contains a lone UTF-16 surrogate", param=where or None
                )
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            continue
        elif isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                return InvalidRequest(
                    f"{where or 'the body'} holds an integer outside the 64-bit range",
                    param=where or None,
                )
        elif isinstance(item, dict):
            if depth >= max_depth:
                return _too_deep(max_depth)
            for k, v in item.items():
                if surrogates and isinstance(k, str) and has_lone_surrogate(k):
                    return InvalidRequest(
                        f"a key in {where or 'the body'} contains a lone UTF-16 surrogate",
                        param=where or None,
                    )
                stack.append((v, _child(where, k), depth + 1))
        elif isinstance(item, (list, tuple)):
            if depth >= max_depth:
                return _too_deep(max_depth)
            stack.extend((v, _child(where, i), depth + 1) for i, v in enumerate(item))
    raise AssertionError("check_value refused a value its second walk accepts")
