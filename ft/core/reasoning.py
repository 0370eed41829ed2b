"""Streaming reasoning parser: splits a reasoning block from the answer content.

One reasoning block per output, in one of two spellings (`ReasoningTags`): `<think>…</think>`,
as Qwen3 and DeepSeek-R1 write it, or Gemma 4's channel, `<|channel>thought\n…<channel|>` (the
channel's name, `thought`, is a label of the block, not reasoning: it is dropped with the
opening marker, as vLLM's `gemma4` parser drops it). The markers are stripped, along with the
newlines just inside them and just after the close (as the Qwen3 chat template does when it
replays a turn). Partial markers at a delta's end are held back, so the events never depend on
how the output was split into deltas.

A template may open the block itself (Qwen3.5's and the Qwen3 thinking models' generation
prompt ends with `<think>\n`): the model's output then begins inside its reasoning and only
writes the close. `reasoning_left_open` tells such a prompt, and which format it opened, and
the parser starts in reasoning (`starts_in_reasoning`).
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


@dataclass(frozen=True, slots=True)
class ReasoningTags:
    """How a format marks its reasoning block: the opening and closing markers, and the label
    that follows the opening one (Gemma 4's channel name), dropped with it when a newline or
    the close follows it."""

    open: str
    close: str
    label: str = ""


THINK = ReasoningTags("<think>", "</think>")
GEMMA4 = ReasoningTags("<|channel>", "<channel|>", "thought")
REASONING_TAGS: dict[str, ReasoningTags] = {"think": THINK, "deepseek_r1": THINK, "gemma4": GEMMA4}
REASONING_PARSERS: tuple[str, ...] = tuple(REASONING_TAGS)


class _Phase(Enum):
    BEFORE = auto()  # content; an opening marker starts reasoning
    REASONING = auto()
    AFTER = auto()  # content, with no more markers to look for


class ReasoningParser:
    """Splits streamed text into reasoning and content; `enabled=False` passes content through.

    With `starts_in_reasoning` the template already opened the block: output begins as
    reasoning (an opening marker the model writes anyway is dropped). Unterminated reasoning
    stays reasoning.
    """

    def __init__(
        self, tags: ReasoningTags = THINK, *, enabled: bool = True, starts_in_reasoning: bool = False
    ) -> None:
        self._tags = tags
        self._is_enabled = enabled
        self._phase = _Phase.REASONING if starts_in_reasoning else _Phase.BEFORE
        self._may_open = starts_in_reasoning  # a leading opening marker may still come and be dropped
        self._is_label_due = False  # the opening marker was read: its label may follow
        self._is_at_block_start = True
        self._buf = ""

    def feed(self, text: str) -> list[ReasoningEvent]:
        """Consume a delta; return what cannot be part of a marker (maybe nothing)."""
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
            if self._is_label_due and self._label_may_follow(text):
                return []  # the label, cut: no reasoning yet
            text = text.strip("\n") if self._is_at_block_start else text.rstrip("\n")
            return [ReasoningDelta(text)] if text else []
        return []  # AFTER holds only the newlines after the close, which are dropped

    def _step(self, out: list[ReasoningEvent]) -> bool:
        """Advance as far as the buffer allows; True when the phase changed and work remains."""
        tags = self._tags
        if self._phase is _Phase.BEFORE:
            start = self._buf.find(tags.open)
            if start < 0:
                self._emit_held_back(ContentDelta, held_suffix_len(self._buf, (tags.open,)), out)
                return False
            if start:
                out.append(ContentDelta(self._buf[:start]))
            self._buf = self._buf[start + len(tags.open) :]
            self._phase = _Phase.REASONING
            self._is_label_due = bool(tags.label)
            return True
        if self._phase is _Phase.REASONING:
            if self._may_open:
                stripped = self._buf.lstrip()
                if len(stripped) < len(tags.open) and tags.open.startswith(stripped):
                    return False
                if stripped.startswith(tags.open):
                    self._buf = stripped[len(tags.open) :]
                    self._is_label_due = bool(tags.label)
                self._may_open = False
            if self._is_label_due:
                if self._label_may_follow(self._buf):
                    return False
                if self._buf.startswith(tags.label + "\n") or self._buf.startswith(tags.label + tags.close):
                    self._buf = self._buf[len(tags.label) :]
                self._is_label_due = False
            if self._is_at_block_start:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return False
                self._is_at_block_start = False
            end = self._buf.find(tags.close)
            if end < 0:
                keep = held_suffix_len(self._buf, (tags.close,))
                body = self._buf[: len(self._buf) - keep].rstrip("\n")
                self._emit_held_back(ReasoningDelta, len(self._buf) - len(body), out)
                return False
            body = self._buf[:end].rstrip("\n")
            if body:
                out.append(ReasoningDelta(body))
            self._buf = self._buf[end + len(tags.close) :]
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

    def _label_may_follow(self, text: str) -> bool:
        """Whether `text`, read right after the opening marker, is too short to tell whether it
        begins with the label and what ends it (a newline or the close)."""
        tags = self._tags
        return any(
            len(text) < len(whole) and whole.startswith(text)
            for whole in (tags.label + "\n", tags.label + tags.close)
        )

    def _emit_held_back(
        self, kind: type[ReasoningDelta | ContentDelta], keep: int, out: list[ReasoningEvent]
    ) -> None:
        """Emit all of the buffer but its last `keep` characters as `kind`."""
        text = self._buf[: len(self._buf) - keep]
        if text:
            out.append(kind(text))
        self._buf = self._buf[len(self._buf) - keep :]


def reasoning_left_open(prompt_end: str) -> str | None:
    """The reasoning format whose block a rendered prompt ending in `prompt_end` leaves open for
    the model (it ends with `<think>`, or Gemma 4's `<|channel>thought`, and whitespace), else
    None.

    NOTE: only its very end counts, not any opening after the last close: a user who writes
    `<think>` in a question would otherwise turn a plain answer into reasoning.
    """
    end = prompt_end.rstrip()
    return next((name for name, tags in REASONING_TAGS.items() if end.endswith(tags.open + tags.label)), None)


def make_reasoning_parser(name: str | None, *, starts_in_reasoning: bool | None = None) -> ReasoningParser:
    """Build the reasoning parser for a format.

    Args:
        name: one of `REASONING_PARSERS`, or None to pass everything through as content.
        starts_in_reasoning: the prompt already opened the block; defaults to True for
            `deepseek_r1` (its template writes `<think>`), else False.
    Raises:
        ValueError: `name` is not a known format.
    """
    if name is None:
        return ReasoningParser(enabled=False)
    if name not in REASONING_TAGS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    default = name == "deepseek_r1"
    opens = default if starts_in_reasoning is None else starts_in_reasoning
    return ReasoningParser(REASONING_TAGS[name], starts_in_reasoning=opens)
