"""Qwen3-Coder's, Qwen3.5's and Qwen3-Next's XML tool calls (`qwen3_coder`, vLLM's name):

```
<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
</function>
</tool_call>
```

A parameter's value is raw text (one newline after its tag and one before `</parameter>` are
the format's, not the value's), typed by the tool's schema (`ft.core.toolcall_schema`): the
parser is given the request's tools. A value may hold anything, newlines, `<`, tags, even
`</parameter>` itself: it ends only at a `</parameter>` followed (after whitespace) by the next
`<parameter=`, by `</function>` or by `</tool_call>`. A call is complete at `</function>` (the
`</tool_call>` after it is optional, as is the `<tool_call>` before `<function=`: models drop
either), or at a `</tool_call>` where a parameter or `</function>` was due.

As the other formats (`ft.core.toolcalls`), text outside calls streams as soon as it cannot be a
tag's start, a call is emitted whole once complete, whitespace between calls is dropped, a call
that turns out malformed is text, and one cut short (`finish(is_cut=True)`) is dropped. Every
character is read a bounded number of times, however the output is split.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from enum import Enum, auto
from typing import Any

from ft.core.suffix import held_suffix_len
from ft.core.toolcall_events import CallEmitter, TextAroundCalls, ToolEvent, new_tool_call_id
from ft.core.toolcall_schema import ToolSchemas, typed_value
from ft.grammar.tool_parameters import MAX_XML_NAME_CHARS as MAX_NAME_CHARS
from ft.grammar.tool_parameters import XML_NAME_BREAKS

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_WHITESPACE = " \t\r\n"
_OPENING = re.compile(re.escape(START) + "|" + re.escape(FUNCTION))
_AFTER_VALUE = (PARAMETER, FUNCTION_END, END)  # what makes a `</parameter>` close its value
_LOOKAHEAD = max(len(t) for t in _AFTER_VALUE)


class _State(Enum):
    TEXT = auto()  # outside calls: looking for `<tool_call>` or `<function=`
    HEAD = auto()  # after `<tool_call>`: `<function=` is due
    NAME = auto()  # a function's or a parameter's name, up to `>`
    BODY = auto()  # `<parameter=` or `</function>` (or `</tool_call>`) is due
    VALUE = auto()  # a parameter's value, up to the `</parameter>` that closes it
    CLOSE = auto()  # after `</function>`: an optional `</tool_call>`


class XmlToolCallParser:
    """Qwen3-Coder's XML tool calls, arguments typed by `tools` (see the module docstring).

    The unread text is `_buf[_at:]`; every move advances `_at` past what it read, so nothing is
    copied or scanned again however many tags one delta holds.
    """

    def __init__(
        self, tools: Sequence[Mapping[str, Any]] = (), id_factory: Callable[[], str] = new_tool_call_id
    ) -> None:
        self._schemas = ToolSchemas(tools)
        self._calls = CallEmitter(id_factory)
        self._text = TextAroundCalls()
        self._state = _State.TEXT
        self._buf = ""
        self._at = 0
        self._raw: list[str] = []  # the open call's text so far, given back if it fails
        self._function: str | None = None  # the open call's name, once read
        self._params: dict[str, str] = {}
        self._param = ""  # the parameter whose value is being read
        self._value: list[str] = []
        # VALUE: a `</parameter>` and the whitespace after it, until what follows says whether
        # it closes the value; CLOSE: the whitespace after `</function>`.
        self._pending: list[str] = []
        self._is_closing = False

    @property
    def has_tool_calls(self) -> bool:
        """True once any call has been emitted."""
        return self._calls.num_calls > 0

    def feed(self, text: str) -> list[ToolEvent]:
        """Consume a delta; return text that cannot be part of a tag, and completed calls."""
        out: list[ToolEvent] = []
        self._buf = self._buf[self._at :] + text
        self._at = 0
        while self._step(out):
            pass
        return out

    def finish(self, *, is_cut: bool = False) -> list[ToolEvent]:
        """Flush held text; an unfinished call is text, or dropped when cut short (`is_cut`)."""
        out: list[ToolEvent] = []
        rest = self._buf[self._at :]
        is_dropped = False
        if self._state is _State.TEXT:
            if is_cut and rest:  # only ever a held prefix of an opening tag
                is_dropped = True
            else:
                self._text.emit(rest, out)
        elif self._state is not _State.CLOSE:  # CLOSE holds only what may be `</tool_call>`
            if is_cut:
                is_dropped = True
            else:
                self._text.emit("".join(self._raw + self._pending) + rest, out)
        self._reset_call(_State.TEXT)
        self._buf, self._at = "", 0
        self._text.finish(out, keep=not self.has_tool_calls and not is_dropped)
        return out

    # --- the state machine ---------------------------------------------------------------

    def _step(self, out: list[ToolEvent]) -> bool:
        """One move; False when it needs more text."""
        match self._state:
            case _State.TEXT:
                return self._read_text(out)
            case _State.HEAD:
                return self._expect((FUNCTION,), out)
            case _State.NAME:
                return self._read_name(out)
            case _State.BODY:
                return self._expect(_AFTER_VALUE, out)
            case _State.VALUE:
                return self._read_value()
            case _State.CLOSE:
                return self._read_close(out)

    def _read_text(self, out: list[ToolEvent]) -> bool:
        found = _OPENING.search(self._buf, self._at)
        if found is None:
            keep = min(held_suffix_len(self._buf, (START, FUNCTION)), len(self._buf) - self._at)
            self._text.emit(self._buf[self._at : len(self._buf) - keep], out)
            self._at = len(self._buf) - keep
            return False
        self._text.emit(self._buf[self._at : found.start()], out)
        self._at = found.start()
        self._consume(found.end())
        self._state = _State.HEAD if found.group() == START else _State.NAME
        return True

    def _expect(self, tags: tuple[str, ...], out: list[ToolEvent]) -> bool:
        """Whitespace, then one of `tags`: consumed and acted on; anything else fails the call."""
        self._consume(self._skip_whitespace())
        rest = self._buf[self._at : self._at + _LOOKAHEAD]
        if _may_become(rest, tags):
            return False
        tag = next((t for t in tags if rest.startswith(t)), None)
        if tag is None:
            self._fail(out)
            return True
        self._consume(self._at + len(tag))
        if tag in (FUNCTION, PARAMETER):
            self._state = _State.NAME
        elif tag == FUNCTION_END:
            self._close_call(out)
            self._state = _State.CLOSE
        else:  # `</tool_call>` where a parameter or `</function>` was due
            self._close_call(out)
            self._state = _State.TEXT
        return True

    def _read_name(self, out: list[ToolEvent]) -> bool:
        buf, at = self._buf, self._at
        end = buf.find(">", at, at + MAX_NAME_CHARS + 1)
        name = buf[at : end if end >= 0 else at + MAX_NAME_CHARS + 1]
        if any(c in name for c in XML_NAME_BREAKS) or len(name) > MAX_NAME_CHARS:
            self._fail(out)
            return True
        if end < 0:
            return False
        name = name.strip(" ")
        if not name:
            self._fail(out)
            return True
        self._consume(end + 1)
        if self._function is None:
            self._function = name
            self._state = _State.BODY
        else:
            self._param, self._value = name, []
            self._state = _State.VALUE
        return True

    def _read_value(self) -> bool:
        """Value text up to a `</parameter>`; then what follows it says whether it closes."""
        buf = self._buf
        if not self._is_closing:
            end = buf.find(PARAMETER_END, self._at)
            if end < 0:
                keep = min(held_suffix_len(buf, (PARAMETER_END,)), len(buf) - self._at)
                self._take_value(len(buf) - keep)
                return False
            self._take_value(end)
            self._is_closing = True
            self._pending = [PARAMETER_END]
            self._at += len(PARAMETER_END)
        start = self._at
        self._at = self._skip_whitespace()
        self._pending.append(buf[start : self._at])
        rest = buf[self._at : self._at + _LOOKAHEAD]
        if any(rest.startswith(t) for t in _AFTER_VALUE):
            self._params[self._param] = _strip_newlines("".join(self._value))
            self._raw += self._pending
            self._pending, self._is_closing, self._value = [], False, []
            self._state = _State.BODY
            return True
        if _may_become(rest, _AFTER_VALUE):
            return False  # the next tag may be on its way
        self._value += self._pending  # the value quotes `</parameter>`: read on
        self._raw += self._pending
        self._pending, self._is_closing = [], False
        return True

    def _read_close(self, out: list[ToolEvent]) -> bool:
        start = self._at
        self._at = self._skip_whitespace()
        self._pending.append(self._buf[start : self._at])
        rest = self._buf[self._at : self._at + len(END)]
        if _may_become(rest, (END,)):
            return False
        if rest.startswith(END):
            self._at += len(END)
        else:  # no `</tool_call>`: the whitespace is text after the call
            self._text.emit("".join(self._pending), out)
        self._pending = []
        self._state = _State.TEXT
        return True

    # --- bookkeeping ---------------------------------------------------------------------

    def _skip_whitespace(self) -> int:
        """Where the whitespace at `_at` ends."""
        buf, pos = self._buf, self._at
        while pos < len(buf) and buf[pos] in _WHITESPACE:
            pos += 1
        return pos

    def _consume(self, end: int) -> None:
        """Read the buffer up to `end` into the open call's raw text."""
        if end > self._at:
            self._raw.append(self._buf[self._at : end])
            self._at = end

    def _take_value(self, end: int) -> None:
        """Read the buffer up to `end` into the value (and the raw text)."""
        if end > self._at:
            piece = self._buf[self._at : end]
            self._value.append(piece)
            self._raw.append(piece)
            self._at = end

    def _close_call(self, out: list[ToolEvent]) -> None:
        assert self._function is not None
        arguments = {
            name: typed_value(raw, self._schemas.parameter(self._function, name))
            for name, raw in self._params.items()
        }
        self._text.call_emitted()
        out.extend(self._calls.emit(self._function, json.dumps(arguments, ensure_ascii=False)))
        self._reset_call(self._state)

    def _fail(self, out: list[ToolEvent]) -> None:
        """The open call is malformed: its text so far is text; read on from where it failed."""
        self._text.emit("".join(self._raw), out)
        self._reset_call(_State.TEXT)

    def _reset_call(self, state: _State) -> None:
        self._state = state
        self._raw, self._function, self._params, self._param, self._value = [], None, {}, "", []
        self._pending, self._is_closing = [], False


def _may_become(rest: str, tags: tuple[str, ...]) -> bool:
    """Whether `rest`, the unread text (up to the longest tag's length), is too short to tell:
    empty, or a proper prefix of one of `tags` that the buffer ends in."""
    return not rest or any(len(rest) < len(t) and t.startswith(rest) for t in tags)


def _strip_newlines(value: str) -> str:
    """A value without the newline after its tag and the one before `</parameter>`."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
