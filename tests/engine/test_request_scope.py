"""The request scope: whatever happens inside it, its exit frees everything exactly once."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import trio
import trio.testing

from ft.engine.engine import Engine
from ft.engine.fake import FakeRunner, byte_token, delayed_inline, run_inline, text_script
from ft.errors import (
    ContextLengthExceeded,
    EngineStopping,
    InvalidRequest,
    Overloaded,
    RequestAborted,
    RequestFailed,
)
from ft.grammar import spec
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.tokenizer.job import check_grammar_job
from tests.support.engine import fake_engine
from tests.support.faulty_worker import RAISE, faulty_tokenize_job

CHAT = [{"role": "user", "content": "hi"}]


async def assert_nothing_held(engine: Engine) -> None:
    """After every scope has closed: no uid, no sequence, no used page."""
    await trio.testing.wait_all_tasks_blocked()
    assert engine.core is not None
    assert len(engine.registry) == 0
    assert not engine.core.running and not engine.core.waiting
    assert engine.core.pool.num_used == 0
    snap = engine.snapshot()
    assert snap.requests.active == 0 and snap.kv.used_pages == 0


async def test_generates_the_scripted_text(autojump_clock: trio.testing.MockClock) -> None:
    """A chat request through every actor yields the runner's text and finishes with "stop"."""
    async with fake_engine(FakeRunner(text_script("Bonjour"))) as engine:
        async with engine.open_request(PromptSpec(messages=CHAT), params=SamplingParams()) as stream:
            (choice,) = await stream.collect()
        assert choice.text == "Bonjour" and choice.finish_reason == "stop"
        assert stream.num_prompt_tokens > 0 and stream.num_completion_tokens == 8
        await assert_nothing_held(engine)
        assert engine.snapshot().requests.completed == 1


@pytest.mark.parametrize("stage", ["queued", "prefill", "decode"])
async def test_cancel_at_each_stage_frees_pages_and_slot(
    autojump_clock: trio.testing.MockClock, stage: str
) -> None:
    """Cancelling a request while queued, prefilling or decoding frees its pages and its slot."""
    runner = FakeRunner(text_script("x" * 500), step_s=0.1)
    async with fake_engine(runner, max_running_requests=1, max_prefill_tokens=16) as engine:
        assert engine.core is not None
        blocker_done = trio.Event()

        async def blocker() -> None:
            async with engine.open_request(PromptSpec(text="b"), params=SamplingParams(max_tokens=20)) as s:
                await s.collect()
            blocker_done.set()

        async with trio.open_nursery() as nursery:
            if stage == "queued":
                nursery.start_soon(blocker)
                await trio.sleep(0.05)
            with trio.move_on_after(0.35 if stage != "decode" else 2.0) as scope:
                params = SamplingParams(max_tokens=400)
                prompt = "p" * (200 if stage == "prefill" else 4)
                async with engine.open_request(PromptSpec(text=prompt), params=params) as stream:
                    async for _ in stream:
                        pass
            assert scope.cancelled_caught
            if stage == "prefill":
                assert stream.num_completion_tokens == 0
            if stage == "decode":
                assert stream.num_completion_tokens > 0
            await trio.testing.wait_all_tasks_blocked()
            # Aborted within one engine step: its pages are back before the next one ends.
            held = {s.uid for s in engine.core.running.values()}
            assert stream.uid not in held
        await assert_nothing_held(engine)
        assert engine.snapshot().requests.aborted == 1


async def test_cancel_while_tokenizing_never_enqueues(autojump_clock: trio.testing.MockClock) -> None:
    """A request that leaves while its prompt is tokenized never reaches the scheduler."""
    async with fake_engine(executor=delayed_inline(1.0)) as engine:
        assert engine.core is not None
        with trio.move_on_after(0.5) as scope:
            async with engine.open_request(PromptSpec(text="slow to tokenize")) as stream:
                await stream.collect()
        assert scope.cancelled_caught and stream.num_prompt_tokens == 0
        await trio.sleep(1.0)  # the job finishes after the client left
        await assert_nothing_held(engine)
        assert engine.core.num_prefix_hit_tokens == 0 and engine.snapshot().requests.aborted == 1


