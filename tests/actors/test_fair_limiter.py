"""FairLimiter under trio's MockClock: turns by usage, failures charged, cancellation."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ft.actors.fair_limiter import FairLimiter


async def hold(
    limiter: FairLimiter, client: str, seconds: float, order: list[str], *, fail: bool = False
) -> None:
    """Hold a slot for `seconds` of trio time (then fail, if asked); note when it entered."""
    async with limiter.slot(client) as slot:
        order.append(client)
        await trio.sleep(seconds)
        slot.failed = fail


async def test_behind_one_clients_flood_another_clients_job_enters_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = FairLimiter(1)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(hold, limiter, "flood", 1.0, order)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, limiter, "honest", 0.1, order)
    assert order[:2] == ["flood", "honest"]  # it waited for the job in its slot only
    assert order.count("flood") == 20


async def test_a_client_whose_jobs_fail_waits_behind_one_that_used_more_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """1 s failed counts 4 s: a client that ran 3 s successfully goes first."""
    limiter = FairLimiter(1)
    order: list[str] = []
    await hold(limiter, "failing", 1.0, order, fail=True)
    await hold(limiter, "served", 3.0, order)
    assert limiter.usage("failing") > limiter.usage("served")
    order.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, limiter, "blocker", 1.0, order)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, limiter, "failing", 1.0, order)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, limiter, "served", 1.0, order)
    assert order == ["blocker", "served", "failing"]


async def test_an_exception_out_of_the_block_is_charged_as_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = FairLimiter(1, failure_weight=4.0)
    with pytest.raises(RuntimeError):
        async with limiter.slot("a"):
            await trio.sleep(2.0)
            raise RuntimeError("refused")
    assert limiter.usage("a") == pytest.approx(8.0, rel=0.01)


async def test_no_more_blocks_hold_a_slot_than_it_has(autojump_clock: trio.testing.MockClock) -> None:
    limiter = FairLimiter(3)
    inside = peak = 0

    async def job(client: str) -> None:
        nonlocal inside, peak
        async with limiter.slot(client):
            inside += 1
            peak = max(peak, inside)
            await trio.sleep(1.0)
            inside -= 1

    async with trio.open_nursery() as nursery:
        for k in range(10):
            nursery.start_soon(job, f"c{k % 4}")
    assert peak == 3
    assert limiter.statistics().num_running == 0 and limiter.statistics().num_waiting == 0


async def test_a_waiter_cancelled_leaves_the_queue_and_the_next_one_enters(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = FairLimiter(1)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, limiter, "first", 1.0, order)
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.5):
            await hold(limiter, "leaves", 1.0, order)
        nursery.start_soon(hold, limiter, "next", 1.0, order)
    assert order == ["first", "next"]
    assert limiter.statistics().num_waiting == 0


async def test_a_turn_given_to_a_cancelled_waiter_passes_to_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The slot is handed over as the waiter is cancelled (in the same tick): not lost."""
    limiter = FairLimiter(1)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        async with limiter.slot("first"):
            cancel = trio.CancelScope()

            async def leaves() -> None:
                with cancel:
                    await hold(limiter, "leaves", 1.0, order)

            nursery.start_soon(leaves)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(hold, limiter, "next", 1.0, order)
            await trio.testing.wait_all_tasks_blocked()
            cancel.cancel()  # before the waiter runs again, and its turn comes below
        # leaving the block gave "leaves" its turn; it is cancelled before it enters
    assert order == ["next"]
    assert limiter.statistics().num_running == 0
