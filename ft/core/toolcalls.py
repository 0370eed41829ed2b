"""Streaming tool-call parsers: model text deltas in, text and tool-call events out (the events
and the pieces the formats share are `ft.core.toolcall_events`).

Each family (`hermes`, `llama3_json`; `phi4_mini_json` and `granite` in `toolcall_lists`;
`qwen3_coder`, XML whose values the tools' schemas type, in `toolcall_xml`; `gemma4`, Gemma 4's
own notation, typed so too, in `toolcall_gemma4`) is a small synchronous state machine. Text outside calls
streams as soon as it cannot be the start of a call; a call is emitted once its JSON is complete
and valid (`ToolCallStart`, one `ToolCallArgsDelta` with the whole arguments string,
`ToolCallEnd`), so the events never depend on how the output was split into deltas. A call that
turns out invalid or unterminated comes back as plain text; the parsers never raise on model
output.

An output cut short (`finish(is_cut=True)`: `max_tokens`, the end of the context) is another
matter: the call it was writing is dropped, never surfaced as text, and so is a held-back
prefix of a call's opening marker. Nothing of a call is sent before it parses, so a streamed
client never saw any of it either.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ft.core.suffix import held_suffix_len
from ft.core.toolcall_events import (
    CallEmitter,
    PassthroughParser,
    StringScan,
    TextAroundCalls,
    TextDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
    ToolEvent,
    call_from_json,
    new_tool_call_id,
)
from ft.core.toolcall_gemma4 import Gemma4ToolCallParser
from ft.core.toolcall_lists import GRANITE_MARKERS, PHI4_MINI_MARKERS, MarkedJsonParser
from ft.core.toolcall_xml import XmlToolCallParser


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text around them.

    Whitespace-only text at the start or between/after calls is held and dropped when a call
    follows it or the output ends with calls, so `content` is not just the newlines between
    calls. A complete call whose closing tag never came (the model stopped right at it) is still
    accepted at `finish`. A closing tag inside a JSON string (an argument that quotes it) does
    not close the call.
    """

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._calls = CallEmitter(id_factory)
        self._buf = ""
        self._is_in_call = False
        self._end_search_from = 0
        self._string_scan = StringScan()  # over the open call's JSON, for a tag inside a string
        self._text = TextAroundCalls()

    @property
    def has_tool_calls(self) -> bool:
        """True once any call has been emitted."""
        return self._calls.num_calls > 0

    def feed(self, text: str) -> list[ToolEvent]:
        """Consume a delta; return text that cannot be part of a tag, and completed calls."""
        out: list[ToolEvent] = []
        self._buf += text
        while True:
            if not self._is_in_call:
                start = self._buf.find(self.START)
                if start < 0:
                    keep = held_suffix_len(self._buf, (self.START,))
                    self._emit_text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._emit_text(self._buf[:start], out)
                self._buf = self._buf[start + len(self.START) :]
                self._is_in_call = True
                self._end_search_from = 0
                self._string_scan = StringScan()
            else:
                end = self._buf.find(self.END, self._end_search_from)
                if end < 0:
                    self._end_search_from = max(0, len(self._buf) - len(self.END) + 1)
                    return out
                body = self._buf[:end]
                if self._string_scan.ends_inside(body):  # the tag is text inside an argument: read on
                    self._end_search_from = end + 1
                    continue
                self._buf = self._buf[end + len(self.END) :]
                self._is_in_call = False
                self._close_call(body, self.END, out)

    def finish(self, *, is_cut: bool = False) -> list[ToolEvent]:
        """Flush held text; an unterminated call is accepted only if its JSON is complete.

        Cut short (`is_cut`), an incomplete call is dropped, with a held prefix of `<tool_call>`
        and the whitespace before it.
        """
        out: list[ToolEvent] = []
        is_dropped = False
        if self._is_in_call:
            self._is_in_call = False
            if is_cut and call_from_json(self._buf) is None:
                is_dropped = True
            else:
                self._close_call(self._buf, "", out)
        elif is_cut and self._buf:  # only ever a held prefix of the start tag
            is_dropped = True
        else:
            self._emit_text(self._buf, out)
        self._buf = ""
        self._text.finish(out, keep=not self.has_tool_calls and not is_dropped)
        return out

    def _close_call(self, body: str, end_tag: str, out: list[ToolEvent]) -> None:
        call = call_from_json(body)
        if call is None:
            self._emit_text(self.START + body + end_tag, out)
            return
        self._text.call_emitted()
        out.extend(self._calls.emit(*call))

    def _emit_text(self, text: str, out: list[ToolEvent]) -> None:
        self._text.emit(text, out)


