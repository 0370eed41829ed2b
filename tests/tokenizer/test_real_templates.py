"""Real models' chat templates pass the load check and render as transformers renders them."""

from __future__ import annotations

import pathlib
from dataclasses import asdict, replace

import cbor2
import pytest

from ft.engine.fake import byte_tokenizer_spec
from ft.tokenizer.job import SAMPLE_TOOLS, check_template_job
from ft.tokenizer.template import render_chat
from tests.support.chat_templates import TEMPLATES

CHAT = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def check(tmp_path: pathlib.Path, template: str) -> dict[str, object]:
    """What the load check says of `template` (its worker job, run here)."""
    path = tmp_path / "tokenizer.cbor"
    spec = replace(byte_tokenizer_spec(), chat_template=template, bos_token="<s>")
    path.write_bytes(cbor2.dumps(asdict(spec)))
    answer: dict[str, object] = cbor2.loads(check_template_job(cbor2.dumps({"spec_path": str(path)})))
    return answer


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_real_template_passes_the_load_check(name: str, tmp_path: pathlib.Path) -> None:
    answer = check(tmp_path, TEMPLATES[name])
    assert "error" not in answer and isinstance(answer["mid_system"], bool)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_real_template_renders_a_chat_with_its_last_message(name: str) -> None:
    text = render_chat(TEMPLATES[name], CHAT, bos_token="<s>", eos_token="</s>")
    assert "What is the weather in Paris?" in text


def test_a_generation_block_renders_its_body() -> None:
    """SmolLM3's template marks the assistant's turn `{% generation %}` (transformers'
    extension): it failed to compile, so the model failed its load check."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    assert render_chat(template, CHAT) == "Hello![Hi.]What is the weather in Paris?"


def test_a_template_that_reads_tools_renders_them() -> None:
    for name in ("llama-3.1", "qwen-2.5", "qwen-3", "mistral-v0.3", "smollm3", "indented-tools"):
        assert "get_weather" in render_chat(TEMPLATES[name], CHAT, tools=SAMPLE_TOOLS), name
