"""Property: any mix of requests, cancellations, faults and preemptions leaves nothing held.

Small pools make preemption frequent: a request may be cancelled or fail while it waits after
a preemption or while it is recomputed, and must still free everything exactly once; one that
runs to its end gets its whole answer, nothing resent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner, byte_tokenizer_spec, text_script
from ft.engine.loading import ModelParts
from ft.errors import FtError
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine
from tests.support.faulty_worker import RAISE, faulty_tokenize_job
from tests.support.parallel import tensor_parallel_runner
from tests.support.tiny_model import save_hf_dir, tiny_config

STEP_FAULT_SEED = 666
TEXT = "hello world, all is well " * 4
PAGE_SIZE = 4


@dataclass(frozen=True)
class Plan:
    """One request in a scenario."""

    arrive_s: float
    prompt_len: int
    max_tokens: int
    n: int
    cancel_after_s: float | None  # None: consume to the end
    fault: str | None  # None | "step" | "tokenizer" | "surrogate" | "bigint" | "context"
    stops: tuple[str, ...]


plans = st.builds(
    Plan,
    arrive_s=st.floats(0, 1),
    prompt_len=st.integers(1, 80),
    max_tokens=st.integers(1, 40),
    n=st.integers(1, 3),
    cancel_after_s=st.none() | st.floats(0, 1.5),
    fault=st.sampled_from([None, None, None, "step", "tokenizer", "surrogate", "bigint", "context"]),
    stops=st.sampled_from([(), ("ll",), ("o", "zz")]),
)


# Long answers arriving together, fewer faults and stop strings: the pressure mix.
pressure_plans = st.builds(
    Plan,
    arrive_s=st.floats(0, 0.2),
    prompt_len=st.integers(1, 30),
    max_tokens=st.integers(16, 40),
    n=st.integers(1, 2),
    cancel_after_s=st.none() | st.floats(0, 1.5),
    fault=st.sampled_from([None, None, None, None, "step", "tokenizer"]),
    stops=st.sampled_from([(), (), (), ("ll",)]),
)


def before_step(works: list[SeqWork]) -> None:
    if any(w.params.seed == STEP_FAULT_SEED for w in works):
        raise RuntimeError("injected step fault")


async def scenario(
    reqs: list[Plan],
    max_running: int,
    num_pages: int,
    admission: str,
    load_model: Callable[[EngineConfig], ModelParts] | None = None,
    recurrent: bool = False,
    **config: Any,
) -> int:
    """Run `reqs`; check nothing is held after; return how many preemptions happened.

    `load_model` replaces the scripted fake runner (whose text the answers are checked against);
    `recurrent` gives the fake model recurrent state slots, each work's checked by the runner.
    """
    runner = FakeRunner(text_script(TEXT), step_s=0.03, recurrent=recurrent)
    scripted = load_model is None

    async with fake_engine(
        runner,
        before_step=before_step,
        tokenize_job=faulty_tokenize_job,
        max_running_requests=max_running,
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        max_prefill_tokens=32,
        context_length=128,
        admission=admission,
        load_model=load_model,
        **config,
    ) as engine:
        ended: list[str] = []

        async def one(plan: Plan) -> None:
            await trio.sleep(plan.arrive_s)
            prompt = "p" * plan.prompt_len
            kwargs = {}
            if plan.fault == "tokenizer":
                prompt = RAISE + prompt
            if plan.fault == "surrogate":
                prompt = prompt + "\udc80"
            if plan.fault == "bigint":
                kwargs["chat_template_kwargs"] = {"k": 2**70}
            max_tokens = 200 if plan.fault == "context" else plan.max_tokens
            params = SamplingParams(
                max_tokens=max_tokens,
                n=min(plan.n, max_running),
                stop=plan.stops,
                seed=STEP_FAULT_SEED if plan.fault == "step" else None,
            )
            with trio.move_on_after(plan.cancel_after_s or 1e9):
                try:
                    if plan.fault == "bigint":
                        cm = engine.open_request(
                            PromptSpec(messages=[{"role": "user", "content": prompt}], **kwargs),
                            params=params,
                        )
                    else:
                        cm = engine.open_request(PromptSpec(text=prompt), params=params)
                    async with cm as stream:
                        choices = await stream.collect()
                        assert all(c.finish_reason for c in choices)
                        for c in choices if scripted else ():  # the script, paused maybe, never repeated
                            assert TEXT.startswith(c.text)
                            if not plan.stops and plan.fault is None:
                                # max_tokens is a ceiling: lowered to what the pool holds per choice
                                n, num_prompt = params.n, stream.num_prompt_tokens
                                room = min(128, num_pages // n * PAGE_SIZE) - num_prompt
                                assert c.text == TEXT[: min(max_tokens, room)]
                except FtError:
                    pass
            ended.append("x")

        async with trio.open_nursery() as nursery:
            for plan in reqs:
                nursery.start_soon(one, plan)
        await trio.testing.wait_all_tasks_blocked()
        assert len(ended) == len(reqs)  # every stream ended
        assert engine.core is not None
        assert len(engine.registry) == 0
        assert not engine.core.running and not engine.core.waiting
        assert engine.core.pool.num_used == 0
        assert engine.snapshot().requests.active == 0
        if recurrent:
            assert runner.state_faults == []
            assert engine.core.states is not None and engine.core.states.num_in_use == 0
        return engine.core.num_preemptions


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(plans, min_size=1, max_size=12),
    max_running=st.integers(1, 4),
    num_pages=st.integers(8, 40) | st.integers(24, 200),
    admission=st.sampled_from(["need", "need", "reserve"]),
)
def test_any_mix_of_requests_cancels_faults_and_preemptions_leaks_nothing(
    reqs: list[Plan], max_running: int, num_pages: int, admission: str
) -> None:
    """Any mix of requests, cancellations, faults and preemptions leaves no request, slot or page behind."""
    preemptions = trio.run(
        scenario,
        reqs,
        max_running,
        num_pages,
        admission,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    event(f"preempted: {preemptions > 0}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(pressure_plans, min_size=3, max_size=12),
    max_running=st.integers(2, 6),
    tightness=st.floats(1.0, 1.25),
)
def test_preemption_under_pressure_with_cancels_and_faults_leaks_nothing(
    reqs: list[Plan], max_running: int, tightness: float
) -> None:
    """A pool tight enough to preempt often, with cancels and faults, leaks nothing either."""
    # A pool just above the largest request's whole budget: every request fits alone, several
    # together do not, so requests are preempted, recomputed, cancelled and failed in any order.
    budgets = [min(p.n, max_running) * -(-(p.prompt_len + 1 + p.max_tokens) // PAGE_SIZE) for p in reqs]
    num_pages = max(8, int(tightness * max(budgets)))
    preemptions = trio.run(
        scenario,
        reqs,
        max_running,
        num_pages,
        "need",
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    event(f"preempted: {preemptions > 0}")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(pressure_plans, min_size=3, max_size=10),
    max_running=st.integers(2, 4),
    tightness=st.floats(1.0, 1.25),
    snapshots=st.integers(0, 4),
)
def test_a_model_with_recurrent_state_leaks_no_slot(
    reqs: list[Plan], max_running: int, tightness: float, snapshots: int
) -> None:
    """The same mix on a model with recurrent layers: every work finds its state slot holding
    exactly the tokens before it (restored snapshots, forked choices, recomputes after a
    preemption), and once every request has ended only snapshots hold slots."""
    budgets = [min(p.n, max_running) * -(-(p.prompt_len + 1 + p.max_tokens) // PAGE_SIZE) for p in reqs]
    preemptions = trio.run(
        partial(
            scenario,
            reqs,
            max_running,
            max(8, int(tightness * max(budgets))),
            "need",
            recurrent=True,
            state_snapshots=snapshots,
        ),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    event(f"preempted: {preemptions > 0}")


TP_NUM_PAGES = 200


@pytest.fixture(scope="module")
def tp2_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[EngineConfig], ModelParts]]:
    """A tiny model on 2 gloo ranks behind the byte tokenizer, shared by every example."""
    directory = tmp_path_factory.mktemp("tp2") / "tiny"
    save_hf_dir(directory, tiny_config(vocab_size=272))  # the byte tokenizer's 259 ids fit
    with tensor_parallel_runner(str(directory), 2, num_pages=TP_NUM_PAGES, page_size=PAGE_SIZE) as runner:

        def load(config: EngineConfig) -> ModelParts:
            def make(num_pages: int, page_size: int) -> Any:
                assert num_pages <= TP_NUM_PAGES and page_size == PAGE_SIZE
                return runner  # its KV cache has room for any pool the examples ask for

            return ModelParts(
                tokenizer=byte_tokenizer_spec(128),
                make_runner=make,
                bytes_per_page=lambda ps: 1024 * ps,
                vocab_size=runner.vocab_size,
                generation_defaults={},
            )

        yield load


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(plans, min_size=1, max_size=6),
    max_running=st.integers(1, 4),
    num_pages=st.integers(8, 40),
)
def test_tensor_parallel_runner_leaks_nothing(
    tp2_model: Callable[[EngineConfig], ModelParts], reqs: list[Plan], max_running: int, num_pages: int
) -> None:
    """The same property with a real model on 2 tensor-parallel ranks (real clock: the step
    deadline would fire at once under the mock clock while a thread computes)."""
    trio.run(partial(scenario, reqs, max_running, num_pages, "need", tp2_model, tensor_parallel_size=2))
