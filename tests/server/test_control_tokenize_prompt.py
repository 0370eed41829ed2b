"""`/v1/tokenize` renders the messages as a chat completion with the same fields renders them."""

from __future__ import annotations

from typing import Any

import pytest

from ft.prompt import PromptSpec
from ft.server.control import tokenize_prompt
from ft.server.generation.policy import template_prompt
from ft.server.openai.format import chat_message_for_template
from ft.server.openai.routes import chat_tool_choice
from ft.server.openai.schemas import ChatCompletionRequest, TokenizeRequest

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("tools", [None, [], [TOOL]], ids=["none", "empty", "one"])
def test_tokenize_renders_what_chat_renders(tools: list[Any] | None) -> None:
    """The same messages and tools give the chat route's template prompt (`tools: []` is None
    in both: a template testing `tools is not none`, as Llama 3's do, renders no tool block)."""
    fields = {"messages": USER, "tools": tools, "chat_template_kwargs": {"k": [1, {"a": None}]}}
    chat = ChatCompletionRequest.model_validate(fields)
    prompt = PromptSpec(
        messages=[chat_message_for_template(m) for m in chat.messages],
        tools=chat.tools,
        chat_template_kwargs=chat.chat_template_kwargs or {},
    )
    expected = template_prompt(prompt, chat_tool_choice(chat))
    assert tokenize_prompt(TokenizeRequest.model_validate(fields)) == expected
    assert expected.tools == (None if not tools else (TOOL,))
