"""Incremental detokenization and stop-string matching for one sequence.

Text is emitted only once it is valid UTF-8 (a character split across tokens is held until its
last byte arrives), and any tail that could still become a stop string is held back until it
either completes (the output ends before it) or diverges (it is emitted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ft.core.suffix import held_suffix_len

Decode = Callable[[Sequence[int]], str]

REPLACEMENT = "\ufffd"
# An incomplete UTF-8 character is at most 3 bytes, so at most 3 tokens: that many are held
# while the text ends in U+FFFD; past it the U+FFFD is the output's own (or bytes that never
# complete), and all but the last 3 are sent. This bounds every decode to a few tokens.
MAX_HELD_TOKENS = 3


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, decode: Decode, context_ids: Sequence[int] = ()) -> None:
        # `context_ids` (the prompt's tail) give the decoder left context, so a leading space
        # that depends on the previous token is decoded as it will be in the full text.
        self._decode = decode
        self._ids: list[int] = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty).

        Each decode covers at most `2 * (MAX_HELD_TOKENS + 1)` tokens, whatever the output, so
        detokenizing is linear in its length (a tail that was re-decoded while it ended in
        U+FFFD made 8,000 such tokens cost 5.46 s).
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self._advance(len(self._ids))
            return new_text[len(prefix_text) :]
        if len(self._ids) - self._read_offset <= MAX_HELD_TOKENS:
            return ""
        # More held than any incomplete character needs: the U+FFFD is the output's own (or
        # bytes that never complete). Send the text up to the latest token boundary that no
        # character spans (the two sides decode to the whole), keeping the last tokens held.
        cut_text = ""
        for cut in range(len(self._ids) - 1, len(self._ids) - MAX_HELD_TOKENS - 1, -1):
            cut_text = self._decode(self._ids[self._prefix_offset : cut])
            if cut_text + self._decode(self._ids[cut:]) == new_text:
                break
        self._advance(cut)
        return cut_text[len(prefix_text) :] if len(cut_text) > len(prefix_text) else ""

    def _advance(self, read_offset: int) -> None:
        # The tokens just sent become the left context of the next decode; older ones drop out.
        self._prefix_offset = self._read_offset
        self._read_offset = read_offset

    def flush(self) -> str:
        """Return whatever text is still held (invalid UTF-8 at the very end included)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopMatcher:
    """Finds stop strings in streamed text, holding back partial matches."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string that matched or None)."""
        if not self._stops:
            return text, None
        self._pending += text
        hit: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (hit is None or at < hit[0]):
                hit = (at, stop)
        if hit is not None:
            out = self._pending[: hit[0]]
            self._pending = ""
            return out, hit[1]
        keep = held_suffix_len(self._pending, self._stops)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None

    def flush(self) -> str:
        """The output ended: release the held-back text."""
        out, self._pending = self._pending, ""
        return out


class SeqDetokenizer:
    """Decoder plus stop matcher for one sequence."""

    def __init__(self, decode: Decode, stops: Sequence[str], context_ids: Sequence[int] = ()):
        self.decoder = IncrementalDecoder(decode, context_ids)
        self.stops = StopMatcher(stops)
        self.is_finished = False

    def add(self, token_id: int, *, is_last: bool, is_hidden: bool) -> tuple[str, str | None]:
        """Feed one token; return (text delta, matched stop string).

        `is_hidden` tokens (eos, stop ids) add no text; `is_last` flushes everything held.
        """
        text = "" if is_hidden else self.decoder.add(token_id)
        if is_last:
            text += self.decoder.flush()
        out, stop = self.stops.feed(text)
        if stop is not None:
            self.is_finished = True
            return out, stop
        if is_last:
            self.is_finished = True
            out += self.stops.flush()
        return out, None