async def test_lone_surrogate_fails_cbor_encoding_inside_the_scope(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lone surrogate fails at the CBOR boundary as `InvalidRequest` naming the field, inside the scope."""
    async with fake_engine() as engine:
        with pytest.raises(InvalidRequest, match="surrogate") as info:
            async with engine.open_request(
                PromptSpec(messages=[{"role": "user", "content": "a\ud800b"}])
            ) as stream:
                await stream.collect()
        assert info.value.param == "messages"
        await assert_nothing_held(engine)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
async def test_unpackable_integer_fails_inside_the_scope(
    autojump_clock: trio.testing.MockClock, value: int
) -> None:
    """An integer past 64 bits is refused at the CBOR boundary, inside the scope."""
    async with fake_engine() as engine:
        with pytest.raises(InvalidRequest) as info:
            async with engine.open_request(
                PromptSpec(messages=CHAT, chat_template_kwargs={"x": value})
            ) as stream:
                await stream.collect()
        assert info.value.param == "chat_template_kwargs.x"
        await assert_nothing_held(engine)


async def test_tokenizer_crash_fails_only_its_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A crashing tokenizer job fails its own request; the next one is served."""

    async with fake_engine(tokenize_job=faulty_tokenize_job) as engine:
        with pytest.raises(RequestFailed, match="tokenization failed"):
            async with engine.open_request(PromptSpec(text=RAISE)) as stream:
                await stream.collect()
        async with engine.open_request(PromptSpec(text="fine")) as stream:
            assert (await stream.collect())[0].finish_reason == "stop"
        await assert_nothing_held(engine)


async def test_out_of_vocabulary_token_ids_are_refused(autojump_clock: trio.testing.MockClock) -> None:
    """Prompt token ids outside the vocabulary are an `InvalidRequest`."""
    async with fake_engine() as engine:
        with pytest.raises(InvalidRequest, match="vocabulary"):
            async with engine.open_request(PromptSpec(token_ids=[5, 10**9])) as stream:
                await stream.collect()
        await assert_nothing_held(engine)


async def test_context_overflow_is_refused_with_the_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A prompt past the context is refused, and the message names the limit."""
    async with fake_engine(context_length=64) as engine:
        with pytest.raises(ContextLengthExceeded, match="64"):
            async with engine.open_request(
                PromptSpec(text="x" * 70), params=SamplingParams(max_tokens=20)
            ) as s:
                await s.collect()
        await assert_nothing_held(engine)


async def test_runner_fault_fails_one_request_and_its_neighbours_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A model step that raises for one sequence fails that request only; its batch-mates finish."""

    def before_step(works: list) -> None:
        if any(w.params.seed == 666 for w in works):
            raise RuntimeError("injected step fault")

    async with fake_engine(before_step=before_step, max_running_requests=4) as engine:
        results: dict[str, object] = {}

        async def run(name: str, seed: int | None) -> None:
            try:
                async with engine.open_request(PromptSpec(text=name), params=SamplingParams(seed=seed)) as s:
                    results[name] = (await s.collect())[0].text
            except RequestFailed as e:
                results[name] = e

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "bad", 666)
            nursery.start_soon(run, "good1", None)
            nursery.start_soon(run, "good2", 1)
        assert isinstance(results["bad"], RequestFailed)
        assert results["good1"] == results["good2"] == "Hello from the fake model."
        await assert_nothing_held(engine)


async def test_overload_is_refused_before_registering(autojump_clock: trio.testing.MockClock) -> None:
    """Past running + queued capacity, `open_request` raises `Overloaded` without registering."""
    runner = FakeRunner(text_script("y" * 100), step_s=0.1)
    async with fake_engine(runner, max_running_requests=1, max_queued_requests=1) as engine:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(engine.generate, "a", SamplingParams(max_tokens=5))
            await trio.sleep(0.05)
            with pytest.raises(Overloaded):
                async with engine.open_request(PromptSpec(text="c")):
                    pass  # pragma: no cover
            assert len(engine.registry) == 2
        await assert_nothing_held(engine)
        assert engine.snapshot().requests.rejected == 1


