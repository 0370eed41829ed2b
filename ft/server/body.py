"""Reading a request body as JSON that the engine can represent, or a 4xx naming the problem.

Python's `json` accepts `NaN`/`Infinity`, integers of any size and arbitrarily deep nesting,
and decodes `"\\ud800"` to a lone surrogate. All of those are refused here, before pydantic or
the engine see the value: depth is measured on the text before parsing (so no RecursionError),
constants and non-finite floats are refused while parsing, and one walk finds lone surrogates
(in values and keys) and integers outside 64 bits, naming the field.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from quart import Request

from ft.errors import InvalidRequest
from ft.params import has_lone_surrogate
from ft.server.http_errors import HttpError

MAX_DEPTH = 64
INT_MIN, INT_MAX = -(2**63), 2**64 - 1

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONG_DIGITS = re.compile(r"\d{19,}")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def too_large(limit: int) -> HttpError:
    """The 413 error for a body over `limit` bytes."""
    return HttpError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 when its declared or actual size exceeds `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    data = await request.get_data(cache=False)
    assert isinstance(data, bytes)
    if len(data) > limit:
        raise too_large(limit)
    return data


async def read_json(request: Request, limit: int, *, allow_empty: bool = False) -> Any:
    """The body parsed by `parse_json` (an empty body is `{}` when `allow_empty`)."""
    data = await read_body(request, limit)
    if allow_empty and not data.strip():
        return {}
    return parse_json(data)


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"{name} is not valid JSON (numbers must be finite)", code="invalid_json")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequest(f"the number {text[:40]} is out of range", code="invalid_json")
    return value


def parse_json(data: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a JSON body strictly. Raises `InvalidRequest` (400) for anything unusable."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8", code="invalid_body") from None
    if not text.strip():
        raise InvalidRequest("the request body is empty; expected a JSON object", code="invalid_json")
    skeleton = _STRING.sub("", text)
    brackets = _NOT_BRACKET.sub("", skeleton)
    if brackets and max(itertools.accumulate(_DEPTH_STEP[c] for c in brackets)) > max_depth:
        raise InvalidRequest(
            f"the request body is nested deeper than {max_depth} levels", code="invalid_json"
        )
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except InvalidRequest:
        raise
    except (ValueError, RecursionError) as e:
        reason = str(e).split(":")[0] if isinstance(e, json.JSONDecodeError) else "invalid value"
        raise InvalidRequest(
            f"the request body is not valid JSON ({reason[:200]})", code="invalid_json"
        ) from None
    if _SURROGATE_ESCAPE.search(text) or _LONG_DIGITS.search(skeleton):
        check_representable(value)
    return value


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_representable(value: Any, path: str = "") -> None:
    """Raise `InvalidRequest` naming the first string with a lone surrogate or int past 64 bits.

    Iterative, so no nesting depth can raise RecursionError.
    """
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
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
            for k, v in item.items():
                name = _child(where, k)
                if isinstance(k, str) and has_lone_surrogate(k):
                    raise InvalidRequest(
                        f"a key in {where or 'the body'} contains a lone UTF-16 surrogate",
                        param=where or None,
                    )
                stack.append((v, name))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, _child(where, i)) for i, v in enumerate(item))
