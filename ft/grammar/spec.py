"""What a request asks its output to follow, as plain data: `GrammarSpec`, and its builders.

Each API spells structured output its own way (`response_format`, `text.format`, vLLM's
`structured_outputs` / `guided_*`, a forced `tool_choice`); each builds a `GrammarSpec` here,
so the engine sees one kind of value. A spec is canonical text (JSON dumped with sorted keys),
so equal requests share one compiled grammar (keys keep their order: JSON is generated with
the properties in the order the schema lists them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ft.errors import InvalidRequest
from ft.grammar.gemma4_calls import gemma4_call_rules
from ft.grammar.tool_parameters import is_text, is_xml_name, parameter_schema, properties_of

GrammarKind = Literal["json_schema", "regex", "grammar", "choice", "lark"]
KINDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "grammar", "choice", "lark")
MAX_SOURCE_CHARS = 1 << 20  # a request body is at most a few MiB; a grammar far less
MAX_CHOICES = 4096
# the tool-call parsers a grammar can target
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "phi4_mini_json", "granite", "qwen3_coder", "gemma4")
# The markers their grammars write. Vocabularies hold some as tokens of their own (Qwen's
# `<tool_call>`, Phi-4-mini's `<|tool_call|>`, Gemma 4's all), which llguidance takes for special
# tokens, never for their text (a text literal of one is then refused at the first step): the
# grammars write those as their tokens (`marker_tokens`), as the models were trained to.
TOOL_CALL_MARKERS = (
    "<tool_call>", "</tool_call>", "<|tool_call|>", "<|/tool_call|>", "<|tool_call>", "<tool_call|>", '<|"|>',
)  # fmt: skip

# JSON is generated compactly but readably, with no free whitespace: a small model at
# temperature 1 given "any whitespace" can emit newlines until `max_tokens`.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's output.

    `kind` is how `source` reads: `json_schema` (a JSON Schema, as JSON text), `regex`,
    `grammar` (a Lark or a GBNF grammar: llguidance tells them apart), `choice` (a JSON list of
    strings: the output is one of them) or `lark` (ft's own grammars, such as tool calls).
    `param` names the request field it came from, so an error can point at it.
    """

    kind: GrammarKind
    source: str
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown grammar kind {self.kind!r}", param=self.param)
        if not isinstance(self.source, str) or not self.source:
            raise InvalidRequest("the grammar is empty", param=self.param)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequest(
                f"the grammar is longer than {MAX_SOURCE_CHARS} characters", param=self.param
            )

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the field name does not)."""
        return self.kind, self.source


def json_text(value: Any) -> str:
    """`value` as compact JSON text, so equal schemas compare equal."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_schema(schema: Any, param: str) -> GrammarSpec:
    """Output that is a JSON value valid against `schema` (an object or a boolean schema).

    Raises:
        InvalidRequest: `schema` is neither a JSON object nor a boolean, or is `false`.
    """
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("a JSON schema must be an object (or a boolean)", param=param)
        if schema is False:
            raise InvalidRequest("the JSON schema is false: no output can match it", param=param)
        # NOTE: llguidance applies `JSON_OPTIONS` only to an object schema; `{}` is `true`.
        return GrammarSpec("json_schema", json_text({} if schema is True else schema), param)
    except (ValueError, RecursionError) as e:  # not JSON, or nested past Python's own limit
        raise InvalidRequest(f"the JSON schema cannot be read: {e}", param=param) from None


def json_object(param: str) -> GrammarSpec:
    """Any JSON object (OpenAI's JSON mode)."""
    return GrammarSpec("json_schema", json_text({"type": "object"}), param)


def regex(pattern: Any, param: str) -> GrammarSpec:
    """Output that matches `pattern` whole (Rust `regex` syntax, as llguidance reads it)."""
    if not isinstance(pattern, str):
        raise InvalidRequest("a regex must be a string", param=param)
    return GrammarSpec("regex", pattern, param)


def grammar(text: Any, param: str) -> GrammarSpec:
    """Output in the language of a Lark or GBNF grammar (its `start` / `root` rule)."""
    if not isinstance(text, str):
        raise InvalidRequest("a grammar must be a string", param=param)
    return GrammarSpec("grammar", text, param)


