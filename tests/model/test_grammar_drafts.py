"""Drafts under a grammar: a mask for each drafted position, a draft the grammar refuses refused
at verification, greedy tokens those of plain constrained decoding and sampled tokens keeping
the masked distribution (chi-square over many seeded draws)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import jsonschema
import numpy as np
import pytest
import torch

from ft.core.batch import Sampled, SeqWork
from ft.grammar import spec
from ft.grammar.compiled import Matcher
from ft.model.masks import StepMasks, allows
from ft.model.sampler import filter_logits
from ft.model.speculative import sample_with_drafts
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.model.test_verify_drafts import CHI2_1E4, DRAWS, chi_square
from tests.support.grammar import BYTE_VOCAB, EOS, byte_runner, byte_seq_matcher, generate, text_of

TWO = spec.regex("[a-e][a-d]", "x")  # a mask that differs by position


def byte(c: str) -> int:
    return 3 + ord(c)


def allowed_of(bits: np.ndarray) -> list[int]:
    return [t for t in range(BYTE_VOCAB) if allows(bits, t)]


def masks_of(matcher: Matcher, drafts: tuple[int, ...]) -> StepMasks:
    work = SeqWork(0, (60, *drafts), 5, (0,), True, SamplingParams(temperature=0.0), 0,
                   matcher=matcher, num_draft=len(drafts))  # fmt: skip
    masks = StepMasks([work], BYTE_VOCAB, overlap=False)
    masks.wait()
    return masks


def test_each_drafted_position_gets_its_mask_until_the_grammar_refuses_a_draft() -> None:
    m = byte_seq_matcher(TWO)
    masks = masks_of(m, (byte("b"), byte("e"), byte("a")))  # "e" is refused second
    [bits] = masks.bits
    assert len(bits) == 2 and masks.is_refused == [True]
    assert allowed_of(bits[0]) == [byte(c) for c in "abcde"]
    assert allowed_of(bits[1]) == [byte(c) for c in "abcd"]
    assert masks.num_verifiable(0, 3) == 2  # "b" and the refused "e"
    # The drafts were rolled back: the next mask is position 0's again.
    again = masks_of(m, ())
    assert (again.bits[0] == bits[:1]).all() and m.num_masks == 3


def test_all_drafts_allowed_give_a_mask_after_the_last_and_the_grammar_end() -> None:
    masks = masks_of(byte_seq_matcher(TWO), (byte("c"), byte("a"), EOS[0]))
    [bits] = masks.bits
    assert len(bits) == 4 and masks.is_refused == [False]
    assert allowed_of(bits[2]) == [EOS[0]] and allowed_of(bits[3]) == [EOS[0]]
    assert masks.num_verifiable(0, 3) == 3


def test_the_matcher_takes_the_accepted_drafts_and_the_token_after_them() -> None:
    m = byte_seq_matcher(TWO)
    masks = masks_of(m, (byte("c"), byte("a")))
    masks.accept([[Sampled(0, byte("c")), Sampled(0, byte("b"))]])  # "a" refused by the model
    assert m.next_tokens == (byte("c"), byte("b"))
    assert allowed_of(masks_of(m, ()).bits[0][0]) == [EOS[0]]  # "cb": the grammar is done


# --- the distribution -------------------------------------------------------------------------


def masked_targets(
    logits: torch.Tensor, params: SamplingParams, allowed: list[list[int]]
) -> list[list[float]]:
    rows = []
    for j, tokens in enumerate(allowed):
        x = torch.full_like(logits[j], float("-inf"))
        x[tokens] = logits[j][tokens]
        rows.append(filter_logits(x, params).softmax(-1).tolist())
    return rows


# The drafter's distributions at the two positions: mass on tokens the grammar refuses there
# ("z"; "e" at the second position) as well as on allowed ones.
DRAFT_Q = {"a": 0.30, "b": 0.05, "d": 0.15, "e": 0.20, "z": 0.30}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread: 40,000 tiny steps on a loaded 2-core machine would otherwise spend
    their time in OpenMP's barriers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_sampled_drafts_under_a_grammar_keep_the_masked_distribution(drafter: str) -> None:
    """Two drafts through `sample_with_drafts` with real masks: the first token follows the
    masked processed distribution at position 0, the second (given the first draft kept) the
    one at position 1; a refused draft is never output."""
    torch.manual_seed(3)
    logits = torch.randn(3, BYTE_VOCAB) * 1.5  # [k + 1, vocab]
    logits[:, [byte(c) for c in "abcdez"]] += 3.0  # the grammar's tokens are not all rare
    params = SamplingParams(temperature=0.9, top_k=50)
    allowed = [[byte(c) for c in "abcde"], [byte(c) for c in "abcd"]]
    target = masked_targets(logits, params, allowed)
    q = torch.zeros(2, BYTE_VOCAB, dtype=torch.float64)
    for c, p in DRAFT_Q.items():
        q[:, byte(c)] = p
    matcher = byte_seq_matcher(TWO)
    step_masks: dict[tuple[int, ...], StepMasks] = {}  # the masks depend only on the drafts
    first, second = [0] * BYTE_VOCAB, [0] * BYTE_VOCAB
    for seed in range(DRAWS):
        if drafter == "model":
            g = torch.Generator().manual_seed(10_000_000 + seed)
            drafts = tuple(int(torch.multinomial(q[j], 1, generator=g)) for j in range(2))
        else:
            drafts = (byte("b"), byte("e"))  # the second always refused
        work = SeqWork(0, (60, *drafts), 5, (0,), True, SamplingParams(temperature=0.9, top_k=50, seed=seed),
                       0, matcher=matcher, num_draft=2)  # fmt: skip
        if drafts not in step_masks:
            step_masks[drafts] = StepMasks([work], BYTE_VOCAB, overlap=False)
        masks = step_masks[drafts]
        [out] = sample_with_drafts(logits.clone(), [work], masks, {0: q} if drafter == "model" else None)
        assert all(s.token_id != byte("z") for s in out)
        first[out[0].token_id] += 1
        if out[0].token_id == drafts[0] and len(out) > 1:  # kept (its masks were in time)
            second[out[1].token_id] += 1
    assert matcher.next_tokens == ()  # never advanced by a draft
    assert chi_square(first, target[0]) < CHI2_1E4[4]
    assert chi_square(second, target[1]) < CHI2_1E4[3]
    assert sum(second) > DRAWS // 20


# --- the real runner, greedy --------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {"type": "array",
                   "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
    "required": ["name", "tags"], "additionalProperties": False,
}  # fmt: skip
PROMPT = (EOS[0] + 1, 60, 61)
PAGES = tuple(range(16))


def speculative_constrained(
    runner: TorchRunner,
    matcher: Matcher,
    params: SamplingParams,
    drafts_for: Callable[[int, list[int]], list[int]],
) -> tuple[list[int], int]:
    """Constrained decoding where step i feeds `drafts_for(i, output)` after the last token;
    the tokens before EOS and how many steps it took."""
    [first] = runner.step([SeqWork(0, PROMPT, 0, PAGES, True, params, 0, matcher=matcher)])
    assert isinstance(first, Sampled)
    out = [first.token_id]
    steps = 1
    while out[-1] not in EOS and len(out) < 200:
        drafts = drafts_for(steps, out)
        pos = len(PROMPT) + len(out) - 1
        work = SeqWork(0, (out[-1], *drafts), pos, PAGES, True, params, len(out), matcher=matcher,
                       num_draft=len(drafts))  # fmt: skip
        got = [s.token_id for s in runner.step([work]) if isinstance(s, Sampled)]
        assert 1 <= len(got) <= len(drafts) + 1
        out += got
        steps += 1
    end = next(i for i, t in enumerate(out) if t in EOS)  # a finished sequence takes no more
    return out[:end], steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_drafts_under_a_schema_give_the_plain_constrained_tokens(seed: int) -> None:
    """Right drafts, drafts the grammar refuses (a control byte: never valid JSON) and drafts
    the model refuses: the tokens of plain constrained decoding, in fewer steps."""
    runner = byte_runner(seed)
    params = SamplingParams(temperature=0.0)
    [(plain, ended)] = generate(runner, [byte_seq_matcher(spec.json_schema(SCHEMA, "x"))], [params], 200)
    assert ended
    reference = [*plain, EOS[0]]

    def drafts_for(step: int, out: list[int]) -> list[int]:
        drafts = reference[len(out) : len(out) + 4]
        if step % 3 == 1 and len(drafts) > 1:
            drafts[1] = byte("\x01")  # refused by the grammar
        elif step % 3 == 2 and drafts:
            drafts[0] = byte("q") if drafts[0] != byte("q") else byte("r")  # the model's refusal
        return drafts

    tokens, steps = speculative_constrained(runner, byte_seq_matcher(spec.json_schema(SCHEMA, "x")), params,
                                            drafts_for)  # fmt: skip
    assert tokens == plain
    assert steps < len(plain) * 0.8
    jsonschema.validate(json.loads(text_of(tokens)), SCHEMA)
