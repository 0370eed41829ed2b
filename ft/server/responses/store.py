"""Stored responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`), in memory.

A stored response keeps its `response` object and its whole conversation as chat-template
messages (the earlier turns, its input, its output), so a request that continues it reads one
entry: there is no chain to walk, and none can loop (an id is made by this server and stored
only after its response finished, so no response can name itself or a later one). The store
is bounded three ways: at most `max_entries` responses and `max_bytes` of them in all (the
least recently used go first), and a conversation is at most `MAX_HISTORY_MESSAGES` messages
and `max_entry_bytes` (continuing past either is a 400). Nothing survives a restart. A plain
synchronous class: the routes call it on the event loop, and each call is bounded by the
sizes above.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ft.errors import InvalidRequest

MAX_HISTORY_MESSAGES = 4096
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_ENTRY_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its `response` object, its conversation, and their size in bytes."""

    response: dict[str, Any]
    messages: tuple[dict[str, Any], ...]
    num_bytes: int


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """How full the store is."""

    num_entries: int
    num_bytes: int


class ResponseStore:
    """Bounded, least-recently-used store of finished responses by id."""

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ) -> None:
        if max_entries < 1 or max_bytes < 1 or max_entry_bytes < 1:
            raise ValueError("the response store's bounds must be positive")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_bytes = 0

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response `response_id` (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def history(self, response_id: str, more: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation that response `response_id` ended, followed by `more` messages.

        Raises:
            InvalidRequest: no such stored response, or the conversation would be longer than
                a stored one may be (`previous_response_id`).
        """
        entry = self.get(response_id)
        if entry is None:
            raise InvalidRequest(
                f"previous response '{response_id[:64]}' not found: it was not stored "
                "(store: false), was deleted, or was evicted from this server's bounded store",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        messages = [*entry.messages, *more]
        if len(messages) > MAX_HISTORY_MESSAGES:
            raise InvalidRequest(
                f"the conversation continued from previous_response_id would have {len(messages)} "
                f"messages, over this server's limit of {MAX_HISTORY_MESSAGES}; start a new one",
                param="previous_response_id",
            )
        if entry.num_bytes + _size(more) > self.max_entry_bytes:
            raise InvalidRequest(
                f"the conversation continued from previous_response_id would be over "
                f"{self.max_entry_bytes} bytes, this server's limit; start a new one",
                param="previous_response_id",
            )
        return messages

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Store a finished response; False when its conversation is too large to keep.

        Evicts the least recently used responses past `max_entries` / `max_bytes`.
        """
        num_bytes = _size(response) + _size(messages)
        if num_bytes > self.max_entry_bytes or len(messages) > MAX_HISTORY_MESSAGES:
            return False
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(response, tuple(messages), num_bytes)
        self._num_bytes += num_bytes
        while len(self._entries) > self.max_entries or self._num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._num_bytes -= evicted.num_bytes
        return True

    def delete(self, response_id: str) -> bool:
        """Forget response `response_id`; False when it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._num_bytes -= entry.num_bytes
        return True

    def statistics(self) -> StoreStatistics:
        """The number of stored responses and their bytes."""
        return StoreStatistics(len(self._entries), self._num_bytes)


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
