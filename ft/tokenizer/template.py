"""Chat templates: jinja2 in a sandbox, configured as transformers renders them."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ft.errors import InvalidRequest

# The largest string or list a template may build with `*` (a prompt is at most a few MiB; a
# template repeating more is hostile), and the largest integer `**` may compute: both run as
# one C call that no deadline interrupts. Jinja's sandbox already caps `range()` at 100,000
# items; the worker's deadline and memory bound (`ft.tokenizer.job`) stop what grows step by
# step (loops, `+` doubling a string).
MAX_SEQUENCE_LEN = 16 << 20
MAX_POWER_BITS = 4096

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


class TemplateTimeout(BaseException):
    """The render ran past its deadline (raised by the worker's timer, so a BaseException that
    no `except Exception` in jinja's runtime swallows)."""


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with `*` and `**` checked before they run.

    Intercepted operators are never folded at compile time, so `{{ 7 ** 77777777 }}` fails here
    at render time (in the worker, under its deadline) instead of hanging the compiler.
    """

    # NOTE: `+` is left to the memory bound: intercepting it costs ~10% of a normal render.
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        """`left operator right`, refused when its result would exceed the bounds above."""
        if operator == "**":
            _check_power(left, right)
        elif operator == "*":
            _check_repeat(left, right)
        return super().call_binop(context, operator, left, right)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates use to mark the
    assistant's tokens for training (SmolLM3's among them): here its body renders as it is."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API: a class attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        """The block's body, in place of the block."""
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_power(base: Any, exponent: Any) -> None:
    if _is_int(base) and _is_int(exponent) and abs(base) > 1 and exponent > 0:
        if exponent * (abs(base).bit_length() - 1) > MAX_POWER_BITS:
            raise SecurityError(f"a power larger than {MAX_POWER_BITS} bits is not allowed")


def _check_repeat(left: Any, right: Any) -> None:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and _is_int(times) and len(seq) * times > MAX_SEQUENCE_LEN:
            raise SecurityError(f"a string or list longer than {MAX_SEQUENCE_LEN} items is not allowed")


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
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlocks]
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
        TemplateTimeout: the worker's render deadline passed (see `ft.tokenizer.job`).
        MemoryError: the render needed more memory than the process may use.
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
