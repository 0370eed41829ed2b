"""Stored responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`), in memory,
as JSON bytes.

A stored response keeps its `response` object and its whole conversation as chat-template
messages (the earlier turns and its input, then its output), so a request that continues it
reads one entry: there is no chain to walk, and none can loop (an id is made by this server and
stored only after its response finished, so no response can name itself or a later one).

Everything is kept as JSON bytes, never as Python objects: a conversation of parsed tool-call
arguments held as dicts cost ~3x its JSON in memory and millions of heap blocks, and measuring
it (`json.dumps`) on the event loop stalled every stream. The bytes are made after the request's
body is parsed, off the loop (`continue_conversation`, which also decodes the earlier turns of
`previous_response_id`), and at the end of the response with its body (`stored`); `GET` answers
the stored bytes as they are. A conversation is kept as one JSON array per turn (a request's
input, a response's output), so continuing one encodes only the new input.

The store is bounded four ways: at most `max_entries` responses and `max_bytes` of them in all
(the least recently used go first), none older than `max_age_s` (the oldest go first), and a
conversation is at most `MAX_HISTORY_MESSAGES` messages and `max_entry_bytes` (continuing past
either is a 400; a new response past them is served, not stored). Nothing survives a restart.
Thread-safe: each call holds a lock for dictionary work only (an eviction pops entries, no call
encodes or decodes anything).

A stored response belongs to its `owner` (the tenant that made it, `ft.server.edge.tenants`;
None with one API key or none): `get` and `delete` by any other owner find nothing, exactly as
for an id never stored, and leave the entry as it was (not even its recency changes).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ft.errors import InvalidRequest
from ft.server.edge.body import yield_gil
from ft.server.edge.http_errors import dumps

MAX_HISTORY_MESSAGES = 4096
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_AGE_S = 86400.0
DEFAULT_MAX_ENTRY_BYTES = 8 << 20
EMPTY = b"[]"
ARGUMENTS_JSON = "arguments_json"  # where a stored tool call keeps its arguments object, as JSON


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response, as JSON: `response` (what `GET` answers), `history` (the turns
    before its output: each earlier request's input and output, then its own input) and
    `output` (its output's messages), each turn a JSON array of chat-template messages;
    `num_messages` counts them all."""

    response: bytes
    history: tuple[bytes, ...]
    output: bytes
    num_messages: int

    @property
    def num_bytes(self) -> int:
        """What it holds, in bytes (what the store's byte bound counts)."""
        return len(self.response) + self.num_conversation_bytes

    @property
    def num_conversation_bytes(self) -> int:
        """The bytes of its conversation (history and output)."""
        return sum(len(turn) for turn in self.history) + len(self.output)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A request's conversation before its output: `messages` for the chat template, and
    `history`, its turns as JSON arrays to store (None: not to be stored, or too large)."""

    messages: list[dict[str, Any]]
    history: tuple[bytes, ...] | None


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """How full the store is."""

    num_entries: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class _Slot:
    entry: StoredResponse
    owner: str | None
    expires_at: float


class ResponseStore:
    """Bounded store of finished responses by id: least recently used out past `max_entries` /
    `max_bytes`, oldest out past `max_age_s` (by `clock`, `time.monotonic` unless a test's)."""

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1 or max_bytes < 1 or max_entry_bytes < 1 or not max_age_s > 0:
            raise ValueError("the response store's bounds must be positive")
        self.max_entries, self.max_bytes, self.max_age_s = max_entries, max_bytes, max_age_s
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Slot] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[str, float] = OrderedDict()  # id -> expiry, oldest first
        self._num_bytes = 0

    def get(self, response_id: str, *, owner: str | None) -> StoredResponse | None:
        """The stored response `response_id` of `owner` (now the most recently used), or None
        (also when another owner stored it)."""
        with self._lock:
            self._expire()
            slot = self._entries.get(response_id)
            if slot is None or slot.owner != owner:
                return None
            self._entries.move_to_end(response_id)
            return slot.entry

    def put(self, response_id: str, entry: StoredResponse, *, owner: str | None) -> bool:
        """Store a finished response of `owner`; False when it is too large to keep (see
        `is_storable`).

        Evicts the oldest past `max_age_s`, then the least recently used past `max_entries` /
        `max_bytes`.
        """
        if not self.is_storable(entry.num_bytes, entry.num_messages):
            return False
        with self._lock:
            self._pop(response_id)
            self._entries[response_id] = _Slot(entry, owner, self._clock() + self.max_age_s)
            self._by_age[response_id] = self._entries[response_id].expires_at
            self._num_bytes += entry.num_bytes
            self._expire()
            while len(self._entries) > self.max_entries or self._num_bytes > self.max_bytes:
                self._pop(next(iter(self._entries)))
        return True

    def delete(self, response_id: str, *, owner: str | None) -> bool:
        """Forget response `response_id` of `owner`; False (and nothing forgotten) when `owner`
        has no such response stored."""
        with self._lock:
            slot = self._entries.get(response_id)
            return slot is not None and slot.owner == owner and self._pop(response_id)

    def is_storable(self, num_bytes: int, num_messages: int) -> bool:
        """Whether a response of `num_bytes` whose conversation has `num_messages` may be kept."""
        return num_bytes <= self.max_entry_bytes and num_messages <= MAX_HISTORY_MESSAGES

    def statistics(self) -> StoreStatistics:
        """The number of stored responses and the bytes they hold."""
        with self._lock:
            self._expire()
            return StoreStatistics(len(self._entries), self._num_bytes)

    def _expire(self) -> None:
        """Drop the responses past their age (holding the lock); the oldest are first."""
        now = self._clock()
        while self._by_age:
            response_id, expires_at = next(iter(self._by_age.items()))
            if expires_at > now:
                return
            self._pop(response_id)

    def _pop(self, response_id: str) -> bool:
        slot = self._entries.pop(response_id, None)
        if slot is None:
            return False
        del self._by_age[response_id]
        self._num_bytes -= slot.entry.num_bytes
        return True