def choice(options: Any, param: str) -> GrammarSpec:
    """Output that is exactly one of `options` (strings)."""
    if (
        not isinstance(options, list)
        or not options
        or len(options) > MAX_CHOICES
        or not all(isinstance(o, str) and o for o in options)
    ):
        raise InvalidRequest(f"a choice must list 1 to {MAX_CHOICES} non-empty strings", param=param)
    return GrammarSpec("choice", json_text(options), param)


def tool_calls(
    tools: list[dict[str, Any]],
    *,
    name: str | None,
    parallel: bool,
    parser: str,
    otherwise: GrammarSpec | None = None,
    markers: frozenset[str] = frozenset(),
) -> GrammarSpec:
    """Output that is one call (or, with `parallel`, several) of `tools` in `parser`'s format.

    Each call names one of the tools (only `name` when given) and its arguments follow that
    tool's parameter schema. `otherwise`, a JSON schema, is the alternative to calling a tool
    (`tool_choice: auto` with a `response_format`): the output is then calls or that JSON.
    `markers` are the `TOOL_CALL_MARKERS` the vocabulary holds as tokens of their own
    (`marker_tokens`), written as those tokens.

    Raises:
        InvalidRequest: `name` is not among `tools`.
    """
    chosen = [t for t in tools if name is None or _name(t) == name]
    if not chosen:
        raise InvalidRequest(f"tool_choice names an unknown tool '{name}'", param="tool_choice")
    if parser == "qwen3_coder":
        rules = _xml_call_rules(chosen, markers)
        call, sep = "body", '"\\n"'
        rules.insert(0, f"calls: {call} ({sep} {call})*" if parallel else f"calls: {call}")
        return _with_answer(rules, otherwise)
    if parser == "gemma4":  # its notation, not JSON; calls follow each other with nothing between
        rules = gemma4_call_rules(chosen, markers)
        rules.insert(0, "calls: body+" if parallel else "calls: body")
        return _with_answer(rules, otherwise)
    # NOTE: each call's arguments are their own `%json` schema, so that a tool's `$ref`s
    # (`#/$defs/...`, as pydantic writes them) resolve against its parameters, not a wrapper.
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    rules = ["body: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, t in enumerate(chosen):
        head = f'{{"name": {json_text(_name(t))}, "{args_key}": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} " + json.dumps("}"))
        rules.append(f"args_{i}: %json {json_text(_arguments_schema(t))}")
    m = _Markers(markers)
    if parser in ("phi4_mini_json", "granite"):  # one marker, the calls as a JSON array
        close = f'"]" {m("<|/tool_call|>")}' if parser == "phi4_mini_json" else '"]"'
        several = ' (", " body)*' if parallel else ""
        rules.insert(0, f'calls: {m("<|tool_call|>")} "[" body{several} {close}')
    else:
        if parser == "llama3_json":
            call, sep = "body", '"; "'
        else:
            call, sep = f'{m("<tool_call>")} "\\n" body "\\n" {m("</tool_call>")}', '"\\n"'
        rules.insert(0, f"calls: {call} ({sep} {call})*" if parallel else f"calls: {call}")
    return _with_answer(rules, otherwise)


class _Markers:
    """Writes a marker in a rule: as its token where the vocabulary holds it as one, else as text."""

    def __init__(self, markers: frozenset[str]) -> None:
        self._markers = markers

    def __call__(self, text: str) -> str:
        return text if text in self._markers else json.dumps(text)


def marker_tokens(tokenizer_json: str) -> frozenset[str]:
    """The `TOOL_CALL_MARKERS` a vocabulary (its `tokenizer.json` text) holds as tokens of their
    own (its added tokens)."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    return frozenset(t.get("content") for t in added if t.get("content") in TOOL_CALL_MARKERS)


def _with_answer(rules: list[str], otherwise: GrammarSpec | None) -> GrammarSpec:
    """The grammar of `rules` (whose `calls` are the calls), or of `otherwise`, a JSON answer."""
    start = "start: calls"
    if otherwise is not None:
        assert otherwise.kind == "json_schema"
        alternative = json.loads(otherwise.source)
        if isinstance(alternative, dict):
            alternative = alternative | {"x-guidance": JSON_OPTIONS}
        rules.append(f"answer: %json {json_text(alternative)}")
        start = "start: calls | answer"
    return GrammarSpec("lark", "\n".join(["%llguidance {}", start, *rules]), "tools")


# A text value of an XML call and the tag that closes it: anything without `</parameter>`, so the
# parser (`ft.core.toolcall_xml`) reads it back whole.
_XML_TEXT = r"XML_TEXT: /(?s:.*)\n<\/parameter>\n/ & ~/(?s:.*<\/parameter>.*<\/parameter>.*)/"


def _xml_call_rules(chosen: list[dict[str, Any]], markers: frozenset[str]) -> list[str]:
    """Rules of Qwen3-Coder's XML calls (`body`: a call of one of `chosen`), as Qwen3.5's
    template writes them: each parameter the schema lists, in its order, the required ones
    always; a string's value as text (one of its `enum`, if it has one), any other as JSON
    following the parameter's schema."""
    m = _Markers(markers)
    rules = ["body: " + " | ".join(f"call_{i}" for i in range(len(chosen))), _XML_TEXT]
    for i, t in enumerate(chosen):
        function = t.get("function")
        params = function.get("parameters") if isinstance(function, dict) else None
        required = params.get("required") if isinstance(params, dict) else None
        _check_xml_name(_name(t) or "", "function")
        parts = []
        for j, pname in enumerate(properties_of(params)):
            _check_xml_name(pname, "parameter")
            schema = parameter_schema(params, pname)
            rule = f"p_{i}_{j}"
            parts.append(rule if isinstance(required, list) and pname in required else f"{rule}?")
            rules.append(f"{rule}: {json.dumps(f'<parameter={pname}>' + chr(10))} v_{i}_{j}")
            rules.append(f"v_{i}_{j}: {_xml_value(schema, params)}")
        function_tag = json.dumps(f"\n<function={_name(t)}>\n")
        close = json.dumps("</function>\n")
        rules.append(
            f"call_{i}: {' '.join([m('<tool_call>'), function_tag, *parts, close, m('</tool_call>')])}"
        )
    return rules


def _check_xml_name(name: object, what: str) -> None:
    """A forced call's names must read back as written (else it would parse as text, or as
    another parameter's value).

    Raises:
        InvalidRequest: `name` has a `<`, `>`, line break or tab, spaces around it, or is empty
            or too long for the qwen3_coder format.
    """
    if not isinstance(name, str) or not is_xml_name(name):
        raise InvalidRequest(
            f"the qwen3_coder tool-call format cannot carry the {what} name {name!r:.80} "
            "(no '<', '>', line breaks, tabs or surrounding spaces, 1 to 256 characters)",
            param="tools",
        )


def _xml_value(schema: object, parameters: object) -> str:
    """The grammar of one XML parameter value and its closing tag."""
    close = json.dumps("\n</parameter>\n")
    if is_text(schema):
        options = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            return "(" + " | ".join(json.dumps(o) for o in options) + f") {close}"
        return "XML_TEXT"
    assert isinstance(schema, dict)  # a schema with a type that is not a string
    if isinstance(parameters, dict):  # its `$ref`s resolve against the tool's definitions
        schema = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters} | schema
    return f"%json {json_text(schema | {'x-guidance': JSON_OPTIONS})} {close}"


def _name(tool: dict[str, Any]) -> str | None:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _arguments_schema(tool: dict[str, Any]) -> Any:
    """The schema of a call's arguments: the tool's parameters, always a JSON object (the
    tool-call parsers take nothing else for a call)."""
    function = tool.get("function")
    params = function.get("parameters") if isinstance(function, dict) else None
    if params is False:
        return False
    if not isinstance(params, dict):
        params = {}
    if "type" not in params:  # `{}`, `true` or a bare `properties` allow strings and numbers
        params = {"type": "object"} | params
    return params | {"x-guidance": JSON_OPTIONS}
