"""`/v1/messages` over real HTTP on the real default model (SmolLM2-135M), official SDK."""

from __future__ import annotations

from typing import Literal

import anthropic
import httpx
import pydantic
import pytest

from ft.config import EngineConfig
from tests.support.server import running_server, wait_idle

pytestmark = pytest.mark.slow  # the real default model, or a long soak

USER = [{"role": "user", "content": "Name three colours."}]


async def test_sdk_messages_streamed_equals_unstreamed_at_temperature_0() -> None:
    """On the default model, the Anthropic SDK's streamed and non-streamed answers agree at temperature 0."""
    async with running_server(EngineConfig()) as s:
        model = s.engine.model_id
        client = anthropic.AsyncAnthropic(base_url=s.base_url, api_key="unused", max_retries=0)
        async with client:
            # NOTE: this SDK version has no `temperature` argument; the API takes it.
            greedy = {"temperature": 0}
            whole = await client.messages.create(model=model, max_tokens=24, messages=USER, extra_body=greedy)
            assert whole.stop_reason in ("end_turn", "max_tokens")
            text = "".join(b.text for b in whole.content if b.type == "text")
            assert text
            async with client.messages.stream(
                model=model, max_tokens=24, messages=USER, extra_body=greedy
            ) as stream:
                streamed = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            assert streamed == text
            assert final.usage.output_tokens == whole.usage.output_tokens
            counted = await client.messages.count_tokens(model=model, messages=USER)
            assert counted.input_tokens == whole.usage.input_tokens
            with pytest.raises(anthropic.BadRequestError):
                await client.messages.create(
                    model=model, max_tokens=8, messages=USER, extra_body={"top_k": -5}
                )
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            await wait_idle(c)


class Colour(pydantic.BaseModel):
    # Bounded by the schema itself: the SDK moves string limits into descriptions.
    name: Literal["red", "green", "blue"]
    is_warm: bool


async def test_sdk_messages_parse_returns_the_model() -> None:
    """`messages.parse(output_format=Model)` (sent as `output_config.format`) parses: the answer
    is constrained to the model's schema."""
    async with running_server(EngineConfig()) as s:
        client = anthropic.AsyncAnthropic(base_url=s.base_url, api_key="unused", max_retries=0)
        async with client:
            parsed = await client.messages.parse(
                model=s.engine.model_id, max_tokens=200, messages=USER, output_format=Colour
            )
        assert isinstance(parsed.parsed_output, Colour)