def continue_conversation(
    earlier: StoredResponse | None, more: list[dict[str, Any]], *, is_stored: bool, max_entry_bytes: int
) -> Conversation:
    """The conversation of a request: `earlier`'s (the response `previous_response_id` names,
    decoded), then `more` (the request's input), with its turns as JSON when it is to be
    stored. Linear in their size: run it where the body is parsed, off the loop. Only `more` is
    encoded (`earlier`'s turns are kept as they are), and each turn is decoded on its own, so
    no one call holds the GIL longer than a request body's parse.

    Raises:
        InvalidRequest: continuing `earlier` makes a conversation longer than a stored one may be.
    """
    if earlier is None:
        if not is_stored:
            return Conversation(more, None)
        encoded = encode_messages(more)
        fits = len(encoded) <= max_entry_bytes
        return Conversation(more, (encoded,) if fits else None)  # too large: served, not stored
    turns = (*earlier.history, earlier.output)
    messages: list[dict[str, Any]] = []
    for turn in turns:
        messages.extend(decode_messages(turn))
        yield_gil()
    messages.extend(more)
    if len(messages) > MAX_HISTORY_MESSAGES:
        raise InvalidRequest(
            f"the conversation continued from previous_response_id would have {len(messages)} "
            f"messages, over this server's limit of {MAX_HISTORY_MESSAGES}; start a new one",
            param="previous_response_id",
        )
    encoded = encode_messages(more)
    if earlier.num_conversation_bytes + len(encoded) > max_entry_bytes:
        raise InvalidRequest(
            f"the conversation continued from previous_response_id would be over "
            f"{max_entry_bytes} bytes, this server's limit; start a new one",
            param="previous_response_id",
        )
    return Conversation(messages, (*turns, encoded) if is_stored else None)


def stored(
    response: dict[str, Any], conversation: Conversation, output: list[dict[str, Any]]
) -> StoredResponse | None:
    """The record of a finished `response` whose conversation was `conversation` and whose
    output's messages are `output`; None when the conversation is not to be stored. Linear in
    the response: run it with the response's body (off the loop when it is large)."""
    if conversation.history is None:
        return None
    return StoredResponse(
        response=dumps(response).encode("ascii"),
        history=conversation.history,
        output=encode_messages(output) if output else EMPTY,
        num_messages=len(conversation.messages) + len(output),
    )


def encode_messages(messages: Sequence[dict[str, Any]]) -> bytes:
    """Chat-template messages as a compact JSON array (UTF-8: a third of `\\u` escapes' size).

    A tool call's arguments object is kept as its own JSON text (`ARGUMENTS_JSON`), encoded and
    decoded one call at a time, giving up the GIL between: a turn of 58 calls of 9,000 integers
    each took 0.1 s in one `json.loads`, a pause for every other thread (the event loop's).
    """
    flat = [_flat_calls(m) if m.get("tool_calls") else m for m in messages]
    text = json.dumps(flat, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8", "surrogatepass")


def decode_messages(data: bytes) -> list[dict[str, Any]]:
    """The messages `encode_messages` encoded."""
    messages: list[dict[str, Any]] = json.loads(data.decode("utf-8", "surrogatepass"))
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function")
            if isinstance(function, dict) and ARGUMENTS_JSON in function:
                function["arguments"] = json.loads(function.pop(ARGUMENTS_JSON))
                yield_gil()
    return messages


def _flat_calls(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with each tool call's arguments object as JSON text (a copy; strings as they are)."""
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function")
        if isinstance(function, dict) and not isinstance(function.get("arguments", ""), str):
            text = json.dumps(
                function["arguments"], ensure_ascii=False, separators=(",", ":"), allow_nan=False
            )
            rest = {k: v for k, v in function.items() if k != "arguments"}
            call = {**call, "function": {**rest, ARGUMENTS_JSON: text}}
            yield_gil()
        calls.append(call)
    return {**message, "tool_calls": calls}
