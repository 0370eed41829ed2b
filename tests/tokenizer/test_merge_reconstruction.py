"""Merges recovered from a sentencepiece vocabulary's scores: the same merges, in bounded time."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.tokenizer.spec import MAX_MERGED_TOKEN_CHARS, _merges_from_scores, sentencepiece_bpe_from_gguf


def every_split(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The reconstruction as it was first written: every split of every token (quadratic)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores, strict=False))
    found: list[tuple[float, int, int, tuple[str, str]]] = []
    for merged in vocab:
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                found.append((-score.get(merged, 0.0), vocab[left], vocab[right], (left, right)))
    found.sort()
    return [pair for *_, pair in found]


def sentencepiece_like_vocab() -> tuple[list[str], list[float]]:
    """Byte pieces, letters, then word pieces with and without the `▁` word mark, scored by rank."""
    words = "the of and to in is was for on that with as by at from his her an which were are".split()
    pieces = [f"<0x{b:02X}>" for b in range(256)] + list("abcdefghijklmnopqrstuvwxyz▁")
    for w in words:
        pieces += [w[:k] for k in range(2, len(w) + 1)] + ["▁" + w[:k] for k in range(1, len(w) + 1)]
    tokens = ["<unk>", "<s>", "</s>", *dict.fromkeys(pieces)]
    return tokens, [-float(i) for i in range(len(tokens))]


def test_reconstruction_matches_every_split_on_a_sentencepiece_like_vocab() -> None:
    tokens, scores = sentencepiece_like_vocab()
    merges = _merges_from_scores(tokens, scores)
    assert merges == every_split(tokens, scores)
    assert ("▁th", "e") in merges


@pytest.mark.slow
def test_reconstruction_matches_every_split_on_the_default_models_vocab() -> None:
    """The default model's 49,152 tokens (longest: 81 characters), scored by rank."""
    from ft.model.gguf_file import GGUFFile
    from ft.model.pull import default_model_path

    tokens: list[str] = GGUFFile(default_model_path(progress=False)).require("tokenizer.ggml.tokens")
    assert max(map(len, tokens)) <= MAX_MERGED_TOKEN_CHARS
    scores = [-float(i) for i in range(len(tokens))]
    assert _merges_from_scores(tokens, scores) == every_split(tokens, scores)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("ab▁", min_size=1, max_size=8), min_size=1, max_size=40, unique=True))
def test_reconstruction_matches_every_split_on_any_vocab_of_short_tokens(tokens: list[str]) -> None:
    scores = [float(len(t)) for t in tokens]
    assert _merges_from_scores(tokens, scores) == every_split(tokens, scores)


def test_a_400000_character_token_loads_in_well_under_a_second() -> None:
    """A downloaded vocabulary with no merges and one huge token (trying every split of it
    took over 60 s): the token gets no merges and the tokenizer still loads and encodes."""
    tokens, scores = sentencepiece_like_vocab()
    tokens.append("a" * 400_000)
    scores.append(0.0)
    start = time.process_time()  # CPU: a neighbour's load is not the loader's
    tok = sentencepiece_bpe_from_gguf(tokens, scores, None, [1] * len(tokens))
    assert time.process_time() - start < 1.0
    merges = json.loads(tok.to_str())["model"]["merges"]
    assert all(len("".join(m) if isinstance(m, list) else m) < 1000 for m in merges)
    assert tok.encode("the", add_special_tokens=False).tokens == ["▁the"]
