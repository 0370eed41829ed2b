"""Chat templates: jinja2 in a sandbox, configured as transformers renders them."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ft.errors import InvalidRequest

# Used when a model ships no template: ChatML, which most small instruct models understand.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# For templates that know nothing of tools (SmolLM2's among them): the Hermes convention, which
# the `hermes` tool-call parser reads back.
TOOLS_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>\n{tools}\n</tools>\nFor each function call, return a JSON "
    "object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with the tool definitions, calls and results written into their text.

    For a template that never reads `tools` or `tool_calls`: definitions go into the system
    message, an assistant's calls become `<tool_call>` blocks, tool results `<tool_response>`.
    """
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = TOOLS_SYSTEM_PROMPT.format(tools=listing)
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "".join(
                "\n<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"].get("arguments")},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in m.pop("tool_calls")
            )
            m["content"] = ((m.get("content") or "") + calls).strip()
        if m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}".strip()
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


class _TemplateRaised(Exception):
    """A template called `raise_exception(message)`."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Render `messages` (and `tools`) through `template` (None: ChatML).

    Raises:
        InvalidRequest: the template failed on these messages (param "messages").
    """
    source = template if template is not None else CHATML_TEMPLATE
    try:
        if tools and "tools" not in source:
            messages = inline_tools(messages, tools)
        compiled = compile_template(source)
        context: dict[str, Any] = dict(extra or {})
        context.update(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
        return compiled.render(**context)
    except _TemplateRaised as exc:
        raise InvalidRequest(f"chat template error: {exc}", param="messages") from exc
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
            RecursionError, OverflowError) as exc:  # fmt: skip
        raise InvalidRequest(f"chat template error: {type(exc).__name__}: {exc}", param="messages") from exc
