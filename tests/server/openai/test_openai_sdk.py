"""Issue 3's acceptance checks on the fake model (fast, deterministic)."""

from __future__ import annotations

from ft.engine.fake import FakeRunner, text_script
from ft.server import RunningServer
from tests.support import scenarios
from tests.support.server import fake_server

LONG = "All work and no play makes Jack a dull boy. " * 20


async def test_sdk_chat_streamed_equals_unstreamed(server: RunningServer) -> None:
    """The OpenAI SDK's streamed chat adds up to its non-streamed answer."""
    await scenarios.sdk_chat_streamed_equals_unstreamed(server.base_url)


async def test_sdk_completions(server: RunningServer) -> None:
    """The OpenAI SDK's completions work, streamed and not."""
    await scenarios.sdk_completions(server.base_url)


async def test_sdk_bad_parameter_raises_bad_request(server: RunningServer) -> None:
    """A bad parameter raises the SDK's BadRequestError."""
    await scenarios.sdk_bad_parameter(server.base_url)


async def test_stream_sends_connected_before_a_slow_prefill() -> None:
    """`: connected` arrives before a slow prefill finishes."""
    async with fake_server(FakeRunner(step_s=3.0)) as s:
        await scenarios.connected_before_slow_prefill(s.base_url, "hello")


async def test_health_and_models_answer_while_streaming() -> None:
    """The control plane answers while a generation streams."""
    async with fake_server(FakeRunner(script=text_script(LONG), step_s=0.01)) as s:
        await scenarios.control_plane_answers_while_streaming(s.base_url)


async def test_two_concurrent_requests_with_one_running_slot() -> None:
    """With one running slot, two concurrent requests both complete."""
    async with fake_server(max_running_requests=1) as s:
        await scenarios.two_requests_one_slot(s.base_url)
