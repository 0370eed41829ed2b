"""The fair queue of worker slots: the next job is the waiting one of the client that used the
least worker time recently, failures weighing four times their time."""

from __future__ import annotations

import pytest

from ft.core.fair_share import FAILURE_WEIGHT, FairShare


def drain(share: FairShare, now: float) -> list[int]:
    """Start every job a free slot allows now, in the order the queue chooses."""
    started = []
    while (job := share.start_next(now)) is not None:
        started.append(job)
    return started


def run(share: FairShare, job: int, client: str, start: float, took: float, *, failed: bool = False) -> None:
    """`client`'s `job` alone in a slot from `start` for `took` seconds."""
    share.enqueue(job, client)
    assert share.start_next(start) == job
    share.finish(job, start + took, failed=failed)


def test_jobs_of_clients_that_used_nothing_run_in_the_order_they_came() -> None:
    share = FairShare(1)
    for job, client in enumerate("abcab"):
        share.enqueue(job, client)
    order = []
    for _ in range(5):
        job = share.start_next(0.0)
        assert job is not None
        order.append(job)
        share.finish(job, 0.0)
    assert order == [0, 1, 2, 3, 4]


def test_a_new_client_goes_ahead_of_a_flood_from_one_that_used_the_workers() -> None:
    """Sixty jobs of one client queued first; another client's job, queued last, runs next."""
    share = FairShare(1)
    run(share, 0, "flood", 0.0, 1.0)
    for job in range(1, 61):
        share.enqueue(job, "flood")
    share.enqueue(100, "honest")
    assert share.start_next(1.0) == 100
    share.finish(100, 1.1)
    assert share.start_next(1.1) == 1


def test_a_failed_job_is_charged_four_times_its_time() -> None:
    """One second failed (4) weighs more than three that succeeded (3)."""
    share = FairShare(1)
    assert FAILURE_WEIGHT == 4.0
    run(share, 0, "refused", 0.0, 1.0, failed=True)
    run(share, 1, "served", 1.0, 3.0)
    assert share.usage("refused", 4.0) == pytest.approx(4.0 * 0.5 ** (3.0 / share.half_life_s))
    share.enqueue(2, "refused")
    share.enqueue(3, "served")
    assert share.start_next(4.0) == 3


def test_usage_halves_every_half_life() -> None:
    share = FairShare(1, half_life_s=10.0)
    run(share, 0, "a", 0.0, 8.0)
    assert share.usage("a", 8.0) == pytest.approx(8.0)
    assert share.usage("a", 18.0) == pytest.approx(4.0)
    assert share.usage("a", 28.0) == pytest.approx(2.0)
    assert share.usage("never seen", 28.0) == 0.0


def test_a_running_job_counts_toward_its_clients_usage_while_it_runs() -> None:
    """With two slots, a client whose job has run for 5 s waits behind one whose has run 1 s."""
    share = FairShare(2)
    share.enqueue(0, "long")
    assert share.start_next(0.0) == 0
    share.enqueue(1, "short")
    assert share.start_next(4.0) == 1
    assert share.usage("long", 5.0) == pytest.approx(5.0)
    share.enqueue(2, "long")
    share.enqueue(3, "short")
    share.finish(1, 5.0)
    assert share.start_next(5.0) == 3


def test_no_more_jobs_run_than_there_are_slots() -> None:
    share = FairShare(2)
    for job in range(5):
        share.enqueue(job, f"c{job}")
    assert drain(share, 0.0) == [0, 1]
    assert share.statistics().num_running == 2 and share.statistics().num_waiting == 3
    share.finish(0, 1.0)
    assert drain(share, 1.0) == [2]


def test_a_withdrawn_job_never_runs() -> None:
    share = FairShare(1)
    share.enqueue(0, "a")
    share.enqueue(1, "a")
    share.enqueue(2, "b")
    share.withdraw(0)
    assert drain(share, 0.0) == [1]
    assert not share.is_running(0)
    share.finish(1, 0.0)
    assert drain(share, 0.0) == [2]


def test_idle_clients_past_the_bound_are_forgotten_least_used_first() -> None:
    share = FairShare(1, max_idle_clients=4)
    for job in range(6):
        run(share, job, f"c{job}", float(job), 0.1 * (job + 1))
    assert share.statistics().num_clients <= 4
    assert share.usage("c5", 6.0) > 0.0  # the most used is remembered
    assert share.usage("c0", 6.0) == 0.0  # the least used was forgotten


def test_a_job_id_in_use_is_refused() -> None:
    share = FairShare(1)
    share.enqueue(0, "a")
    with pytest.raises(ValueError, match="already"):
        share.enqueue(0, "b")
    with pytest.raises(ValueError, match="num_slots"):
        FairShare(0)
