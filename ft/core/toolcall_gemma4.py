"""Gemma 4's tool calls (`gemma4`, vLLM's name), as its chat template writes them:

```
<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
```

Calls follow each other with nothing between them. The arguments are Gemma 4's own notation,
read and typed by the tools' schemas in `ft.core.gemma4_arguments`. A `<|"|>`-delimited string
may hold anything but the marker itself, `<tool_call|>` included: only a `<tool_call|>` outside a
string closes the call. A `<|tool_call>` outside a string where the open call has not closed
ends it there (a model that never wrote its `<tool_call|>`): it is a call if it reads as one.

As the other formats (`ft.core.toolcalls`), text outside calls streams as soon as it cannot be
the start of `<|tool_call>`, a call is emitted whole once closed, whitespace between calls is
dropped, a call that does not read as one is text (its markers with it), a complete call whose
`<tool_call|>` never came is still read at the end, and one cut short (`finish(is_cut=True)`) is
dropped. Each delta is scanned once, with the few characters of a marker it may end in carried
to the next, so the cost is linear however the output is split.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ft.core.gemma4_arguments import QUOTE, read_call
from ft.core.suffix import held_suffix_len
from ft.core.toolcall_events import CallEmitter, TextAroundCalls, ToolEvent, new_tool_call_id
from ft.core.toolcall_schema import ToolSchemas

START = "<|tool_call>"
END = "<tool_call|>"
_IN_CALL = (QUOTE, END, START)  # what a call's text outside its strings is scanned for
_MARKS = re.compile("|".join(re.escape(m) for m in _IN_CALL))


class Gemma4ToolCallParser:
    """Gemma 4's tool calls, arguments typed by `tools` (see the module docstring).

    Outside a call `_held` is a possible start of `<|tool_call>`; inside one, `_body` holds the
    call's text scanned so far and `_held` the unscanned end that may be the start of a marker.
    """

    def __init__(
        self, tools: Sequence[Mapping[str, Any]] = (), id_factory: Callable[[], str] = new_tool_call_id
    ) -> None:
        self._schemas = ToolSchemas(tools)
        self._calls = CallEmitter(id_factory)
        self._text = TextAroundCalls()
        self._is_in_call = False
        self._is_in_string = False
        self._body: list[str] = []
        self._held = ""

    @property
    def has_tool_calls(self) -> bool:
        """True once any call has been emitted."""
        return self._calls.num_calls > 0

    def feed(self, text: str) -> list[ToolEvent]:
        """Consume a delta; return text that cannot be part of a marker, and completed calls."""
        out: list[ToolEvent] = []
        data, self._held = self._held + text, ""
        at = 0
        while at < len(data):
            at = self._read_call(data, at, out) if self._is_in_call else self._read_text(data, at, out)
        return out

    def finish(self, *, is_cut: bool = False) -> list[ToolEvent]:
        """Flush held text; an unclosed call is a call if it reads as one, else text, or
        dropped when cut short (`is_cut`)."""
        out: list[ToolEvent] = []
        is_dropped = False
        if self._is_in_call:
            body, held = "".join(self._body), self._held
            if not END.startswith(held):  # else the start of its `<tool_call|>`, not of the call
                body, held = body + held, ""
            self._is_in_call = False
            is_dropped = not self._close_call(body, held, out, is_cut=is_cut)
        elif is_cut and self._held:  # only ever a held prefix of `<|tool_call>`
            is_dropped = True
        else:
            self._text.emit(self._held, out)
        self._held, self._body = "", []
        self._text.finish(out, keep=not self.has_tool_calls and not is_dropped)
        return out

    def _read_text(self, data: str, at: int, out: list[ToolEvent]) -> int:
        """Text from `at` up to a `<|tool_call>` (past which a call opens); where the scan stopped."""
        start = data.find(START, at)
        if start < 0:
            keep = min(held_suffix_len(data, (START,)), len(data) - at)
            self._text.emit(data[at : len(data) - keep], out)
            self._held = data[len(data) - keep :]
            return len(data)
        self._text.emit(data[at:start], out)
        self._open_call()
        return start + len(START)

    def _read_call(self, data: str, at: int, out: list[ToolEvent]) -> int:
        """The open call's text from `at`: up to its close, or all of it (held: a marker's start)."""
        while True:
            if self._is_in_string:
                found = data.find(QUOTE, at)
                if found < 0:
                    return self._hold(data, at, (QUOTE,))
                self._body.append(data[at : found + len(QUOTE)])
                at, self._is_in_string = found + len(QUOTE), False
                continue
            mark = _MARKS.search(data, at)
            if mark is None:
                return self._hold(data, at, _IN_CALL)
            if mark.group() == QUOTE:
                self._body.append(data[at : mark.end()])
                at, self._is_in_string = mark.end(), True
                continue
            body = "".join(self._body) + data[at : mark.start()]
            self._is_in_call = False
            if mark.group() == END:
                self._close_call(body, END, out)
                return mark.end()
            self._close_call(body, "", out)  # a new call opens where this one never closed
            self._open_call()
            return mark.end()

    def _hold(self, data: str, at: int, marks: tuple[str, ...]) -> int:
        """Scan `data[at:]` into the body but for an end that may begin one of `marks`."""
        keep = min(held_suffix_len(data, marks), len(data) - at)
        self._body.append(data[at : len(data) - keep])
        self._held = data[len(data) - keep :]
        return len(data)

    def _open_call(self) -> None:
        self._is_in_call, self._is_in_string, self._body = True, False, []

    def _close_call(self, body: str, end: str, out: list[ToolEvent], *, is_cut: bool = False) -> bool:
        """Emit `body` as a call, or give it back as text with its markers (`is_cut`: drop it
        instead); False when dropped."""
        call = read_call(body, self._schemas)
        self._body = []
        if call is not None:
            self._text.call_emitted()
            out.extend(self._calls.emit(*call))
            return True
        if is_cut:
            return False
        self._text.emit(START + body + end, out)
        return True
