"""Typing a tool call's raw parameter values by the tool's JSON schema.

Formats that write arguments as text (Qwen3-Coder's and Qwen3.5's XML: `<parameter=days>\\n3\\n
</parameter>`) say nothing of types: `3` is a number only because the tool's schema says the
parameter is one. `ToolSchemas` looks a parameter's schema up among the request's tools, and
`typed_value` reads the text as that type, as vLLM's `qwen3_coder` parser does: a string stays
the text; an integer, number or boolean is read as one; an object or array as JSON (or, failing
that, as a Python literal, which models sometimes write: `{'a': 1}`); whatever does not read as
its type stays the text (vLLM does too, except a boolean, which it makes `false`). `null` is
None unless the parameter can only be a string. A parameter the schema does not describe, or
one with no type, is a string.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ft.core.toolcall_events import load_json
from ft.grammar.tool_parameters import kinds_of, parameter_schema
from ft.params import has_lone_surrogate

_INTEGER = re.compile(r"[-+]?[0-9]+")
MAX_LITERAL_CHARS = 1 << 16  # a longer value is not tried as a Python literal (only as JSON)


class ToolSchemas:
    """The parameter schemas of a request's tools (OpenAI's function shape), by function name."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self._parameters: dict[str, Mapping[str, Any]] = {}
        for tool in tools:
            function = tool.get("function")
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                continue
            params = function.get("parameters")
            self._parameters.setdefault(function["name"], params if isinstance(params, Mapping) else {})

    def parameter(self, function: str, name: str) -> object:
        """The schema of parameter `name` of `function` (None when no tool describes it)."""
        return parameter_schema(self._parameters.get(function, {}), name)

    def parameters(self, function: str) -> Mapping[str, Any]:
        """The parameters schema of `function` ({} when no tool describes it)."""
        return self._parameters.get(function, {})


def typed_value(raw: str, schema: object) -> object:
    """`raw`, a parameter's text, read as the type `schema` gives it (see the module docstring)."""
    kinds = kinds_of(schema) or ["string"]
    text = raw.strip()
    if text == "null" and kinds != ["string"]:
        return None
    for kind in kinds:
        value = _read(text, kind)
        if value is not _NOT_READ:
            return value
    return raw


_NOT_READ = object()


def _read(text: str, kind: str) -> object:
    """`text` as a value of JSON type `kind`, or `_NOT_READ`."""
    if kind == "integer":
        if _INTEGER.fullmatch(text):
            try:
                return int(text)
            except ValueError:  # more digits than Python converts
                return _NOT_READ
        return _NOT_READ
    if kind == "number":
        value = _json(text)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return value
        return _NOT_READ
    if kind == "boolean":
        lowered = text.lower()
        return lowered == "true" if lowered in ("true", "false") else _NOT_READ
    if kind in ("object", "array"):
        wanted = dict if kind == "object" else list
        value = _json(text)
        if value is _NOT_READ and len(text) <= MAX_LITERAL_CHARS:
            value = _literal(text)
        return value if isinstance(value, wanted) else _NOT_READ
    return _NOT_READ  # string: the caller keeps the raw text


def _json(text: str) -> object:
    """`text` as JSON that can be sent back as JSON (finite numbers, no lone surrogates)."""
    try:
        value = load_json(text)
        sent = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # NOTE: deep nesting is model output too
        return _NOT_READ
    return _NOT_READ if has_lone_surrogate(sent) else value


def _literal(text: str) -> object:
    """`text` as a Python literal (`{'a': True}`) that is valid JSON once converted."""
    try:
        value = ast.literal_eval(text)
        sent = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_READ
    return _NOT_READ if has_lone_surrogate(sent) else json.loads(sent)  # tuples become lists
