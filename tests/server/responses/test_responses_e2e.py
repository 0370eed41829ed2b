"""`/v1/responses` over real HTTP on the real default model (SmolLM2-135M), official SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from ft.config import EngineConfig
from tests.support.server import running_server, wait_idle

pytestmark = pytest.mark.slow  # the real default model, or a long soak

QUESTION = "Name three colours."


async def test_sdk_responses_streamed_equals_unstreamed_at_temperature_0() -> None:
    """On the default model, the Responses SDK's streamed and non-streamed answers agree at temperature 0."""
    async with running_server(EngineConfig()) as s:
        model = s.engine.model_id
        client = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
        async with client:
            whole = await client.responses.create(
                model=model, input=QUESTION, temperature=0, max_output_tokens=24
            )
            assert whole.status in ("completed", "incomplete") and whole.output_text
            async with client.responses.stream(
                model=model, input=QUESTION, temperature=0, max_output_tokens=24
            ) as stream:
                events = [e async for e in stream]
            streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert streamed == whole.output_text
            assert events[-1].type == f"response.{whole.status}"
            if whole.status == "completed":
                final = await stream.get_final_response()
                assert final.output_text == whole.output_text
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(model=model, input=QUESTION, temperature=-1)
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            await wait_idle(c)
