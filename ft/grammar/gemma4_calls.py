"""The Lark rules of forced tool calls in Gemma 4's notation (`gemma4`), as its chat template
writes a call: `<|tool_call>call:NAME{key:value,…}<tool_call|>`.

Each argument follows its parameter's schema in that notation, not JSON: an object's keys are
bare (or `<|"|>`-delimited where a bare key would not read back) and written in sorted order,
as the template writes every call and every declaration the model sees (jinja's `dictsort`),
the required ones always; a string is any text without `<|"|>` between two `<|"|>` markers (a
string `enum` one of its values); an integer or number is JSON text following the schema's
bounds (`%json`), a boolean `true` or `false`, `null` itself; an array is `[…]` of its items'
schema; `anyOf` / `oneOf` members, `type` lists and non-string `enum` / `const` values are
alternatives. An object whose schema lists no `properties` (not even `{}`), a schema that says
no type, or one nested past `MAX_SCHEMA_DEPTH`, takes any value of the notation.
`ft.core.gemma4_arguments` reads all of these back as written, typed by the same schemas
(`ft.grammar.tool_parameters`).

The markers are tokens of their own in Gemma 4's vocabulary: the grammar writes each one the
vocabulary holds (`markers`) as that token, as the model was trained to write it (llguidance
takes an added token for a special one, never for its text, so a text literal would not match
it; a string is then the quote token, text without the quote's text, the quote token). A
vocabulary without them (a byte tokenizer) gets the markers as text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from ft.errors import InvalidRequest
from ft.grammar.tool_parameters import is_gemma4_name, kinds_of, properties_of, resolved

QUOTE = '<|"|>'
START, END = "<|tool_call>", "<tool_call|>"
MAX_SCHEMA_DEPTH = 8  # deeper (or recursive) schemas take any value of the notation
# A string with its markers as text: exactly two `<|"|>` (they cannot overlap), at its ends, in
# one terminal (a terminal that ended where a literal begins would have to know it ends there).
_STRING_TEXT = [
    "g_string: G_STRING",
    r'G_STRING: /<\|"\|>(?s:.*)<\|"\|>/ & ~/(?s:.*<\|"\|>.*<\|"\|>.*<\|"\|>.*)/',
]
# ... and with the quote a token: text without the quote's text between two of them.
_STRING_TOKENS = [f"g_string: {QUOTE} G_TEXT {QUOTE}", r'G_TEXT: /(?s:.*)/ & ~/(?s:.*<\|"\|>.*)/']
# Any value of the notation, for a schema that says nothing of its shape.
_ANY = [
    r"G_NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/",
    r"G_KEY: /[A-Za-z_][A-Za-z0-9_]*/",
    'g_value: g_string | G_NUMBER | "true" | "false" | "null" | g_object | g_array',
    'g_object: "{" g_members "}"',
    'g_members: (g_pair ("," g_pair)*)?',
    'g_pair: G_KEY ":" g_value',
    'g_array: "[" (g_value ("," g_value)*)? "]"',
]
_BARE_KEY = re.compile(r'[^:{}\[\],"<\s]+')  # what `gemma4_arguments` reads back as a bare key
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def gemma4_call_rules(chosen: list[dict[str, Any]], markers: frozenset[str] = frozenset()) -> list[str]:
    """Rules of Gemma 4's calls (`body`: one call of one of `chosen`), each of `markers` (those
    the vocabulary holds as tokens) written as its token.

    Raises:
        InvalidRequest: a function name the notation does not read back as written (a space,
            a brace, ...), or a property name holding the quote marker.
    """
    rules = _Rules(markers)
    calls = []
    for tool in chosen:
        function = tool.get("function")
        function = function if isinstance(function, Mapping) else {}
        name = function.get("name")
        if not isinstance(name, str) or not is_gemma4_name(name):
            raise InvalidRequest(
                f"the gemma4 tool-call format cannot carry the function name {name!r:.80} (1 to 256 "
                "characters, no spaces, quotes or any of {}[]<>,:)",
                param="tools",
            )
        params = function.get("parameters")
        members = rules.members(params, params, depth=0)
        head = f"{rules.marker(START)} {json.dumps(f'call:{name}{{')}"
        calls.append(rules.add(f'{head} {members} "}}" {rules.marker(END)}'))
    strings = _STRING_TOKENS if QUOTE in markers else _STRING_TEXT
    return ["body: " + " | ".join(calls), *strings, *_ANY, *rules.lines]


class _Rules:
    """Named rules, numbered as they are made, over a vocabulary holding `markers` as tokens."""

    def __init__(self, markers: frozenset[str]) -> None:
        self.lines: list[str] = []
        self._markers = markers

    def marker(self, text: str) -> str:
        """A marker as its token where the vocabulary holds it, else as text."""
        return text if text in self._markers else json.dumps(text)

    def quoted(self, text: str) -> str:
        """`text` between two quote markers."""
        if QUOTE not in self._markers:
            return json.dumps(QUOTE + text + QUOTE)
        return f"{QUOTE} {json.dumps(text)} {QUOTE}" if text else f"{QUOTE} {QUOTE}"

    def add(self, expression: str) -> str:
        """A new rule for `expression`; its name."""
        name = f"g_{len(self.lines)}"
        self.lines.append(f"{name}: {expression}")
        return name

    def members(self, schema: object, root: object, depth: int) -> str:
        """The members of an object of `schema`, between its braces (maybe none)."""
        schema = resolved(schema, root)
        if not _lists_properties(schema) or depth > MAX_SCHEMA_DEPTH:
            return "g_members"
        props = properties_of(schema)
        required = schema.get("required") if isinstance(schema, Mapping) else None
        required = required if isinstance(required, list) else []
        if any(QUOTE in key for key in props):
            raise InvalidRequest(
                f"the gemma4 tool-call format cannot carry a property name holding {QUOTE}", param="tools"
            )
        pairs = [(self._pair(key, props[key], root, depth), key in required) for key in sorted(props)]
        # Right to left: `rest` reads the members from here on once one is written (each after
        # a comma), `first` while none is; an optional member may be left out of either.
        first = rest = ""
        for pair, is_required in reversed(pairs):
            if is_required:
                first, rest = self.add(f"{pair} {rest}"), self.add(f'"," {pair} {rest}')
            else:
                first = self.add(f"{pair} {rest} | {first}" if first else f"({pair} {rest})?")
                rest = self.add(f'("," {pair})? {rest}')
        return first

    def _pair(self, key: str, schema: object, root: object, depth: int) -> str:
        written = json.dumps(key + ":") if _BARE_KEY.fullmatch(key) else f'{self.quoted(key)} ":"'
        return f"{written} {self.value(schema, root, depth + 1)}"

    def value(self, schema: object, root: object, depth: int) -> str:
        """A rule (or terminal) of one value of `schema`."""
        schema = resolved(schema, root)
        if not isinstance(schema, Mapping) or depth > MAX_SCHEMA_DEPTH:
            return "g_value"
        options = self._constants(schema)
        if options is not None:
            return self.add(" | ".join(options))
        members = [m for key in ("anyOf", "oneOf") for m in _list(schema.get(key))]
        if members:
            return self.add(" | ".join(self.value(m, root, depth + 1) for m in members))
        declared = schema.get("type")
        kinds = [declared] if isinstance(declared, str) else _list(declared)
        shapes = [self._shape(kind, schema, root, depth) for kind in kinds if isinstance(kind, str)]
        if not shapes:  # no type: its properties say it is an object, or nothing says what it is
            shapes = [self._shape("object", schema, root, depth) if _lists_properties(schema) else "g_value"]
        return shapes[0] if len(shapes) == 1 else self.add(" | ".join(shapes))

    def _shape(self, kind: str, schema: Mapping[str, Any], root: object, depth: int) -> str:
        """One value of JSON type `kind` under `schema`'s constraints."""
        kind = kinds_of({"type": kind})[0]  # a type's spelling (`int`, `str`, ...) as its JSON type
        if kind == "string":
            return "g_string"
        if kind in ("integer", "number"):
            bounds = {k: schema[k] for k in _NUMBER_BOUNDS if k in schema}
            return self.add(f"%json {json.dumps({'type': kind} | bounds)}")
        if kind == "boolean":
            return self.add('"true" | "false"')
        if kind == "null":
            return '"null"'
        if kind == "array":
            item = self.value(schema.get("items"), root, depth + 1)
            return self.add(f'"[" ({item} ("," {item})*)? "]"')
        if not _lists_properties(schema):
            return "g_object"
        return self.add(f'"{{" {self.members(schema, root, depth)} "}}"')

    def _constants(self, schema: Mapping[str, Any]) -> list[str] | None:
        """The literals of an `enum` / `const` schema in the notation (None: it has neither)."""
        values = (
            _list(schema.get("enum"))
            if "enum" in schema
            else [schema["const"]]
            if "const" in schema
            else None
        )
        if not values:
            return None
        literals = []
        for value in values:
            if isinstance(value, str):
                if QUOTE not in value:
                    literals.append(self.quoted(value))
            elif (
                value is None
                or isinstance(value, (bool, int))
                or (isinstance(value, float) and math.isfinite(value))
            ):
                literals.append(json.dumps(json.dumps(value)))
        return literals or None


def _lists_properties(schema: object) -> bool:
    """Whether an object's schema lists its properties (`{}` among them: then it has none),
    rather than saying nothing of them (any members)."""
    return isinstance(schema, Mapping) and isinstance(schema.get("properties"), Mapping)


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
