"""One answer asked of each generation API, streamed or not, read back as the same summary:
its reasoning, its text and its tool calls (name, arguments as a value), so a test can say
what the three APIs must agree on once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.scripts import events_of
from tests.support.server import parse_sse

APIS = ("chat", "messages", "responses")


@dataclass
class Answer:
    """What an answer said, in any API: reasoning, text, calls, and whether it ended in calls."""

    reasoning: str = ""
    text: str = ""
    calls: list[tuple[str, Any]] = field(default_factory=list)
    ended_in_calls: bool = False


def body_of(
    api: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **extra: Any
) -> dict[str, Any]:
    """A request body of `api` for chat `messages` and OpenAI-shaped `tools`; `extra` fields
    as the API spells them (`tool_choice` given as chat's: "required" or a function name)."""
    choice = extra.pop("tool_choice", None)
    if api == "chat":
        body: dict[str, Any] = {"messages": messages, "tools": tools}
        if choice is not None:
            body["tool_choice"] = (
                choice if choice == "required" else {"type": "function", "function": {"name": choice}}
            )
    elif api == "messages":
        body = {"messages": messages, "max_tokens": extra.pop("max_tokens", 256)}
        if tools is not None:
            body["tools"] = [
                {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in tools
            ]
        if choice is not None:
            body["tool_choice"] = (
                {"type": "any"} if choice == "required" else {"type": "tool", "name": choice}
            )
    else:
        body = {"input": messages, "store": False}
        if tools is not None:
            body["tools"] = [{"type": "function", **t["function"]} for t in tools]
        if choice is not None:
            body["tool_choice"] = choice if choice == "required" else {"type": "function", "name": choice}
        if "max_tokens" in extra:
            body["max_output_tokens"] = extra.pop("max_tokens")
    return body | {k: v for k, v in extra.items()}


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


async def ask(client: httpx.AsyncClient, api: str, body: dict[str, Any], *, stream: bool) -> Answer:
    """POST `body` to `api` (streamed or not) and read the answer back."""
    r = await client.post(PATHS[api], json=body | {"stream": stream})
    assert r.status_code == 200, r.text
    if api == "chat":
        return _chat_stream(r.text) if stream else _chat(r.json())
    if api == "messages":
        return _messages_stream(r.text) if stream else _messages(r.json()["content"], r.json()["stop_reason"])
    if stream:
        (done,) = [data["response"] for name, data in events_of(r.text) if name == "response.completed"]
        return _responses(done["output"])
    return _responses(r.json()["output"])


def _chat(body: dict[str, Any]) -> Answer:
    (choice,) = body["choices"]
    message = choice["message"]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    ]
    return Answer(
        message.get("reasoning_content") or "",
        message["content"] or "",
        calls,
        choice["finish_reason"] == "tool_calls",
    )


def _chat_stream(text: str) -> Answer:
    answer = Answer()
    calls: dict[int, list[str]] = {}
    for frame in parse_sse(text):
        if frame == "[DONE]" or not frame["choices"]:
            continue
        (choice,) = frame["choices"]
        delta = choice["delta"]
        answer.reasoning += delta.get("reasoning_content") or ""
        answer.text += delta.get("content") or ""
        for call in delta.get("tool_calls") or ():
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
        answer.ended_in_calls |= choice["finish_reason"] == "tool_calls"
    answer.calls = [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]
    return answer


def _messages(content: list[dict[str, Any]], stop_reason: str) -> Answer:
    answer = Answer(ended_in_calls=stop_reason == "tool_use")
    for block in content:
        if block["type"] == "thinking":
            answer.reasoning += block["thinking"]
        elif block["type"] == "text":
            answer.text += block["text"]
        else:
            answer.calls.append((block["name"], block["input"]))
    return answer


def _messages_stream(text: str) -> Answer:
    blocks: list[dict[str, Any]] = []
    stop_reason = ""
    for name, data in events_of(text):
        if name == "content_block_start":
            blocks.append(data["content_block"] | {"json": ""})
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["json"] += delta["partial_json"]
        elif name == "message_delta":
            stop_reason = data["delta"]["stop_reason"]
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["json"])
    return _messages(blocks, stop_reason)


def _responses(output: list[dict[str, Any]]) -> Answer:
    answer = Answer()
    for item in output:
        if item["type"] == "reasoning":
            answer.reasoning += "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            answer.text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            answer.calls.append((item["name"], json.loads(item["arguments"])))
    answer.ended_in_calls = bool(output) and output[-1]["type"] == "function_call"
    return answer
