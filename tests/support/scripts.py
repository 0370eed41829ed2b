"""Scripted model output and event-stream parsing shared by the Anthropic, Responses and chat
tool tests."""

from __future__ import annotations

import json
from typing import Any

from ft.core.batch import SeqWork
from ft.engine.fake import Script, text_script

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = "It is sunny in Paris."
QUESTION = "What is the weather in Paris?"


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, JSON data) of every named event in an event stream."""
    out = []
    for frame in text.split("\n\n"):
        lines = frame.split("\n")
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = next((ln[6:] for ln in lines if ln.startswith("data: ")), None)
        if name is not None and data is not None:
            out.append((name, json.loads(data)))
    return out


def tool_then_answer() -> Script:
    """Call the tool on the first prompt; answer on any longer one (the tool result is in it)."""
    first: list[int] = []
    call, answer = text_script(CALL), text_script(ANSWER)

    def script(work: SeqWork) -> int:
        if not first:
            first.append(work.num_prompt_tokens)
        return call(work) if work.num_prompt_tokens <= first[0] else answer(work)

    return script
