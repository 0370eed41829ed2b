"""Random ids for requests, messages, output items and tool calls: one generator for all."""

from __future__ import annotations

import secrets
import string

ALPHABET = string.ascii_letters + string.digits


def random_id(prefix: str, length: int = 24) -> str:
    """`prefix` then `length` random alphanumerics (`call_…`, `chatcmpl-…`, `msg_…`, `resp_…`)."""
    return prefix + "".join(secrets.choice(ALPHABET) for _ in range(length))
