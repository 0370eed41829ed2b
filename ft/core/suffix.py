"""Holding back text that may be the start of a marker (a stop string, a tag) still to come."""

from __future__ import annotations

from collections.abc import Sequence


def held_suffix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`.

    That much of `text` must wait for more output before it can be sent: it may yet turn into
    the marker.
    """
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
