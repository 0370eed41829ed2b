"""Random ids for requests, messages, output items and tool calls: one generator for all."""

from __future__ import annotations

import secrets
import string

ALPHABET = string.ascii_letters + string.digits


def random_id(prefix: str, length: int = 24) -> str:
    """`prefix` then `length` random alphanumerics (`call_…`, `chatcmpl-…`, `msg_…`, `resp_…`)."""
    # NOTE: one draw from the OS, not one per character: each draw is a system call that gives
    # up the GIL, and while threads parse bodies the loop waits up to 5 ms to take it back
    # (24 draws per id made a flood of 100 bodies hold `/health` for seconds).
    number = secrets.randbelow(len(ALPHABET) ** length)
    chars = []
    for _ in range(length):
        number, digit = divmod(number, len(ALPHABET))
        chars.append(ALPHABET[digit])
    return prefix + "".join(chars)
