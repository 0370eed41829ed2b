"""What a tool's parameter schema says of the values a call may give it: the JSON types it
allows (`kinds_of`: its `type`, in the spellings tool schemas use, its `anyOf` / `oneOf`
members', its `enum` / `const` values'), and whether a value is written as text or as JSON
(`is_text`), as formats that write arguments as text need (Qwen3-Coder's XML). The parser that
reads such calls back (`ft.core.toolcall_schema`) and the grammar that forces them (`spec`)
decide by the same functions, so what the grammar writes the parser reads as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# A type's spellings in tool schemas (vLLM reads these; the Qwen3-Coder template shows the type
# to the model as written), each by its prefix or whole name.
_KIND_PREFIXES: tuple[tuple[str, str], ...] = (
    ("int", "integer"), ("uint", "integer"), ("long", "integer"), ("short", "integer"),
    ("unsigned", "integer"), ("num", "number"), ("float", "number"), ("double", "number"),
    ("bool", "boolean"), ("binary", "boolean"), ("dict", "object"), ("object", "object"),
    ("list", "array"), ("arr", "array"), ("null", "null"),
)  # fmt: skip
_JSON_KINDS = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array"}
MAX_SCHEMA_DEPTH = 4  # anyOf / oneOf read this deep for the types a parameter may take
# Qwen3-Coder's XML (`<function=NAME>`, `<parameter=NAME>`): a name is read up to its `>`, at
# most this long, without `<` or line breaks or tabs, stripped of spaces.
MAX_XML_NAME_CHARS = 256
XML_NAME_BREAKS = "<\n\r\t"


# Gemma 4's notation (`call:NAME{`): a function name is read up to its `{`, at most this long,
# and is one run of characters without space or the notation's punctuation.
MAX_GEMMA4_NAME_CHARS = 256
_GEMMA4_NAME = re.compile(r"[^\s{}\[\]<>,:\"']+")


def is_gemma4_name(name: str) -> bool:
    """Whether Gemma 4's notation reads function name `name` back as written
    (`ft.core.gemma4_arguments`)."""
    return len(name) <= MAX_GEMMA4_NAME_CHARS and _GEMMA4_NAME.fullmatch(name) is not None


def is_xml_name(name: str) -> bool:
    """Whether Qwen3-Coder's XML reads `name` back as written (`ft.core.toolcall_xml`)."""
    return (
        0 < len(name) <= MAX_XML_NAME_CHARS
        and name == name.strip(" ")
        and not any(c in name for c in XML_NAME_BREAKS + ">")
    )


def properties_of(parameters: object) -> Mapping[str, Any]:
    """A tool's parameters' `properties` ({} when it has none)."""
    props = parameters.get("properties") if isinstance(parameters, Mapping) else None
    return props if isinstance(props, Mapping) else {}


def parameter_schema(parameters: object, name: str) -> object:
    """Parameter `name`'s schema in a tool's `parameters`, a local `$ref` (`#/$defs/...`,
    as pydantic writes them) resolved once; None when the parameters do not describe it."""
    return resolved(properties_of(parameters).get(name), parameters)


def resolved(schema: object, parameters: object) -> object:
    """`schema`, or what its local `$ref` names among the definitions of `parameters` (the
    tool's parameters, whose `$defs` / `definitions` every nested `$ref` points into)."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str) and isinstance(parameters, Mapping):
        for key in ("$defs", "definitions"):
            prefix = f"#/{key}/"
            defs = parameters.get(key)
            if ref.startswith(prefix) and isinstance(defs, Mapping):
                target = defs.get(ref[len(prefix) :])
                if isinstance(target, Mapping):
                    return target
    return schema


def is_text(schema: object) -> bool:
    """Whether a parameter of `schema` is written as text (it may be a string, or its schema
    says no type): else it is written as JSON. The grammar of a forced call writes it so."""
    kinds = kinds_of(schema)
    return not kinds or "string" in kinds


def kinds_of(schema: object, depth: int = 0) -> list[str]:
    """The JSON types `schema` allows, in its order: its `type`, its `anyOf` / `oneOf`
    members' types, the types of its `enum` / `const` values; [] when it says none."""
    if not isinstance(schema, Mapping) or depth > MAX_SCHEMA_DEPTH:
        return []
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    kinds = [_kind(n) for n in names if isinstance(n, str)]
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        for member in members if isinstance(members, list) else ():
            kinds += kinds_of(member, depth + 1)
    values = schema.get("enum")
    values = list(values) if isinstance(values, list) else []
    if "const" in schema:
        values.append(schema["const"])
    kinds += ["null" if v is None else _JSON_KINDS.get(type(v), "string") for v in values]
    return list(dict.fromkeys(kinds))


def _kind(name: str) -> str:
    name = name.strip().lower()
    for prefix, kind in _KIND_PREFIXES:
        if name.startswith(prefix):
            return kind
    return "string"  # string, str, text, varchar, char, enum, and any name not known
