"""A short soak: mixed, hostile, abandoned and overload traffic leaves no 5xx and no leak."""

from __future__ import annotations

import pytest
from soak import run_soak

from ft.engine.fake import FakeRunner, text_script
from tests.support.server import fake_server

pytestmark = pytest.mark.slow  # the real default model, or a long soak


async def test_short_soak_has_no_5xx_and_returns_to_baseline() -> None:
    """A short soak of mixed traffic gets no 5xx, and active requests and pages return to their baseline."""
    runner = FakeRunner(script=text_script("soak " * 40), step_s=0.005)
    async with fake_server(runner, max_running_requests=4, max_queued_requests=4) as server:
        report = await run_soak(server.base_url, clients=4, duration_s=6.0, warmup_s=1.0)
    assert report["server_errors_5xx"] == 0, report["server_error_samples"]
    assert report["active_before_after"] == [0, 0]
    assert report["used_pages_before_after"] == [0, 0]
    assert report["requests"] > 50
    kinds = {k.split(":")[0] for k in report["outcomes"]}
    assert {"chat", "stream", "hostile", "drop", "burst"} <= kinds or "burst" not in kinds
    assert report["ok"]
