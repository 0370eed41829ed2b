"""The compute thread count follows measurements: the faster count wins, and a change in load
(the other count becoming faster) is noticed through the periodic tries."""

from __future__ import annotations

from ft.model.threads import EXPLORE_EVERY, MIN_SAMPLES, RECHECK_EVERY, ThreadChooser, thread_choices


def run_steps(chooser: ThreadChooser, rows: int, cost: dict[int, float], steps: int) -> list[int]:
    """`steps` steps where a step with n threads takes `cost[n]` seconds per row."""
    picks = []
    for _ in range(steps):
        n = chooser.choose(rows)
        chooser.record(rows, n, cost[n] * rows)
        picks.append(n)
    return picks


def test_tries_each_count_then_keeps_the_faster() -> None:
    """The first steps measure the most threads a few times, then the other count once (a
    count's first step is not counted: cold); it is slower, so the faster one runs all but the
    tries."""
    chooser = ThreadChooser((1, 2))
    picks = run_steps(chooser, 16, {1: 0.004, 2: 0.002}, 400)
    first = 1 + MIN_SAMPLES + 2
    assert picks[:first] == [2] * (1 + MIN_SAMPLES) + [1] * 2
    assert picks[first:].count(1) <= 400 // EXPLORE_EVERY + 1


def test_a_count_that_looks_faster_is_measured_before_it_decides() -> None:
    """Fewer threads faster (a busy neighbour): one measurement makes it the candidate, and it
    runs from then on, its first `MIN_SAMPLES` measurements included."""
    chooser = ThreadChooser((1, 2))
    picks = run_steps(chooser, 1, {1: 0.002, 2: 0.004}, 300)
    assert picks[: 1 + MIN_SAMPLES] == [2] * (1 + MIN_SAMPLES)
    assert picks[1 + MIN_SAMPLES : 1 + MIN_SAMPLES + 1 + MIN_SAMPLES] == [1] * (1 + MIN_SAMPLES)
    assert picks[-200:].count(1) >= 198


def test_one_noisy_measurement_does_not_decide() -> None:
    """A step 10x slower than the truth among the first measurements of the faster count (a
    neighbour's burst) leaves the choice to the median."""
    chooser = ThreadChooser((1, 2))
    cost = {1: 0.010, 2: 0.006}
    chooser.record(1, 2, cost[2])  # cold
    chooser.record(1, 2, 10 * cost[2])  # the noisy one
    picks = run_steps(chooser, 1, cost, 200)
    assert picks[-150:].count(2) >= 148


def test_one_noisy_measurement_of_the_other_count_does_not_keep_it_out() -> None:
    """One thread is faster (a busy neighbour) but its first measured step is a 10x spike: it
    is measured again within `RECHECK_EVERY` steps and takes over, not after `EXPLORE_EVERY`."""
    chooser = ThreadChooser((1, 2))
    cost = {1: 0.010, 2: 0.040}
    picks = run_steps(chooser, 1, cost, 1 + MIN_SAMPLES)  # two threads measured first
    chooser.record(1, 1, cost[1])  # cold
    chooser.record(1, 1, 10 * cost[1])  # the spike
    picks = run_steps(chooser, 1, cost, 300)
    assert picks[2 * RECHECK_EVERY + MIN_SAMPLES :].count(1) >= 300 - 2 * RECHECK_EVERY - MIN_SAMPLES - 2


def test_a_cold_first_step_does_not_lock_in_the_slower_count() -> None:
    """A first step 10x slower than the truth (page faults, thread start-up) is ignored."""
    chooser = ThreadChooser((1, 2))
    chooser.record(1, 1, 0.100)  # cold
    picks = run_steps(chooser, 1, {1: 0.010, 2: 0.020}, 300)
    assert picks[-100:].count(1) >= 99


def test_a_much_slower_choice_is_tried_rarely() -> None:
    """Tries are spaced by how much slower the other count was: a 100x slower choice is tried
    once in 5000 steps (spacing capped at 4096), not every 128."""
    chooser = ThreadChooser((1, 2))
    picks = run_steps(chooser, 1, {1: 0.01, 2: 1.0}, 5000)
    assert 1 <= picks[1 + MIN_SAMPLES + 2 :].count(2) <= 2


def test_contention_turns_the_choice_to_one_thread() -> None:
    """When two threads become slower (a busy neighbour), one thread takes over."""
    chooser = ThreadChooser((1, 2))
    run_steps(chooser, 1, {1: 0.010, 2: 0.006}, 100)
    picks = run_steps(chooser, 1, {1: 0.010, 2: 0.040}, 200)
    assert picks[-50:].count(1) >= 48


def test_batch_sizes_are_measured_apart() -> None:
    """A count that is best for single rows need not be best for large batches."""
    chooser = ThreadChooser((1, 2))
    cost_small, cost_large = {1: 0.001, 2: 0.003}, {1: 0.004, 2: 0.002}
    for _ in range(100):
        for rows, cost in ((1, cost_small), (32, cost_large)):
            n = chooser.choose(rows)
            chooser.record(rows, n, cost[n] * rows)
    assert chooser.choose(1) == 1 and chooser.choose(32) == 2


def test_choices() -> None:
    """One core: one thread; few cores: one or all; many: half or all."""
    assert thread_choices(1) == (1,)
    assert thread_choices(2) == (1, 2)
    assert thread_choices(16) == (8, 16)