_JSON_WHITESPACE = " \t\r\n"


_CALL_KEYS = ("name", "parameters", "arguments")
_FIRST_KEY = re.compile(r'\s*\{\s*"((?:[^"\\]|\\.)*)("?)')
_NAME_KEY = re.compile(r'"name"\s*:')


def _may_be_call(fragment: str) -> bool:
    """Whether a cut-off object at the start of `fragment` may be a Llama 3 call (linear)."""
    first = _FIRST_KEY.match(fragment)
    if first is None:  # `{`, or not even that: too short to tell
        return True
    key, is_closed = first.group(1), bool(first.group(2))
    if not is_closed:
        return any(k.startswith(key) for k in _CALL_KEYS)
    return key in _CALL_KEYS or _NAME_KEY.search(fragment) is not None


class Llama3JsonParser:
    """Llama 3.1/3.2 JSON calls: `[<|python_tag|>]{"name": ..., "parameters": {...}}; {...}`.

    Only output that starts (after whitespace) with `{` or `<|python_tag|>` is read as calls;
    anything else passes through as text. An object that is not a call turns the rest of the
    output into text, from that object on (separators before it are dropped).
    """

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._calls = CallEmitter(id_factory)
        self._buf = ""
        self._skipped = ""  # raw text consumed since the last call: whitespace, tag, separators
        self._is_undecided = True
        self._is_text = False
        # Scanner over the object at the start of `_buf`; `_scan_pos` is where it resumes.
        self._scan_pos = 0
        self._depth = 0
        self._is_in_string = False
        self._is_escaped = False
        self._is_first_key_pending = False

    @property
    def has_tool_calls(self) -> bool:
        """True once any call has been emitted."""
        return self._calls.num_calls > 0

    def feed(self, text: str) -> list[ToolEvent]:
        """Consume a delta; return passthrough text, completed calls, or a failed call as text."""
        if self._is_text:
            return [TextDelta(text)] if text else []
        self._buf += text
        if self._is_undecided and not self._decide():
            return []
        if self._is_text:
            return self._fall_back_to_text()
        return self._scan_calls()

    def finish(self, *, is_cut: bool = False) -> list[ToolEvent]:
        """Flush: an incomplete object or undecided prefix becomes text; trailing `;` is dropped.

        Cut short (`is_cut`), the incomplete object (or a prefix of `<|python_tag|>`) is dropped
        when it may be a call; a cut JSON answer that cannot be one (its first key is no call
        key and it has no `"name"` key) stays text.
        """
        if self._is_text:
            return []
        if is_cut and (self.has_tool_calls or self.PYTHON_TAG in self._skipped or _may_be_call(self._buf)):
            self._is_text = True
            self._buf = self._skipped = ""
            return []
        if self.has_tool_calls:
            self._buf = self._buf.lstrip(_JSON_WHITESPACE + ";")
        return self._fall_back_to_text()

    def _decide(self) -> bool:
        """Settle whether the output is calls or text; False while the prefix is ambiguous."""
        stripped = self._buf.lstrip()
        if not stripped or (len(stripped) < len(self.PYTHON_TAG) and self.PYTHON_TAG.startswith(stripped)):
            return False
        self._is_undecided = False
        if stripped.startswith(self.PYTHON_TAG):
            start = len(self._buf) - len(stripped) + len(self.PYTHON_TAG)
            self._skipped, self._buf = self._buf[:start], self._buf[start:]
        elif not stripped.startswith("{"):
            self._is_text = True
        return True

    def _scan_calls(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        while True:
            if self._scan_pos == 0:
                separators = _JSON_WHITESPACE + (";" if self.has_tool_calls else "")
                rest = self._buf.lstrip(separators)
                self._skipped += self._buf[: len(self._buf) - len(rest)]
                self._buf = rest
                if not rest:
                    return out
                if not rest.startswith("{"):
                    return out + self._fall_back_to_text()
            end = self._scan_object()
            if end is None:
                return out
            if end < 0:
                return out + self._fall_back_to_text()
            call = call_from_json(self._buf[:end])
            if call is None:
                return out + self._fall_back_to_text()
            out.extend(self._calls.emit(*call))
            self._buf = self._buf[end:]
            self._skipped = ""
            self._scan_pos = 0

    def _scan_object(self) -> int | None:
        """Advance over the object at `_buf[0]`: its end, None if incomplete, -1 if not a call."""
        buf = self._buf
        for pos in range(self._scan_pos, len(buf)):
            char = buf[pos]
            if self._is_in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif char == "\\":
                    self._is_escaped = True
                elif char == '"':
                    self._is_in_string = False
                continue
            if self._is_first_key_pending and char not in _JSON_WHITESPACE:
                # NOTE: `{` followed by anything but a key is prose, not a call; say so early.
                if char != '"':
                    return -1
                self._is_first_key_pending = False
            if char == '"':
                self._is_in_string = True
            elif char in "{[":
                self._depth += 1
                if pos == 0:
                    self._is_first_key_pending = True
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._scan_pos = 0
                    return pos + 1
        self._scan_pos = len(buf)
        return None

    def _fall_back_to_text(self) -> list[ToolEvent]:
        # NOTE: before the first call the skipped prefix is the output's own text; after a call
        # it is only separators.
        text = ("" if self.has_tool_calls else self._skipped) + self._buf
        self._is_text = True
        self._buf = self._skipped = ""
        return [TextDelta(text)] if text else []


TOOL_CALL_PARSERS: tuple[str, ...] = (
    "hermes", "llama3_json", "phi4_mini_json", "granite", "qwen3_coder", "gemma4",
)  # fmt: skip


def template_tool_call_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches, where it spells one unmistakably: the
    `<function=` and `<parameter=` tags of Qwen3-Coder's XML (its template, Qwen3.5's and
    Qwen3-Next's); else None (the family's format, or hermes, applies).

    NOTE: Qwen3-Coder is a Qwen3-MoE checkpoint, the architecture of the JSON-calling Qwen3
    models: only its template tells the two apart.
    """
    if chat_template is not None and "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    return None


def make_tool_call_parser(
    name: str | None,
    *,
    id_factory: Callable[[], str] = new_tool_call_id,
    tools: Sequence[Mapping[str, Any]] = (),
) -> ToolCallParser:
    """Build the parser for a tool-call format.

    Args:
        name: one of `TOOL_CALL_PARSERS`, or None for plain text passthrough.
        id_factory: makes call ids; tests inject a deterministic one.
        tools: the request's tool definitions (OpenAI's function shape), whose parameter
            schemas type the values of a format that writes them as text (`qwen3_coder`,
            `gemma4`).
    Raises:
        ValueError: `name` is not a known format.
    """
    if name is None:
        return PassthroughParser()
    if name == "hermes":
        return HermesParser(id_factory)
    if name == "llama3_json":
        return Llama3JsonParser(id_factory)
    if name == "phi4_mini_json":  # Phi-4-mini: <|tool_call|>[...]<|/tool_call|>, or functools[...]
        return MarkedJsonParser(PHI4_MINI_MARKERS, id_factory)
    if name == "granite":  # Granite 3.x: <|tool_call|>[...]
        return MarkedJsonParser(GRANITE_MARKERS, id_factory)
    if name == "qwen3_coder":  # Qwen3-Coder, Qwen3.5, Qwen3-Next: <tool_call><function=...>
        return XmlToolCallParser(tools, id_factory)
    if name == "gemma4":  # Gemma 4: <|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>
        return Gemma4ToolCallParser(tools, id_factory)
    raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")


def parse_tool_calls(
    text: str, name: str | None, tools: Sequence[Mapping[str, Any]] = ()
) -> tuple[str, list[tuple[str, str]]]:
    """Parse a whole output: (content text, [(function name, arguments JSON)])."""
    parser = make_tool_call_parser(name, tools=tools)
    content: list[str] = []
    calls: list[tuple[str, str]] = []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls.append((event.name, ""))
        elif isinstance(event, ToolCallEnd):
            calls[event.index] = (calls[event.index][0], event.arguments)
    return "".join(content), calls
