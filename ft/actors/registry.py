"""The request registry: the single source of truth for which requests are alive.

An entry exists exactly while its request scope is open. Actors route events through
`send_nowait(uid, ...)`; a uid that is gone (the client left) silently drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from ft.core.detok import SeqDetokenizer
from ft.errors import FtError
from ft.messages import Failed, RequestEvent
from ft.params import SamplingParams


@dataclass(eq=False, slots=True)
class RequestEntry:
    """What the engine knows about one live request."""

    uid: int
    params: SamplingParams
    send: trio.MemorySendChannel[RequestEvent]
    created_at: float
    detoks: dict[int, SeqDetokenizer] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()
    request_id: str = ""  # the caller's id for it (the HTTP `X-Request-Id`), for logs
    scheduled_at: float | None = None  # its first step was scheduled (the end of its queue time)
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # seconds between steps that gave tokens
    num_finished: int = 0  # choices whose last delta was routed
    is_done: bool = False  # the engine is done with it: every choice finished, or it failed

    @property
    def log_extra(self) -> dict[str, str]:
        """`extra=` for a log record about this request (`ft.logs` shows its id)."""
        return {"request_id": self.request_id}


class Registry:
    """Live requests by uid; `len()` is `requests.active`.

    A request the engine is done with (every choice finished, or it failed) stays registered
    until its scope closes, while its client reads the rest of its output; `num_in_engine`
    leaves those out: it is what admission counts, so clients that read slowly (or not at all,
    until the send timeout) cannot hold the engine's capacity.
    """

    def __init__(self) -> None:
        self._entries: dict[int, RequestEntry] = {}
        self._num_done = 0
        self._empty = trio.Event()  # set while no request is registered; a new one while some are
        self._empty.set()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_in_engine(self) -> int:
        """Live requests the engine still works for (queued, tokenizing, prefilling, decoding)."""
        return len(self._entries) - self._num_done

    @property
    def num_sending(self) -> int:
        """Live requests the engine is done with, whose output the client is still reading."""
        return self._num_done

    def is_in_engine(self, uid: int) -> bool:
        """Whether `uid` is live and the engine still works for it (counted by `num_in_engine`)."""
        entry = self._entries.get(uid)
        return entry is not None and not entry.is_done

    def __contains__(self, uid: object) -> bool:
        return uid in self._entries

    def get(self, uid: int) -> RequestEntry | None:
        """The entry for `uid`, or None once its scope has closed."""
        return self._entries.get(uid)

    def uids(self) -> list[int]:
        """Every live uid."""
        return list(self._entries)

    def add(self, entry: RequestEntry) -> None:
        """Register a request (called on scope entry)."""
        assert entry.uid not in self._entries
        if self._empty.is_set():
            self._empty = trio.Event()
        self._entries[entry.uid] = entry

    def remove(self, uid: int) -> RequestEntry | None:
        """Unregister and close a request's channel. Synchronous; safe while cancelled."""
        entry = self._entries.pop(uid, None)
        if entry is not None:
            entry.send.close()
            if entry.is_done:
                self._num_done -= 1
            if not self._entries:
                self._empty.set()
        return entry

    async def wait_empty(self) -> None:
        """Wait until no request is registered (at once, with a checkpoint, if none is)."""
        await self._empty.wait()

    def note_finished(self, entry: RequestEntry) -> None:
        """One of `entry`'s choices has had its last delta routed."""
        entry.num_finished += 1
        if entry.num_finished >= entry.params.n:
            self._mark_done(entry)

    def _mark_done(self, entry: RequestEntry) -> None:
        if not entry.is_done and self._entries.get(entry.uid) is entry:
            entry.is_done = True
            self._num_done += 1

    def send_nowait(self, uid: int, event: RequestEvent) -> bool:
        """Route an event to a live request; False when it is gone."""
        entry = self._entries.get(uid)
        if entry is None:
            return False
        try:
            entry.send.send_nowait(event)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        except trio.WouldBlock:
            # Cannot happen with the bound open_request computes; if it ever does, end this
            # request (its stream raises RequestAborted) rather than the detokenizer actor.
            entry.send.close()
            self._mark_done(entry)
            return False
        return True

    def fail(self, uid: int, error: FtError) -> bool:
        """Make the request's stream raise `error` (the engine is done with it)."""
        sent = self.send_nowait(uid, Failed(error))
        entry = self._entries.get(uid)
        if entry is not None:
            self._mark_done(entry)
        return sent
