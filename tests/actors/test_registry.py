"""The registry's idle wait: woken by the last removal, never by a clock."""

from __future__ import annotations

import trio
import trio.testing

from ft.actors.registry import Registry, RequestEntry
from ft.messages import RequestEvent
from ft.params import SamplingParams


def _entry(registry: Registry, uid: int) -> RequestEntry:
    send, _ = trio.open_memory_channel[RequestEvent](1)
    entry = RequestEntry(uid, SamplingParams(), send, 0.0)
    registry.add(entry)
    return entry


async def test_wait_empty_wakes_on_the_last_removal_with_the_clock_stopped(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The waiter wakes when the last entry leaves, not before, and no time passes: no polling."""
    registry = Registry()
    _entry(registry, 1)
    _entry(registry, 2)
    woke: list[float] = []

    async def waiter() -> None:
        await registry.wait_empty()
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        registry.remove(1)
        await trio.testing.wait_all_tasks_blocked()
        assert not woke  # one is still registered
        registry.remove(2)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [0.0]  # before: a 10 ms poll, which a stopped clock never ends
        _entry(registry, 3)  # busy again: a new wait waits
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert len(woke) == 1
        registry.remove(3)
    assert len(woke) == 2
