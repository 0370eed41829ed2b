"""Reading the body of one Gemma 4 tool call, `call:NAME{ARGUMENTS}`, into a name and JSON.

Gemma 4's arguments are not JSON (its chat template writes them so, and vLLM's `gemma4` parser
reads them so): keys are bare (`city:`; `<|"|>`-delimited ones are read too), a string is raw
text between two `<|"|>` markers (no escapes: it can hold anything but the marker), objects
`{…}` and arrays `[…]` nest, and anything else is a bare token up to the next `,`, `}` or `]`:
a number, `true`, `false`, `null` (the template writes Python's `None` for it, which is read
too). What a value is meant to be is ambiguous where the format says nothing of types (a bare
`02134`, a delimited `<|"|>3<|"|>` for an integer): the tool's schema decides, read as
`ft.core.toolcall_schema` reads Qwen3-Coder's text values. A bare token where the schema wants a
string is that text; a delimited string where it wants another type is read as that type (or
stays text); without a schema a bare token is a JSON literal when it reads as one.

`read_call` reads the whole body once, left to right (every character once), nesting at most
`MAX_DEPTH` deep; anything malformed, or a value that cannot be sent back as JSON, makes it no
call (None), and the caller returns its text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ft.core.toolcall_schema import ToolSchemas, typed_value
from ft.grammar.tool_parameters import (
    MAX_GEMMA4_NAME_CHARS,
    is_gemma4_name,
    kinds_of,
    properties_of,
    resolved,
)
from ft.params import has_lone_surrogate

QUOTE = '<|"|>'
CALL = "call:"
MAX_DEPTH = 64  # objects and arrays nested deeper are not a call's arguments
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NULLS = ("null", "none", "nil")  # the template writes a Python None as `None`
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class _Bare:
    """A bare token (no `<|"|>` around it): a number, a literal, or text the schema reads."""

    text: str


_Node = str | _Bare | dict[str, Any] | list[Any]


class _Malformed(Exception):
    """The body is not a call in Gemma 4's format."""


def read_call(body: str, schemas: ToolSchemas) -> tuple[str, str] | None:
    """(name, arguments JSON) of `body`, the text between `<|tool_call>` and `<tool_call|>`,
    its values typed by the tool's schema in `schemas`; None when it is not a call."""
    try:
        name, arguments = _Reader(body).call()
    except _Malformed:
        return None
    parameters = schemas.parameters(name)
    value = _typed(arguments, parameters, parameters)
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a number beyond a float, read where the schema asked for one
        return None
    if has_lone_surrogate(text):
        return None
    return name, text


class _Reader:
    """A recursive-descent reader over `text` from `at`, never stepping back."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._at = 0

    def call(self) -> tuple[str, dict[str, Any]]:
        """The whole body: `call:NAME{…}`, whitespace around it allowed."""
        self._skip_whitespace()
        if not self._text.startswith(CALL, self._at):
            raise _Malformed
        self._at += len(CALL)
        brace = self._text.find("{", self._at, self._at + MAX_GEMMA4_NAME_CHARS + 2)
        name = self._text[self._at : brace].strip(" ") if brace >= 0 else ""
        if not is_gemma4_name(name):
            raise _Malformed
        self._at = brace + 1
        arguments = self._members(depth=1)
        self._skip_whitespace()
        if self._at != len(self._text):
            raise _Malformed
        return name, arguments

    def _members(self, depth: int) -> dict[str, Any]:
        """An object's members after its `{`, up to and past its `}`."""
        members: dict[str, Any] = {}
        while True:
            self._skip_whitespace()
            if self._take("}"):
                return members
            key = self._key()
            self._skip_whitespace()
            if not self._take(":"):
                raise _Malformed
            members[key] = self._value(depth)
            self._skip_whitespace()
            if not self._take(","):
                self._skip_whitespace()
                if not self._take("}"):
                    raise _Malformed
                return members

    def _items(self, depth: int) -> list[Any]:
        """An array's items after its `[`, up to and past its `]`."""
        items: list[Any] = []
        while True:
            self._skip_whitespace()
            if self._take("]"):
                return items
            items.append(self._value(depth))
            self._skip_whitespace()
            if not self._take(","):
                self._skip_whitespace()
                if not self._take("]"):
                    raise _Malformed
                return items

    def _key(self) -> str:
        if self._text.startswith(QUOTE, self._at):
            return self._quoted()
        start = self._at
        while self._at < len(self._text) and self._text[self._at] not in ':{}[],"<\n':
            self._at += 1
        key = self._text[start : self._at].strip(" \t")
        if not key:
            raise _Malformed
        return key

    def _value(self, depth: int) -> _Node:
        self._skip_whitespace()
        if self._text.startswith(QUOTE, self._at):
            return self._quoted()
        if depth >= MAX_DEPTH and self._text.startswith(("{", "["), self._at):
            raise _Malformed
        if self._take("{"):
            return self._members(depth + 1)
        if self._take("["):
            return self._items(depth + 1)
        start = self._at
        while self._at < len(self._text) and self._text[self._at] not in ",}]":
            self._at += 1
        token = self._text[start : self._at].strip(_WHITESPACE)
        if not token or any(c in token for c in "{[") or QUOTE in token:
            raise _Malformed
        return _Bare(token)

    def _quoted(self) -> str:
        """A `<|"|>`-delimited string at `at`: its raw text."""
        start = self._at + len(QUOTE)
        end = self._text.find(QUOTE, start)
        if end < 0:
            raise _Malformed
        self._at = end + len(QUOTE)
        return self._text[start:end]

    def _take(self, char: str) -> bool:
        if self._text.startswith(char, self._at):
            self._at += len(char)
            return True
        return False

    def _skip_whitespace(self) -> None:
        while self._at < len(self._text) and self._text[self._at] in _WHITESPACE:
            self._at += 1


def _typed(node: _Node, schema: object, parameters: Mapping[str, Any]) -> Any:
    """`node` as a JSON value, typed by `schema` (its `$ref`s resolved against `parameters`)."""
    schema = resolved(schema, parameters)
    if isinstance(node, dict):
        props = properties_of(schema)
        return {key: _typed(value, props.get(key), parameters) for key, value in node.items()}
    if isinstance(node, list):
        items = schema.get("items") if isinstance(schema, Mapping) else None
        return [_typed(value, items, parameters) for value in node]
    kinds = kinds_of(schema)
    if isinstance(node, str):  # delimited: text, unless the schema wants no string
        return node if not kinds or "string" in kinds else typed_value(node, schema)
    text = node.text
    if kinds == ["string"]:
        return text
    if text.lower() in _NULLS:
        return None
    return typed_value(text, schema) if kinds else _literal(text)


def _literal(text: str) -> Any:
    """A bare token without a schema: `true`, `false` or a finite JSON number, else the text."""
    if text in ("true", "false"):
        return text == "true"
    if _JSON_NUMBER.fullmatch(text):
        try:
            value = json.loads(text)
        except ValueError:  # more digits than Python converts
            return text
        if not isinstance(value, float) or math.isfinite(value):
            return value
    return text
