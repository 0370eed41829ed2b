"""`max_tokens` 0 on the engine: the prompt fed and scored, nothing generated (lm-eval's
loglikelihood requests arrive so, through `/v1/completions` with echo)."""

from __future__ import annotations

import pytest
import trio

from ft.engine.fake import FakeRunner, text_script
from ft.errors import ContextLengthExceeded
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.engine import fake_engine

CONTEXT = 64


@pytest.mark.parametrize("script", ["Hello", ""])  # "": the token that ends the prefill is EOS
async def test_max_tokens_zero_gives_the_prompt_scores_and_no_token(script: str) -> None:
    """Each choice: its prompt's logprobs, no text, token or logprob, finish "length" (whatever
    the token sampled to end the prefill was), and no completion tokens counted."""
    prompt = [65 + i % 26 for i in range(CONTEXT - 1)]
    params = SamplingParams(max_tokens=0, n=2, prompt_logprobs=1, logprobs=True, temperature=0.0)
    async with fake_engine(FakeRunner(text_script(script), step_s=0.0), context_length=CONTEXT) as engine:
        async with engine.open_request(PromptSpec(token_ids=prompt), params=params) as stream:
            with trio.fail_after(30):
                choices = await stream.collect()
        assert stream.num_completion_tokens == 0
    for c in choices:
        assert (c.text, c.token_ids, c.logprobs) == ("", [], [])
        assert c.finish_reason == "length" and c.stop_reason is None
        assert [s.token_id for s in c.prompt_logprobs] == prompt[1:]


async def test_max_tokens_zero_takes_a_prompt_as_long_as_the_context() -> None:
    """Nothing is generated, so no room is needed past the prompt: a prompt of exactly the
    context is scored; one token more is refused, and so is the full context with max_tokens 1."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0)
    async with fake_engine(FakeRunner(step_s=0.0), context_length=CONTEXT) as engine:
        async with engine.open_request(PromptSpec(token_ids=[65] * CONTEXT), params=params) as stream:
            with trio.fail_after(30):
                (choice,) = await stream.collect()
        assert choice.finish_reason == "length" and len(choice.prompt_logprobs) == CONTEXT - 1
        with pytest.raises(ContextLengthExceeded):
            engine.check_fits(CONTEXT + 1, params)
        with pytest.raises(ContextLengthExceeded):
            engine.check_fits(CONTEXT, SamplingParams(max_tokens=1))
