"""Grammar masks in real model steps (a tiny random model): every sampling mode obeys them."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.core.batch import RowsFailed, SeqWork
from ft.grammar import spec
from ft.params import SamplingParams
from tests.support.grammar import byte_runner, byte_seq_matcher, generate, text_of

AB = spec.regex("[ab]{6}", "x")

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=1.5, seed=1),
    "top_k_top_p_min_p": SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.05, seed=2),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.8, frequency_penalty=2.0,
                                presence_penalty=2.0, seed=3),
    # a bias of +100 on bytes the grammar forbids ("x", "y", "z") must not win
    "logit_bias": SamplingParams(temperature=0.0, logit_bias={3 + ord("x"): 100.0, 3 + ord("y"): 100.0}),
    "logprobs": SamplingParams(temperature=1.0, logprobs=True, top_logprobs=5, seed=4),
}  # fmt: skip


@pytest.mark.parametrize("mode", list(MODES))
def test_every_sampling_mode_follows_the_grammar(mode: str) -> None:
    """Greedy, sampled, filtered, penalized, biased and logprob rows all yield `[ab]{6}` then EOS."""
    runner = byte_runner()
    [(tokens, ended)] = generate(runner, [byte_seq_matcher(AB)], [MODES[mode]], max_tokens=20)
    assert ended and len(tokens) == 6 and set(text_of(tokens)) <= {"a", "b"}, text_of(tokens)


def test_constrained_and_free_rows_share_a_batch() -> None:
    """A free row beside constrained ones is untouched by their masks: it matches its solo run."""
    runner = byte_runner()
    free = SamplingParams(temperature=0.0)
    [(alone, _)] = generate(runner, [None], [free], max_tokens=12)
    mixed = generate(runner, [byte_seq_matcher(AB), None, byte_seq_matcher(AB)], [free, free, free], 12)
    assert mixed[1][0] == alone
    assert all(set(text_of(t)) <= {"a", "b"} for t, _ in (mixed[0], mixed[2]))


def test_a_failed_grammar_fails_its_row_and_the_others_are_sampled() -> None:
    """A matcher in error fails its own row (`RowsFailed` names its sequence); the other rows
    of the step are sampled and advanced once, so nothing is rerun."""
    runner = byte_runner()
    good, bad = byte_seq_matcher(AB), byte_seq_matcher(AB)
    bad.llg.consume_token(3 + ord("z"))  # forbidden: the matcher is now in error
    assert bad.llg.is_error()
    works = [SeqWork(i, (60, 61), 0, (i,), True, SamplingParams(temperature=0.0), 0, matcher=m)
             for i, m in enumerate([good, bad])]  # fmt: skip
    with pytest.raises(RowsFailed) as err:
        runner.step(works)
    assert [seq_id for seq_id, _ in err.value.failed] == [1]
    [s] = err.value.sampled
    assert s.seq_id == 0 and chr(s.token_id - 3) in "ab"
    after = good.llg.deep_copy()
    assert good.num_masks == 1 and after.consume_tokens([3 + ord("a")] * 5) and after.is_accepting()


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", 7, None]}, "minItems": 1, "maxItems": 4},
    {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-f0-9]{4}$"}]},
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["x"], "additionalProperties": False}}, "type": "array", "items": {"$ref": "#/$defs/p"},
     "maxItems": 3},
]  # fmt: skip


@settings(max_examples=12, deadline=None)
@given(schema=st.sampled_from(SCHEMAS), seed=st.integers(0, 2**31), temperature=st.floats(0.5, 2.0))
def test_random_models_write_valid_json(schema: dict[str, object], seed: int, temperature: float) -> None:
    """Whatever the weights and the seed, the output parses and validates (every schema here
    bounds its output, so the grammar itself ends it well within the 200 tokens)."""
    runner = byte_runner(seed % 7)
    params = SamplingParams(temperature=temperature, seed=seed)
    [(tokens, ended)] = generate(runner, [byte_seq_matcher(spec.json_schema(schema, "x"))], [params], 200)
    assert ended
    jsonschema.validate(json.loads(text_of(tokens)), schema)
