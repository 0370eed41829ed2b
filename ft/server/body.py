"""Reading a request body as JSON that the engine can represent, or a 4xx naming the problem.

Python's `json` accepts `NaN`/`Infinity`, integers of any size and arbitrarily deep nesting,
and decodes `"\\ud800"` to a lone surrogate. All of those are refused here, before pydantic or
the engine see the value: constants and non-finite floats are refused while parsing, nesting
past the interpreter's recursion limit while parsing, and one iterative walk of the parsed value
finds nesting deeper than `MAX_DEPTH`, lone surrogates (in values and keys) and integers outside
64 bits, naming the field. Every step is linear in the body's size (a regex that rescans from
each quote was quadratic: 80 KB of `\\"` took 24.8 s), and bodies past `INLINE_BODY_BYTES` are
parsed in a thread, so no body holds up the event loop.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import trio
from quart import Request

from ft.errors import InvalidRequest
from ft.params import has_lone_surrogate
from ft.server.http_errors import HttpError

MAX_DEPTH = 64
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones
# in a thread, so the loop keeps serving `/health` and streams meanwhile.
INLINE_BODY_BYTES = 16 * 1024
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


async def run_sized(size: int, fn: Any, *args: Any) -> Any:
    """`fn(*args)` inline when `size` is small, else in a thread (work linear in `size`)."""
    if size <= INLINE_BODY_BYTES:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)


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


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_value(value: Any, *, max_depth: int = MAX_DEPTH, surrogates: bool = True) -> None:
    """Raise `InvalidRequest` for nesting past `max_depth`, or naming the first string with a
    lone surrogate (checked when `surrogates`) or integer past 64 bits.

    Iterative and linear in the value's size, so no nesting depth can raise RecursionError.
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if surrogates and has_lone_surrogate(item):
                raise InvalidRequest(
                    f"{where or 'the body'} contains a lone UTF-16 surrogate", param=where or None
                )
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            continue
        elif isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                raise InvalidRequest(
                    f"{where or 'the body'} holds an integer outside the 64-bit range",
                    param=where or None,
                )
        elif isinstance(item, dict):
            if depth >= max_depth:
                raise _too_deep(max_depth)
            for k, v in item.items():
                if surrogates and isinstance(k, str) and has_lone_surrogate(k):
                    raise InvalidRequest(
                        f"a key in {where or 'the body'} contains a lone UTF-16 surrogate",
                        param=where or None,
                    )
                stack.append((v, _child(where, k), depth + 1))
        elif isinstance(item, (list, tuple)):
            if depth >= max_depth:
                raise _too_deep(max_depth)
            stack.extend((v, _child(where, i), depth + 1) for i, v in enumerate(item))
