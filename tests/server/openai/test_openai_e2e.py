"""Issue 3's acceptance checks over real HTTP on the real default model (SmolLM2-135M)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from ft.config import EngineConfig
from ft.server import RunningServer
from tests.support import scenarios
from tests.support.server import running_server

pytestmark = pytest.mark.slow  # the real default model, or a long soak

# SmolLM2's tokenizer splits digits one by one: this is ~3,900 prompt tokens, a prefill of
# seconds on a laptop CPU.
LONG_PROMPT = " ".join(str(i) for i in range(1000))


@asynccontextmanager
async def real_server(**config: object) -> AsyncIterator[RunningServer]:
    async with running_server(EngineConfig(**config)) as server:  # type: ignore[arg-type]
        yield server


async def test_sdk_chat_streamed_equals_unstreamed() -> None:
    """On the default model, the OpenAI SDK's chat and completions agree streamed and not."""
    async with real_server() as s:
        await scenarios.sdk_chat_streamed_equals_unstreamed(s.base_url)
        await scenarios.sdk_completions(s.base_url)
        await scenarios.sdk_bad_parameter(s.base_url)


async def test_stream_speaks_before_a_long_prefill_and_control_plane_stays_up() -> None:
    """On the default model, a long prompt's stream speaks before prefill ends; control answers."""
    async with real_server() as s:
        await scenarios.connected_before_slow_prefill(s.base_url, LONG_PROMPT)
        await scenarios.control_plane_answers_while_streaming(s.base_url)


async def test_two_concurrent_requests_with_one_running_slot() -> None:
    """On the default model, two requests with one running slot both complete."""
    async with real_server(max_running_requests=1) as s:
        await scenarios.two_requests_one_slot(s.base_url)
