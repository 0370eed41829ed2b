"""What each closed request reports (for the metrics), its id, and the engine's DEBUG lines."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from ft.engine.fake import FakeRunner, text_script
from ft.engine.stats import RequestReport
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine

LONG = "lorem ipsum " * 100


async def test_a_closed_request_reports_its_queue_time_ttft_gaps_and_lengths(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Five tokens at one step each 0.1 s apart: four gaps of 0.1 s, TTFT after the prefill."""
    reports: list[RequestReport] = []
    async with fake_engine(FakeRunner(text_script(LONG), step_s=0.1)) as engine:
        engine.stats.observers.append(reports.append)
        params = SamplingParams(max_tokens=5)
        async with engine.open_request(PromptSpec(text="hello"), params=params, request_id="r-1") as stream:
            await stream.collect()
    (report,) = reports
    assert report.request_id == "r-1" and report.outcome == "completed"
    assert report.finish_reasons == ("length",)
    assert report.num_prompt_tokens == len("hello") and report.num_output_tokens == 5
    assert report.queue_s is not None and report.ttft_s is not None
    assert 0 <= report.queue_s < 0.01  # nothing ahead of it
    assert report.ttft_s == pytest.approx(0.1, abs=0.01)  # one step: prefill and first token
    assert report.token_gaps_s == pytest.approx((0.1,) * 4, abs=0.01)
    assert report.e2e_s >= report.ttft_s + 0.4 - 0.01


async def test_a_request_that_waits_for_a_slot_reports_its_queue_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With one running slot, the second request's queue time covers the first one's run."""
    reports: list[RequestReport] = []
    async with fake_engine(FakeRunner(text_script(LONG), step_s=0.1), max_running_requests=1) as engine:
        engine.stats.observers.append(reports.append)

        async def one(request_id: str) -> None:
            params = SamplingParams(max_tokens=3)
            async with engine.open_request(
                PromptSpec(text="hi"), params=params, request_id=request_id
            ) as stream:
                await stream.collect()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first")
            await trio.sleep(0.01)
            nursery.start_soon(one, "second")
    second = next(r for r in reports if r.request_id == "second")
    assert second.queue_s is not None and second.queue_s >= 0.25


async def test_an_aborted_request_reports_no_first_token_and_a_made_up_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request cancelled before its first token: outcome aborted, no TTFT, an id made for it."""
    reports: list[RequestReport] = []
    async with fake_engine(FakeRunner(text_script(LONG), step_s=1.0)) as engine:
        engine.stats.observers.append(reports.append)
        with trio.move_on_after(0.5):
            async with engine.open_request(PromptSpec(text="hi")) as stream:
                await stream.collect()
    (report,) = reports
    assert report.outcome == "aborted" and report.ttft_s is None and report.token_gaps_s == ()
    assert report.request_id.startswith("req-")


async def test_the_engine_logs_summaries_at_debug_while_requests_live(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """At DEBUG the engine logs a summary every 10 s while anything is live."""
    caplog.set_level(logging.DEBUG, logger="ft.engine")
    async with fake_engine(FakeRunner(text_script(LONG), step_s=1.0)) as engine:
        with trio.move_on_after(25):
            params = SamplingParams(max_tokens=100)
            async with engine.open_request(PromptSpec(text="hi"), params=params, request_id="busy") as stream:
                await stream.collect()
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("summary:")]
    assert len(summaries) == 2 and summaries[0].startswith("summary: 1 running, 0 waiting")
    mine = [r for r in caplog.records if getattr(r, "request_id", None) == "busy"]
    assert {r.getMessage().split(": ")[1].split()[0] for r in mine} >= {"opened", "closed"}