async def test_stop_string_ends_the_sequence_and_frees_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stop string ends the choice (text before it, "stop" with the string) and frees its pages."""
    async with fake_engine(FakeRunner(text_script("one, two, three, four"))) as engine:
        params = SamplingParams(stop=(", thr",), max_tokens=50)
        async with engine.open_request(PromptSpec(text="go"), params=params) as stream:
            (choice,) = await stream.collect()
        assert choice.text == "one, two" and choice.stop_reason == ", thr"
        await assert_nothing_held(engine)


async def test_leaving_the_block_early_aborts(autojump_clock: trio.testing.MockClock) -> None:
    """Leaving the scope mid-stream aborts the request: nothing stays registered or allocated."""
    async with fake_engine(FakeRunner(text_script("z" * 300))) as engine:
        async with engine.open_request(PromptSpec(text="go"), params=SamplingParams(max_tokens=300)) as s:
            async for delta in s:
                if delta.text:
                    break
        await assert_nothing_held(engine)


async def test_prepare_stop_drains_then_aborts_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """prepare_stop refuses new requests, lets short ones finish and aborts what outlives the drain."""
    runner = FakeRunner(text_script("w" * 1000), step_s=0.1)
    async with fake_engine(runner) as engine:
        errors: list[BaseException] = []

        async def long_request() -> None:
            try:
                await engine.generate("go", SamplingParams(max_tokens=1000))
            except Exception as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_request)
            await trio.sleep(0.5)
            snap = await engine.prepare_stop(drain_timeout_s=1.0, abort_timeout_s=1.0)
        assert snap.drain_complete is True and snap.requests.active == 0
        assert len(errors) == 1
        assert await engine.prepare_stop() == snap
        with pytest.raises(Exception, match="stopping"):
            async with engine.open_request(PromptSpec(text="late")):
                pass  # pragma: no cover
        await assert_nothing_held(engine)


async def test_prepare_stop_on_an_idle_engine_returns_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With nothing running, prepare_stop returns without waiting for its timeouts."""
    async with fake_engine() as engine:
        start = trio.current_time()
        snap = await engine.prepare_stop()
        assert trio.current_time() - start < 0.05 and snap.drain_complete


