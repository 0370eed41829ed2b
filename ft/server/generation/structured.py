"""Structured output in each API's spelling, as one `GrammarSpec` (or none).

OpenAI chat and completions: `response_format` (`json_object`, `json_schema`), and vLLM's
`structured_outputs` / `guided_json|regex|choice|grammar`. Responses: `text.format`.
Anthropic: `output_format`, or `output_config.format` (its newer spelling). A forced
`tool_choice` is the other source of a grammar; it is combined with these in
`ft.server.generation.tools.output_grammar`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ft.errors import InvalidRequest
from ft.grammar import spec
from ft.grammar.spec import GrammarSpec
from ft.server.anthropic.schemas import MessagesRequest
from ft.server.openai.schemas import SamplingFields
from ft.server.responses.schemas import TextFormat


def only_one(asked: list[GrammarSpec]) -> GrammarSpec | None:
    """The one constraint a request asked for, if any.

    Raises:
        InvalidRequest: it asked for more than one (naming the second).
    """
    if len(asked) > 1:
        raise InvalidRequest(
            f"give one structured output constraint, not both {asked[0].param} and {asked[1].param}",
            param=asked[1].param,
        )
    return asked[0] if asked else None


def openai_output(req: SamplingFields) -> GrammarSpec | None:
    """What a chat or completions request's text must follow."""
    asked: list[GrammarSpec] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(spec.json_object("response_format"))
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_
        param = "response_format.json_schema.schema"
        asked.append(spec.json_object(param) if schema is None else spec.json_schema(schema, param))
    so = req.structured_outputs
    if so is not None and so.json_object:
        asked.append(spec.json_object("structured_outputs.json_object"))
    # vLLM's fields, new and old spellings: (value, builder, field name).
    fields: list[tuple[Any, Callable[[Any, str], GrammarSpec], str]] = [
        (req.guided_json, spec.json_schema, "guided_json"),
        (req.guided_regex, spec.regex, "guided_regex"),
        (req.guided_choice, spec.choice, "guided_choice"),
        (req.guided_grammar, spec.grammar, "guided_grammar"),
    ]
    if so is not None:
        fields += [
            (so.json_, spec.json_schema, "structured_outputs.json"),
            (so.regex, spec.regex, "structured_outputs.regex"),
            (so.choice, spec.choice, "structured_outputs.choice"),
            (so.grammar, spec.grammar, "structured_outputs.grammar"),
        ]
    asked += [build(value, param) for value, build, param in fields if value is not None]
    return only_one(asked)


def responses_output(fmt: TextFormat | None) -> GrammarSpec | None:
    """What a Responses request's text must follow (`text.format`)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.schema_ is None:
        return spec.json_object("text.format")
    return spec.json_schema(fmt.schema_, "text.format.schema")


def anthropic_output(req: MessagesRequest) -> GrammarSpec | None:
    """What a Messages request's text must follow (`output_format` or `output_config.format`)."""
    asked: list[GrammarSpec] = []
    if req.output_format is not None:
        asked.append(spec.json_schema(req.output_format.schema_, "output_format.schema"))
    if req.output_config is not None and req.output_config.format is not None:
        asked.append(spec.json_schema(req.output_config.format.schema_, "output_config.format.schema"))
    return only_one(asked)


def reasoning_parser_name(configured: str | None, grammar: GrammarSpec | None) -> str | None:
    """The reasoning format to parse: none under a grammar, which shapes the output from its
    first token (there is no reasoning block; a `<think>` is text inside the answer)."""
    return None if grammar is not None else configured
