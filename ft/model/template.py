"""TEMPORARY stand-in until the model helper lands the real one."""
from __future__ import annotations
import jinja2.sandbox
from ft.errors import InvalidRequest
def render_chat(template, messages, *, tools=None, add_generation_prompt=True, bos_token=None, eos_token=None, extra=None):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token, **(extra or {}))
    except Exception as e:
        raise InvalidRequest(f"chat template error: {e}", param="messages")