async def test_the_drain_wakes_when_the_last_scope_closes_not_on_a_poll(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The drain is woken by the last scope's exit and the last admission's release: with the
    clock stopped (where a polling wait's sleep never ends) it completes at once."""
    async with fake_engine() as engine:
        admission = engine.admit()
        async with engine.open_request(PromptSpec(text="hi"), params=SamplingParams(max_tokens=2)) as stream:
            await stream.collect()
            autojump_clock.autojump_threshold = math.inf  # time stands still from here
            engine.begin_stop(drain_timeout_s=30.0, abort_timeout_s=3.0)
            await trio.testing.wait_all_tasks_blocked()
            assert engine.state == "stopping"
        await trio.testing.wait_all_tasks_blocked()
        assert engine.state == "stopping"  # the admission still holds the drain
        admission.release()
        await trio.testing.wait_all_tasks_blocked()
        assert engine.state == "stopped"  # before: asleep in a 10 ms poll, which never ended


async def test_an_admission_that_opens_after_the_drain_aborted_the_rest_is_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request admitted before the drain but still being prepared when the drain's deadline
    passes is aborted like the rest, not let in and served after the drain completed."""
    runner = FakeRunner(text_script("w" * 1000), step_s=0.1)
    async with fake_engine(runner) as engine:
        admission = engine.admit()
        engine.begin_stop(drain_timeout_s=1.0, abort_timeout_s=5.0)
        await trio.sleep(2.0)  # past the drain's deadline: it has aborted the rest
        assert engine.state == "stopping"
        with pytest.raises(RequestAborted):
            async with engine.open_request(
                PromptSpec(text="late"), params=SamplingParams(max_tokens=1000), admission=admission
            ) as stream:
                await stream.collect()  # before: 1000 tokens, 100 s past the drain's end
        admission.release()
        snap = await engine.wait_stopped()
        assert snap.requests.active == 0 and snap.requests.completed == 0
    await assert_nothing_held(engine)


async def test_detokenizers_get_the_prompt_as_left_context(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each choice's detokenizer starts with the prompt's last tokens as left context."""
    async with fake_engine() as engine:
        async with engine.open_request(PromptSpec(text="context")) as stream:
            first = await stream.__anext__()
            entry = engine.registry.get(stream.uid)
            assert entry is not None and entry.prompt_ids == stream.prompt_ids
            assert first.text == "H"
            await stream.collect()


async def test_prepare_stop_while_loading_stays_stopped() -> None:
    """A stop asked for while the model loads holds: the engine stays stopped once loaded."""
    import threading

    from ft.config import EngineConfig
    from ft.engine.engine import open_engine
    from tests.support.engine import fake_hooks, fake_parts

    release = threading.Event()
    load = fake_parts(FakeRunner())

    def slow_load(config: EngineConfig):  # type: ignore[no-untyped-def]
        release.wait(10)
        return load(config)

    hooks = fake_hooks(load_model=slow_load)
    with trio.fail_after(20):
        async with open_engine(EngineConfig(num_pages=64), hooks=hooks, wait_ready=False) as engine:
            snap = await engine.prepare_stop()
            assert snap.drain_complete and engine.state == "stopped"
            release.set()
            await engine.wait_ready()
            assert engine.state == "stopped"
            with pytest.raises(Exception, match="stopping"):
                async with engine.open_request(PromptSpec(text="late")):
                    pass  # pragma: no cover


async def test_a_cancelled_prepare_stop_still_drains_and_aborts_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelling the caller of prepare_stop does not cancel the drain, which ends on time."""
    runner = FakeRunner(text_script("w" * 1000), step_s=0.1)
    async with fake_engine(runner) as engine:
        errors: list[BaseException] = []

        async def long_request() -> None:
            try:
                await engine.generate("go", SamplingParams(max_tokens=1000))
            except Exception as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_request)
            await trio.sleep(0.5)
            with trio.move_on_after(1.0):  # the admin caller hangs up after 1 s
                await engine.prepare_stop(drain_timeout_s=30.0, abort_timeout_s=1.0)
            assert engine.state == "stopping"
            started = trio.current_time()
            snap = await engine.wait_stopped()
        assert 28.0 <= trio.current_time() - started <= 30.5
        assert engine.state == "stopped" and snap.requests.active == 0
        assert len(errors) == 1 and "stopping" in str(errors[0])
        assert snap.requests.aborted == 1 and snap.requests.failed == 0
        await assert_nothing_held(engine)


async def test_a_later_stop_shortens_a_running_drain(autojump_clock: trio.testing.MockClock) -> None:
    """A second stop with a shorter timeout brings the running drain's deadline forward."""
    runner = FakeRunner(text_script("w" * 1000), step_s=0.1)
    async with fake_engine(runner) as engine, trio.open_nursery() as nursery:

        async def long_request() -> None:
            with pytest.raises(RequestAborted):
                await engine.generate("go", SamplingParams(max_tokens=1000))

        nursery.start_soon(long_request)
        await trio.sleep(0.5)
        engine.begin_stop(drain_timeout_s=60.0)
        await trio.sleep(1.0)
        started = trio.current_time()
        snap = await engine.prepare_stop(drain_timeout_s=2.0, abort_timeout_s=1.0)
        assert trio.current_time() - started <= 3.1 and snap.requests.active == 0


async def test_a_request_compiling_its_grammar_is_refused_once_the_engine_stops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Admission is checked after the grammar compiles (which may take seconds): a request
    whose compilation outlives a drain is refused, not registered with a stopped engine."""
    gate = trio.Event()

    async def slow_grammars(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        if job is check_grammar_job:
            await gate.wait()
        return await run_inline(job, payload)

    async with fake_engine(executor=slow_grammars) as engine, trio.open_nursery() as nursery:

        async def constrained() -> None:
            params = SamplingParams(max_tokens=3, grammar=spec.regex("[a-z]+", "x"))
            with pytest.raises(EngineStopping):
                await engine.generate("go", params)

        nursery.start_soon(constrained)
        await trio.testing.wait_all_tasks_blocked()
        snap = await engine.prepare_stop()  # idle: the compiling request is not registered yet
        assert snap.requests.active == 0
        gate.set()
    await assert_nothing_held(engine)


# --- capacity counts what holds or waits for resources -----------------------------------------


async def test_the_checks_only_raise_and_the_refusing_actions_count() -> None:
    """`check_admission` and `check_fits` are pure checks: asking does not count a rejection;
    `admit`, `tokenize` and `counting_rejections` count each refusal once."""
    async with fake_engine(max_running_requests=1, max_queued_requests=0) as engine:
        held = engine.admit()
        for _ in range(3):
            with pytest.raises(Overloaded):
                engine.check_admission()
            with pytest.raises(ContextLengthExceeded):
                engine.check_fits(10_000, SamplingParams())
        assert engine.snapshot().requests.rejected == 0  # before: 6
        with pytest.raises(Overloaded):
            engine.admit()
        with pytest.raises(Overloaded):
            await engine.tokenize(PromptSpec(text="hi"))
        assert (await engine.tokenize(PromptSpec(text="hi"), admission=held)) == [
            byte_token(b) for b in b"hi"
        ]  # admitted: no limit
        with pytest.raises(ContextLengthExceeded), engine.counting_rejections():
            engine.check_fits(10_000, SamplingParams())
        assert engine.snapshot().requests.rejected == 3
        held.release()
        await assert_nothing_held(engine)


async def test_an_admitted_request_being_prepared_counts_against_the_queue() -> None:
    """Admitted requests still tokenizing or compiling count as queued: a burst of admissions
    cannot slip past the capacity; the request's own scope then opens without counting twice."""
    async with fake_engine(max_running_requests=1, max_queued_requests=1) as engine:
        first, second = engine.admit(), engine.admit()
        with pytest.raises(Overloaded):
            engine.admit()  # before: admitted (only open scopes were counted)
        async with engine.open_request(
            PromptSpec(text="hi"), params=SamplingParams(max_tokens=2), admission=first
        ) as s:
            with pytest.raises(Overloaded):
                engine.admit()
            await s.collect()
        second.release()
        first.release()
        engine.admit().release()
        await assert_nothing_held(engine)


async def test_a_request_the_engine_is_done_with_leaves_the_capacity() -> None:
    """Once every choice has finished, a request whose caller has not read its output yet no
    longer counts: the next request is admitted (it counts as `sending` in the stats)."""
    async with fake_engine(max_running_requests=1, max_queued_requests=0) as engine:
        async with engine.open_request(PromptSpec(text="hi"), params=SamplingParams(max_tokens=3)) as unread:
            with pytest.raises(Overloaded):
                engine.admit()
            with trio.fail_after(30):
                while engine.registry.num_in_engine:
                    await trio.sleep(0.01)
            snap = engine.snapshot().requests
            assert (snap.active, snap.sending, snap.waiting, snap.running) == (1, 1, 0, 0)
            async with engine.open_request(
                PromptSpec(text="hi"), params=SamplingParams(max_tokens=2)
            ) as other:
                assert len((await other.collect())[0].token_ids) == 2
            assert [len(c.token_ids) for c in await unread.collect()] == [3]
        await assert_nothing_held(engine)


async def test_a_request_refused_for_its_queue_wait_is_counted_as_rejected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`max_queue_wait_s` refuses a request as the full queue does (503, its load's fault, not
    the engine's): it counts as rejected, not as failed."""
    runner = FakeRunner(script=text_script("x" * 100), step_s=0.1)
    async with fake_engine(runner, max_running_requests=1, max_queue_wait_s=1.0) as engine:
        async with trio.open_nursery() as nursery:

            async def hold() -> None:
                async with engine.open_request(
                    PromptSpec(text="hi"), params=SamplingParams(max_tokens=50)
                ) as s:
                    await s.collect()

            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(Overloaded):
                async with engine.open_request(
                    PromptSpec(text="hi"), params=SamplingParams(max_tokens=2)
                ) as s:
                    await s.collect()
        snap = engine.snapshot().requests
        assert (snap.completed, snap.rejected, snap.failed) == (1, 1, 0)  # before: failed 1
        await assert_nothing_held(engine)


async def test_the_request_counts_add_up_while_the_scheduler_catches_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`active` is `running + waiting + sending`, none negative, at every moment: also just
    after a scope closed while its request ran (its `Abort` not yet taken by the scheduler)."""
    runner = FakeRunner(script=text_script("x" * 100), step_s=0.1)
    async with fake_engine(runner) as engine:
        async with engine.open_request(PromptSpec(text="hi"), params=SamplingParams(max_tokens=50)) as s:
            async for _ in s:
                break
        snap = engine.snapshot().requests  # no checkpoint since the scope closed
        counts = (snap.running, snap.waiting, snap.sending)
        assert min(counts) >= 0 and sum(counts) == snap.active == 0, snap  # before: waiting -1
        await assert_nothing_held(engine)


async def test_each_prompt_of_an_admitted_request_counts_while_it_is_prepared() -> None:
    """An admission of several prompts (a completions request with a prompt list) counts each
    of them against the capacity until its scope opens; release gives back what did not open."""
    async with fake_engine(max_running_requests=2, max_queued_requests=2) as engine:
        several = engine.admit(3)
        assert engine.snapshot().requests.preparing == 3
        engine.admit().release()  # one place left
        held = engine.admit()
        with pytest.raises(Overloaded):
            engine.admit()  # before: admitted (a 3-prompt admission counted as one)
        held.release()
        params = SamplingParams(max_tokens=1)
        async with engine.open_request(PromptSpec(text="hi"), params=params, admission=several) as s:
            assert engine.snapshot().requests.preparing == 2
            await s.collect()
        several.release()
        assert engine.snapshot().requests.preparing == 0
        await assert_nothing_held(engine)
