"""Streaming reasoning parser: splits `<think>…</think>` reasoning from the answer content.

One reasoning block per output, as Qwen3 and DeepSeek-R1 write it. The tags are stripped, along
with the newlines just inside them and just after `</think>` (as the Qwen3 chat template does
when it replays a turn). Partial tags at a delta's end are held back, so the events never depend
on how the output was split into deltas.

A template may open the block itself (Qwen3.5's and the Qwen3 thinking models' generation
prompt ends with `<think>\n`): the model's output then begins inside its reasoning and only
writes `</think>`. `leaves_reasoning_open` tells such a prompt, and the parser starts in
reasoning (`starts_in_reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from ft.core.suffix import held_suffix_len


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Text from inside the reasoning block."""

    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Answer text, outside the reasoning block."""

    text: str


ReasoningEvent = ReasoningDelta | ContentDelta

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


class _Phase(Enum):
    BEFORE = auto()  # content; an opening tag starts reasoning
    REASONING = auto()
    AFTER = auto()  # content, with no more tags to look for


class ReasoningParser:
    """Splits streamed text into reasoning and content; `enabled=False` passes content through.

    With `starts_in_reasoning` the template already wrote `<think>`: output begins as reasoning
    (an opening tag the model writes anyway is dropped). Unterminated reasoning stays reasoning.
    """

    def __init__(self, *, enabled: bool = True, starts_in_reasoning: bool = False) -> None:
        self._is_enabled = enabled
        self._phase = _Phase.REASONING if starts_in_reasoning else _Phase.BEFORE
        self._may_open = starts_in_reasoning  # a leading `<think>` may still come and be dropped
        self._is_at_block_start = True
        self._buf = ""

    def feed(self, text: str) -> list[ReasoningEvent]:
        """Consume a delta; return what cannot be part of a tag (maybe nothing)."""
        if not self._is_enabled:
            return [ContentDelta(text)] if text else []
        self._buf += text
        out: list[ReasoningEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ReasoningEvent]:
        """End of output: flush held-back text in the current phase."""
        text, self._buf = self._buf, ""
        if self._phase is _Phase.BEFORE:
            return [ContentDelta(text)] if text else []
        if self._phase is _Phase.REASONING:
            text = text.strip("\n") if self._is_at_block_start else text.rstrip("\n")
            return [ReasoningDelta(text)] if text else []
        return []  # AFTER holds only the newlines after `</think>`, which are dropped

    def _step(self, out: list[ReasoningEvent]) -> bool:
        """Advance as far as the buffer allows; True when the phase changed and work remains."""
        if self._phase is _Phase.BEFORE:
            start = self._buf.find(OPEN_TAG)
            if start < 0:
                self._emit_held_back(ContentDelta, held_suffix_len(self._buf, (OPEN_TAG,)), out)
                return False
            if start:
                out.append(ContentDelta(self._buf[:start]))
            self._buf = self._buf[start + len(OPEN_TAG) :]
            self._phase = _Phase.REASONING
            return True
        if self._phase is _Phase.REASONING:
            if self._may_open:
                stripped = self._buf.lstrip()
                if len(stripped) < len(OPEN_TAG) and OPEN_TAG.startswith(stripped):
                    return False
                if stripped.startswith(OPEN_TAG):
                    self._buf = stripped[len(OPEN_TAG) :]
                self._may_open = False
            if self._is_at_block_start:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return False
                self._is_at_block_start = False
            end = self._buf.find(CLOSE_TAG)
            if end < 0:
                keep = held_suffix_len(self._buf, (CLOSE_TAG,))
                body = self._buf[: len(self._buf) - keep].rstrip("\n")
                self._emit_held_back(ReasoningDelta, len(self._buf) - len(body), out)
                return False
            body = self._buf[:end].rstrip("\n")
            if body:
                out.append(ReasoningDelta(body))
            self._buf = self._buf[end + len(CLOSE_TAG) :]
            self._phase = _Phase.AFTER
            self._is_at_block_start = True
            return True
        if self._is_at_block_start:
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return False
            self._is_at_block_start = False
        if self._buf:
            out.append(ContentDelta(self._buf))
        self._buf = ""
        return False

    def _emit_held_back(
        self, kind: type[ReasoningDelta | ContentDelta], keep: int, out: list[ReasoningEvent]
    ) -> None:
        """Emit all of the buffer but its last `keep` characters as `kind`."""
        text = self._buf[: len(self._buf) - keep]
        if text:
            out.append(kind(text))
        self._buf = self._buf[len(self._buf) - keep :]


def leaves_reasoning_open(prompt_end: str) -> bool:
    """Whether a rendered prompt ending in `prompt_end` leaves a reasoning block open for the
    model: it ends with `<think>` (and whitespace).

    NOTE: only its very end counts, not any `<think>` after the last `</think>`: a user who
    writes `<think>` in a question would otherwise turn a plain answer into reasoning.
    """
    return prompt_end.rstrip().endswith(OPEN_TAG)


REASONING_PARSERS: tuple[str, ...] = ("think", "deepseek_r1")


def make_reasoning_parser(name: str | None, *, starts_in_reasoning: bool | None = None) -> ReasoningParser:
    """Build the reasoning parser for a format.

    Args:
        name: one of `REASONING_PARSERS`, or None to pass everything through as content.
        starts_in_reasoning: the prompt already ends with `<think>`; defaults to False for
            `think` and True for `deepseek_r1`.
    Raises:
        ValueError: `name` is not a known format.
    """
    if name is None:
        return ReasoningParser(enabled=False)
    if name == "think":
        return ReasoningParser(starts_in_reasoning=bool(starts_in_reasoning))
    if name == "deepseek_r1":
        return ReasoningParser(starts_in_reasoning=starts_in_reasoning is not False)
    raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
