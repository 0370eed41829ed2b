"""The token-id rule every entry checks (`check_token_ids`), against its plain definition."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft.errors import InvalidRequest
from ft.params import SamplingParams, check_token_ids, first_outside_vocab


@given(st.lists(st.integers(-3, 12)), st.integers(1, 10))
def test_first_outside_vocab_is_the_first_id_out_of_range(ids: list[int], vocab_size: int) -> None:
    """The id named is the first one outside `0..vocab_size - 1`, None when there is none."""
    expected = next((t for t in ids if not 0 <= t < vocab_size), None)
    assert first_outside_vocab(ids, vocab_size) == expected


def test_check_token_ids_names_the_id_the_range_and_the_param() -> None:
    """The 400 every route and the engine give for an id outside the vocabulary."""
    check_token_ids([0, 9], 10, param="prompt")
    with pytest.raises(InvalidRequest, match=r"token id 10 is outside the vocabulary \(0\.\.9\)") as e:
        check_token_ids([3, 10, -1], 10, param="logit_bias")
    assert e.value.param == "logit_bias"


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_speculative_must_be_a_bool(value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(speculative=value)  # type: ignore[arg-type]
    assert info.value.param == "speculative"


def test_only_grammar_requests_and_the_switch_keep_speculation_off() -> None:
    from ft.grammar import spec

    assert SamplingParams().can_speculate
    assert SamplingParams(presence_penalty=1.0, logit_bias={1: 2.0}, temperature=0.5).can_speculate
    assert not SamplingParams(speculative=False).can_speculate
    assert SamplingParams(grammar=spec.regex("a+", "guided_regex")).can_speculate  # masked per draft


def test_max_tokens_zero_is_the_prompt_only_and_below_it_is_refused() -> None:
    """0 is a request that scores its prompt and generates nothing; -1 names the field."""
    assert SamplingParams(max_tokens=0).max_tokens == 0
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(max_tokens=-1)
    assert info.value.param == "max_tokens"
