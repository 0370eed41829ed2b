"""Property: any mix of requests, cancellations and faults leaves the engine holding nothing."""

from __future__ import annotations

from dataclasses import dataclass

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner, text_script
from ft.errors import FtError
from ft.messages import Tokenize
from ft.params import SamplingParams
from tests.support.engine import fake_engine

STEP_FAULT_SEED = 666


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


def before_step(works: list[SeqWork]) -> None:
    if any(w.params.seed == STEP_FAULT_SEED for w in works):
        raise RuntimeError("injected step fault")


async def scenario(reqs: list[Plan], max_running: int, num_pages: int) -> None:
    runner = FakeRunner(text_script("hello world, all is well " * 4), step_s=0.03)

    def fault(m: Tokenize) -> str | None:
        return "raise" if m.prompt and m.prompt.startswith("!") else None

    async with fake_engine(
        runner,
        before_step=before_step,
        tokenizer_fault=fault,
        max_running_requests=max_running,
        num_pages=num_pages,
        page_size=4,
        max_prefill_tokens=32,
        context_length=128,
    ) as engine:
        ended: list[str] = []

        async def one(plan: Plan) -> None:
            await trio.sleep(plan.arrive_s)
            prompt = "p" * plan.prompt_len
            kwargs = {}
            if plan.fault == "tokenizer":
                prompt = "!" + prompt
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
                            messages=[{"role": "user", "content": prompt}], params=params, **kwargs
                        )
                    else:
                        cm = engine.open_request(prompt=prompt, params=params)
                    async with cm as stream:
                        choices = await stream.collect()
                        assert all(c.finish_reason for c in choices)
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
        assert engine.snapshot()["requests"]["active"] == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(plans, min_size=1, max_size=12),
    max_running=st.integers(1, 4),
    num_pages=st.integers(24, 200),
)
def test_any_mix_of_requests_cancels_and_faults_leaks_nothing(
    reqs: list[Plan], max_running: int, num_pages: int
) -> None:
    trio.run(scenario, reqs, max_running, num_pages, clock=trio.testing.MockClock(autojump_threshold=0))
