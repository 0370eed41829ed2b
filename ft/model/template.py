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


class _TemplateRaised(Exception):
    """A template called `raise_exception(message)`."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
    try:
        compiled = compile_template(template if template is not None else CHATML_TEMPLATE)
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
