"""Tool calls written as a JSON array after a marker: Phi-4-mini's and Granite's formats.

- `phi4_mini_json`: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>` (the
  markers of Phi-4-mini's vocabulary), or `functools[...]` (the form vLLM's Phi-4-mini template
  asks for);
- `granite`: `<|tool_call|>[...]` (Granite 3.x; no closing marker), or `<tool_call>[...]`.

A call body is one JSON value (an array of call objects, or one object) read by brackets with
strings honoured, so a marker or a bracket quoted inside an argument changes nothing. Text
outside calls streams as soon as it cannot be the start of a marker; a marker not followed by a
value that parses as calls is text (`functools` in prose stays prose). Cut short
(`finish(is_cut=True)`), the call being written is dropped, as `toolcalls` does for the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ft.core.suffix import held_suffix_len
from ft.core.toolcall_events import (
    CallEmitter,
    TextDelta,
    ToolEvent,
    call_from_json,
    load_json,
    new_tool_call_id,
)

Marker = tuple[str, str | None]  # (opening marker, closing marker or None)
PHI4_MINI_MARKERS: tuple[Marker, ...] = (("<|tool_call|>", "<|/tool_call|>"), ("functools", None))
GRANITE_MARKERS: tuple[Marker, ...] = (("<|tool_call|>", None), ("<tool_call>", "</tool_call>"))
_WHITESPACE = " \t\r\n"
MAX_CALLS_PER_MARKER = 128  # a longer array is not read as calls (its text stays text)


class _ValueScan:
    """Where the JSON value starting at `start` of a growing text ends (strings honoured);
    incremental: each call reads only what was added."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._is_in_string = False
        self._is_escaped = False

    def end(self, text: str) -> int | None:
        """The index just past the value, or None while it is still open."""
        for pos in range(self._pos, len(text)):
            char = text[pos]
            if self._is_in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif char == "\\":
                    self._is_escaped = True
                elif char == '"':
                    self._is_in_string = False
            elif char == '"':
                self._is_in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = pos + 1
                    return pos + 1
        self._pos = len(text)
        return None


def calls_from_json(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in `text`, an array of call objects or one object;
    None when it is not that (an empty array, an item that is no call)."""
    try:
        value = load_json(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    if not items or len(items) > MAX_CALLS_PER_MARKER:
        return None
    calls = []
    for item in items:
        call = _call_of(item)
        if call is None:
            return None
        calls.append(call)
    return calls


def _call_of(item: object) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        return None
    try:
        return call_from_json(json.dumps(item, ensure_ascii=False))
    except (ValueError, RecursionError):
        return None


class MarkedJsonParser:
    """Calls as a JSON array after one of `markers` (see the module docstring)."""

    def __init__(self, markers: tuple[Marker, ...], id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._markers = markers
        self._starts = tuple(start for start, _ in markers)
        self._calls = CallEmitter(id_factory)
        self._buf = ""
        self._open: Marker | None = None  # the marker whose value is being read
        self._scan: _ValueScan | None = None
        self._value_end: int | None = None

    @property
    def has_tool_calls(self) -> bool:
        """True once any call has been emitted."""
        return self._calls.num_calls > 0

    def feed(self, text: str) -> list[ToolEvent]:
        """Consume a delta; return text that cannot be part of a marker, and completed calls."""
        out: list[ToolEvent] = []
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self, *, is_cut: bool = False) -> list[ToolEvent]:
        """Flush held text; a complete value whose closing marker never came is still read.

        Cut short (`is_cut`), an incomplete call is dropped, with a held prefix of a marker.
        """
        out: list[ToolEvent] = []
        if self._open is not None:
            start = self._open[0]
            if self._value_end is not None:
                self._close(self._buf[: self._value_end], self._buf[self._value_end :], "", out)
            elif not is_cut:
                _text(start + self._buf, out)
        elif not is_cut:
            _text(self._buf, out)
        self._buf, self._open, self._scan, self._value_end = "", None, None, None
        return out

    def _step(self, out: list[ToolEvent]) -> bool:
        """One move of the state machine; False when it needs more text."""
        if self._open is None:
            found = [(at, m) for m in self._markers if (at := self._buf.find(m[0])) >= 0]
            if not found:
                keep = held_suffix_len(self._buf, self._starts)
                _text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            at, marker = min(found, key=lambda f: (f[0], -len(f[1][0])))
            _text(self._buf[:at], out)
            self._buf = self._buf[at + len(marker[0]) :]
            self._open, self._scan, self._value_end = marker, None, None
            return True
        start, end = self._open
        if self._value_end is None:
            if self._scan is None:
                stripped = self._buf.lstrip(_WHITESPACE)
                if not stripped:
                    return False
                if stripped[0] not in "[{":  # not a call after all: the marker is text
                    self._open = None
                    _text(start, out)
                    return True
                self._scan = _ValueScan(len(self._buf) - len(stripped))
            self._value_end = self._scan.end(self._buf)
            if self._value_end is None:
                return False
        rest = self._buf[self._value_end :]
        closing = ""
        if end is not None:
            after = rest.lstrip(_WHITESPACE)
            if not after or (len(after) < len(end) and end.startswith(after)):
                return False  # the closing marker may be on its way
            if after.startswith(end):
                closing, rest = rest[: len(rest) - len(after) + len(end)], after[len(end) :]
        self._close(self._buf[: self._value_end], closing, rest, out)
        return True

    def _close(self, body: str, closing: str, rest: str, out: list[ToolEvent]) -> None:
        """Emit the calls of `body` (or it as text, with its markers), then read on at `rest`."""
        assert self._open is not None
        start = self._open[0]
        calls = calls_from_json(body.strip(_WHITESPACE))
        if calls is None:
            _text(start + body + closing, out)
        else:
            for name, arguments in calls:
                out.extend(self._calls.emit(name, arguments))
        self._buf, self._open, self._scan, self._value_end = rest, None, None, None


def _text(text: str, out: list[ToolEvent]) -> None:
    if text:
        out.append(TextDelta(text))
