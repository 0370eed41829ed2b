"""Default-model cache checks and chat-template rendering."""

from __future__ import annotations

import pathlib

import pytest

from ft.errors import InvalidRequest
from ft.model import pull
from ft.tokenizer.template import render_chat


def test_corrupt_cached_model_says_how_to_fix(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    path = pull.cached_model_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(pull.ModelNotFound, match="ft pull"):
        pull.default_model_path(progress=False)


def test_truncated_cached_model_is_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    path = pull.cached_model_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF" + b"\0" * 1000)
    with pytest.raises(pull.ModelNotFound, match="truncated"):
        pull.default_model_path(progress=False)


def test_cache_dir_follows_env(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    assert pull.cached_model_path() == tmp_path / "models" / pull.DEFAULT_MODEL_FILE


def test_chatml_fallback_renders_generation_prompt() -> None:
    text = render_chat(None, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_raise_exception_is_invalid_request() -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequest, match="roles must alternate") as info:
        render_chat(template, [], add_generation_prompt=False)
    assert info.value.param == "messages"


def test_template_type_errors_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequest, match="chat template error"):
        render_chat("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequest):
        render_chat("{% for %}", [])


def test_template_sees_tools_and_tojson() -> None:
    text = render_chat("{{ tools | tojson }}{{ bos_token }}", [], tools=[{"name": "f"}], bos_token="<s>")
    assert text == '[{"name": "f"}]<s>'


def test_sandbox_blocks_attribute_escape() -> None:
    with pytest.raises(InvalidRequest):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


def test_tools_are_written_into_a_template_that_ignores_them() -> None:
    from ft.tokenizer.template import CHATML_TEMPLATE, render_chat

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render_chat(CHATML_TEMPLATE, messages, tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert render_chat(CHATML_TEMPLATE, messages[:2]).count("<tools>") == 0


def test_a_template_that_reads_tools_gets_them_untouched() -> None:
    from ft.tokenizer.template import render_chat

    template = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert render_chat(template, [{"role": "user", "content": "x"}], tools=tools) == "f;"


def test_malformed_tool_calls_are_a_template_error_not_a_crash() -> None:
    import pytest

    from ft.errors import InvalidRequest
    from ft.tokenizer.template import CHATML_TEMPLATE, render_chat

    tools = [{"type": "function", "function": {"name": "f"}}]
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]
    with pytest.raises(InvalidRequest) as info:
        render_chat(CHATML_TEMPLATE, bad, tools=tools)
    assert info.value.param == "messages"
