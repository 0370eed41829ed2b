"""The scheduler's state slots driving a real hybrid model: every answer is the one its prompt
gets alone, whatever else happened in the steps (prefix hits restoring snapshots, `n` = 2
choices forking, preemptions, aborts, snapshots evicted and slots reused).

The runner is the float runner of tiny random LFM2 and Granite 4.0-H checkpoints; the scheduler
is `ft.core.scheduler` with a pool tight enough to preempt. Each request is greedy; its answer
is compared with the same prompt's greedy tokens computed alone on a fresh runner (a prompt
whose lone greedy run has two top logits within `MARGIN` at some step is not compared: the
batch's rounding may order them either way).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ft.core.batch import Sampled, StepDone, TokenOut
from ft.core.kv import PagePool
from ft.core.scheduler import Scheduler
from ft.core.state import StatePool
from ft.errors import ContextLengthExceeded
from ft.model.loader import LoadedModel, load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.tiny_granite_hybrid import granite_hybrid_model, save_granite_hybrid_dir
from tests.support.tiny_lfm2 import greedy, lfm2_model, save_lfm2_dir

pytest.importorskip("transformers")

PAGE = 4
MARGIN = 1e-3
BASE = tuple((i * 11) % 200 + 3 for i in range(40))  # prompts share its prefixes
NUM_PAGES = 14


@pytest.fixture(scope="module", params=["lfm2", "granite"])
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("hybrid-scheduling")
    if request.param == "lfm2":
        path: pathlib.Path = save_lfm2_dir(directory / "lfm2", lfm2_model())
    else:
        path = save_granite_hybrid_dir(directory / "granite", granite_hybrid_model("dense"))
    return load_model(path, torch.float32)


def runner_of(loaded: LoadedModel, num_slots: int) -> TorchRunner:
    return build_runner(
        loaded, num_pages=NUM_PAGES, page_size=PAGE, dtype=torch.float32, num_state_slots=num_slots
    )


_ALONE: dict[tuple[str, tuple[int, ...], int], list[int] | None] = {}


def _alone(loaded: LoadedModel, prompt: tuple[int, ...], steps: int) -> list[int] | None:
    """The prompt's greedy tokens alone, None when two top logits come within `MARGIN`."""
    key = (loaded.config.architecture, prompt, steps)
    if key not in _ALONE:
        _ALONE[key] = _greedy_alone(loaded, prompt, steps)
    return _ALONE[key]


def _greedy_alone(loaded: LoadedModel, prompt: tuple[int, ...], steps: int) -> list[int] | None:
    runner = build_runner(loaded, num_pages=32, page_size=PAGE, dtype=torch.float32, num_state_slots=1)
    tokens, logits = greedy(runner, prompt, steps)
    for row in logits:
        top = row.topk(2).values
        if (top[0] - top[1]).item() < MARGIN:
            return None
    return tokens


def drive(loaded: LoadedModel, ops: list[tuple[Any, ...]], snapshots: int, max_running: int) -> Scheduler:
    """Run `ops` (add a request, step, abort one) and then every request to its end; check each
    finished answer against its prompt alone and that only snapshots hold slots after."""
    s = Scheduler(
        PagePool(NUM_PAGES, PAGE),
        max_running=max_running,
        max_model_len=64,
        max_prefill_tokens=16,
        eos_token_ids=[],
        states=StatePool(max_running + snapshots, max_running),
    )
    runner = runner_of(loaded, max_running + snapshots)
    asked: dict[int, tuple[tuple[int, ...], int, int]] = {}  # uid -> (prompt, max_tokens, n)
    answers: dict[tuple[int, int], list[int]] = {}
    finished: set[tuple[int, int]] = set()
    aborted: set[int] = set()
    next_uid = 0

    def step() -> None:
        batch = s.schedule()
        if batch is None:
            return
        if batch.state_copies:
            runner.copy_states(batch.state_copies)
        outs = runner.step(list(batch.works)) if batch.works else []
        sampled = tuple(o for o in outs if isinstance(o, Sampled))
        for out in s.on_step_done(batch, StepDone(batch.step, sampled)):
            assert isinstance(out, TokenOut)
            answers.setdefault((out.uid, out.index), []).append(out.token_id)
            if out.finish_reason is not None:
                finished.add((out.uid, out.index))

    for op in ops:
        match op:
            case ("add", start, length, max_tokens, n):
                uid = next_uid
                next_uid += 1
                prompt = BASE[start : start + length]
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True)
                try:  # (max_tokens lowered to what the pool holds for each of the n)
                    asked[uid] = (prompt, s.check_fits(len(prompt), params), n)
                    s.add(uid, list(prompt), params)
                except ContextLengthExceeded:
                    pass
            case ("step", count):
                for _ in range(count):
                    step()
            case ("abort", back):
                uid = max(0, next_uid - 1 - back)
                s.abort(uid)
                aborted.add(uid)
    for _ in range(2000):
        if not s.has_work:
            break
        step()
    assert not s.has_work
    assert s.states is not None and s.states.num_in_use == 0

    for uid, (prompt, max_tokens, n) in asked.items():
        if uid in aborted:
            continue
        want = _alone(loaded, prompt, max_tokens)
        for index in range(n):
            assert (uid, index) in finished
            if want is not None:
                assert answers[(uid, index)] == want, (uid, index, prompt)
    return s


adds = st.tuples(st.just("add"), st.integers(0, 2), st.integers(5, 24), st.integers(4, 16), st.integers(1, 2))
more = st.one_of(
    adds, st.tuples(st.just("step"), st.integers(1, 4)), st.tuples(st.just("abort"), st.integers(0, 3))
)
# a few requests together, then anything: more requests, steps between them, aborts
ops = st.tuples(st.lists(adds, min_size=2, max_size=4), st.lists(more, max_size=12)).map(
    lambda p: p[0] + p[1]
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=ops, snapshots=st.integers(0, 3), max_running=st.integers(2, 3))
def test_every_answer_is_its_prompts_alone_whatever_else_the_steps_did(
    loaded: LoadedModel, ops: list[tuple[Any, ...]], snapshots: int, max_running: int
) -> None:
    s = drive(loaded, ops, snapshots, max_running)
    assert s.states is not None
    event(f"preempted: {s.num_preemptions > 0}")
    event(f"restored a snapshot: {s.states.num_hits > 0}")


def test_a_forked_request_beside_conversation_turns_under_preemption(loaded: LoadedModel) -> None:
    """A fixed mix: a 2-choice request forks; turns that extend its prompt restore its snapshot;
    the pool is short, so the newest requests are preempted and recomputed."""
    s = drive(
        loaded,
        [
            ("add", 0, 18, 8, 2),
            ("step", 1),
            ("add", 0, 16, 12, 1),
            ("add", 1, 20, 12, 1),
            ("step", 4),
            ("add", 0, 20, 4, 1),
        ],
        snapshots=2,
        max_running=3,
    )
    assert s.states is not None
    assert s.num_preemptions >= 1 and s.states.num_hits >= 1
