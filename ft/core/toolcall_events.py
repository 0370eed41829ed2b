"""What a tool-call parser emits, and the pieces every format shares.

The events (`TextDelta`, `ToolCallStart`, `ToolCallArgsDelta`, `ToolCallEnd`), the
`ToolCallParser` protocol the formats in `ft.core.toolcalls` implement, reading a call object
out of JSON (`call_from_json`: strict, no NaN, no lone surrogates), numbering calls
(`CallEmitter`), the text around calls with whitespace-only runs held at a call boundary
(`TextAroundCalls`), the string scanner that tells whether JSON text ends inside a string
(`StringScan`), and the no-format `PassthroughParser`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ft.ids import random_id
from ft.params import has_lone_surrogate


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Plain assistant text, outside any tool call."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call begins: its position among this output's calls, its id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    """A fragment of call `index`'s JSON arguments string; the fragments concatenate to it."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """Call `index` is complete; `arguments` is its full, valid JSON arguments string."""

    index: int
    arguments: str


ToolEvent = TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


def new_tool_call_id() -> str:
    """A fresh OpenAI-style call id: `call_` and 24 random alphanumerics."""
    return random_id("call_")


class ToolCallParser(Protocol):
    """Turns streamed model text into `ToolEvent`s, incrementally."""

    def feed(self, text: str) -> list[ToolEvent]:
        """Consume the next text delta; return the events it completes (maybe none)."""
        ...

    def finish(self, *, is_cut: bool = False) -> list[ToolEvent]:
        """End of output: flush held-back text; an unterminated or invalid call becomes text,
        unless the output was cut short (`is_cut`): then the call it was writing is dropped."""
        ...

    @property
    def has_tool_calls(self) -> bool:
        """True once any `ToolCallStart` has been emitted."""
        ...


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def load_json(text: str) -> object:
    """`json.loads` that rejects NaN/Infinity, which would not round-trip as JSON."""
    return json.loads(text, parse_constant=_reject_constant)


def call_from_json(text: str) -> tuple[str, str] | None:
    """(name, compact arguments JSON) when `text` is a tool-call object, else None."""
    try:
        obj = load_json(text)
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = load_json(args)
    except (ValueError, RecursionError):  # NOTE: deep nesting is model output too
        return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    try:  # 1e400 parses as inf, which no client's JSON parser accepts back
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    # NOTE: JSON escapes can smuggle in lone surrogates, which cannot be sent as UTF-8.
    if has_lone_surrogate(name) or has_lone_surrogate(arguments):
        return None
    return name, arguments


class CallEmitter:
    """Numbers calls and gives each an id; shared bookkeeping of the parser families."""

    def __init__(self, id_factory: Callable[[], str]) -> None:
        self._id_factory = id_factory
        self.num_calls = 0

    def emit(self, name: str, arguments: str) -> list[ToolEvent]:
        index = self.num_calls
        self.num_calls += 1
        return [
            ToolCallStart(index, self._id_factory(), name),
            ToolCallArgsDelta(index, arguments),
            ToolCallEnd(index, arguments),
        ]


class TextAroundCalls:
    """Text outside calls, whitespace-only runs at a call boundary held back.

    At the start of the output and after each call, text that is only whitespace waits: it is
    dropped when a call follows it (so `content` is not just the newlines between calls), sent
    once other text follows, and at the end sent only if no call came (`finish`). The held
    runs are kept as pieces, so a flood of newlines costs linear time.
    """

    def __init__(self) -> None:
        self._held: list[str] = []
        self._is_at_boundary = True

    def emit(self, text: str, out: list[ToolEvent]) -> None:
        """Append `text` (maybe held back) to `out`."""
        if not text:
            return
        if self._is_at_boundary:
            if text.isspace():
                self._held.append(text)
                return
            text = "".join(self._held) + text
            self._held.clear()
            self._is_at_boundary = False
        out.append(TextDelta(text))

    def call_emitted(self) -> None:
        """A call was emitted: the whitespace before it goes, and a new boundary begins."""
        self._held.clear()
        self._is_at_boundary = True

    def finish(self, out: list[ToolEvent], *, keep: bool) -> None:
        """End of output: the held whitespace is sent when `keep` (no call came, none dropped)."""
        if keep and self._held:
            out.append(TextDelta("".join(self._held)))
        self._held.clear()


class PassthroughParser:
    """No tool-call format: every delta is text."""

    def feed(self, text: str) -> list[ToolEvent]:
        """Return `text` as a `TextDelta` (nothing for an empty delta)."""
        return [TextDelta(text)] if text else []

    def finish(self, *, is_cut: bool = False) -> list[ToolEvent]:
        """Nothing is ever held back."""
        return []

    @property
    def has_tool_calls(self) -> bool:
        """Always false."""
        return False


class StringScan:
    """Whether JSON text, read as the start of a value, ends inside an open string.

    Incremental: each call reads only what was added since the last one (the text only grows),
    so a call body quoting many closing tags is read once, not once per tag.
    """

    def __init__(self) -> None:
        self._pos = 0
        self._is_inside = False
        self._is_escaped = False

    def ends_inside(self, text: str) -> bool:
        """True when `text` (a longer version of the text of the last call) ends inside a string."""
        for ch in text[self._pos :]:
            if self._is_escaped:
                self._is_escaped = False
            elif ch == "\\" and self._is_inside:
                self._is_escaped = True
            elif ch == '"':
                self._is_inside = not self._is_inside
        self._pos = len(text)
        return self._is_inside
