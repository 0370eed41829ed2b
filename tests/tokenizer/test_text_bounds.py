"""A text's bytes bound its token count from below (byte-level BPE only), and a long text cut
where `cut_points` says tokenizes as the whole does."""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers

from ft.engine.fake import SPECIALS, byte_tokenizer_spec
from ft.tokenizer.bounds import TextBounds, cut_points, text_bounds
from ft.tokenizer.spec import TokenizerSpec, sentencepiece_bpe_from_gguf, tokenizer_json_of


@functools.cache
def default_spec() -> TokenizerSpec:
    from ft.model.gguf_loader import gguf_tokenizer, open_gguf
    from ft.model.pull import default_model_path

    return gguf_tokenizer(open_gguf(default_model_path(progress=False)), 8192)


@functools.cache
def default_tokenizer() -> tuple[Tokenizer, TextBounds]:
    spec = default_spec()
    return spec.build(), text_bounds(spec.tokenizer_json)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


# Texts of every kind: any characters (control characters the vocabulary cannot spell among
# them), long runs of what the longest tokens are made of, words and the special tokens.
WORDS = ["the", " quick", "fox", "  ", "\n", "\n\n    ", "-" * 40, "=" * 20, "12345", "é", "中文", "🙂", "'s"]
TEXTS = st.one_of(
    st.text(max_size=400),
    st.text(alphabet=" \n\t-=_#*a", max_size=2000),
    st.lists(st.sampled_from([*WORDS, *SPECIALS, "<|im_end|>"]), max_size=300).map("".join),
    st.lists(st.sampled_from([" a", "b", " ", "c d", "\x04", "\x1d"]), max_size=400).map("".join),
)


@pytest.mark.slow
def test_the_default_models_longest_token_is_81_bytes_and_its_splits_are_known() -> None:
    _, bounds = default_tokenizer()
    assert bounds.max_token_bytes == 81
    assert bounds.can_cut
    assert bytes([0x04]) in bounds.unspelled  # a control byte its vocabulary drops


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_the_byte_bound_never_exceeds_the_true_token_count(text: str) -> None:
    tokenizer, bounds = default_tokenizer()
    assert bounds.min_tokens(text.encode("utf-8")) <= len(ids(tokenizer, text))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS, st.integers(min_value=1, max_value=64))
def test_a_text_cut_at_its_cut_points_tokenizes_as_the_whole(text: str, every: int) -> None:
    tokenizer, bounds = default_tokenizer()
    cuts = cut_points(text, tokenizer, bounds, every=every)
    assert cuts == sorted(set(cuts)) and all(0 < c < len(text) for c in cuts)
    pieces = [ids(tokenizer, text[a:b]) for a, b in itertools.pairwise([0, *cuts, len(text)])]
    assert [i for piece in pieces for i in piece] == ids(tokenizer, text)


@pytest.mark.slow
def test_a_long_english_text_is_cut_about_every_slice() -> None:
    tokenizer, bounds = default_tokenizer()
    text = "alpha beta gamma delta " * 20_000  # 460,000 characters
    cuts = cut_points(text, tokenizer, bounds)
    assert 13 <= len(cuts) <= 15
    assert max(b - a for a, b in itertools.pairwise([0, *cuts, len(text)])) < 2 * 32 * 1024
    assert bounds.min_tokens(text.encode()) > 4096  # 460 KB: at least 5,680 tokens


def test_a_sentencepiece_tokenizer_claims_no_bound() -> None:
    """Its normalizer rewrites spaces and prepends one: bytes bound nothing."""
    tokens = ["<unk>", "▁", "a", "b", "▁a", "ab", *(f"<0x{b:02X}>" for b in range(256))]
    tok = sentencepiece_bpe_from_gguf(tokens, [0.0] * len(tokens), None, [1] * len(tokens))
    bounds = text_bounds(tokenizer_json_of(tok))
    assert bounds.max_token_bytes is None and not bounds.can_cut
    assert bounds.min_tokens(b"a" * 10_000) == 0


def test_a_byte_level_tokenizer_with_a_normalizer_claims_no_bound() -> None:
    tok = byte_tokenizer_spec().build()
    tok.normalizer = normalizers.NFC()
    assert text_bounds(tok.to_str()).max_token_bytes is None


def test_the_fake_tokenizer_is_bounded_by_its_longest_special_token_and_is_never_cut() -> None:
    """One token per byte, and specials of up to 13 bytes; no split, so no cut is sound."""
    spec = byte_tokenizer_spec()
    bounds = text_bounds(spec.tokenizer_json)
    assert bounds.max_token_bytes == max(len(s) for s in SPECIALS) == 13
    assert not bounds.can_cut
    assert cut_points("a b " * 100_000, spec.build(), bounds) == []
    text = "<|im_end|>" * 100
    assert bounds.min_tokens(text.encode()) <= len(ids(spec.build(), text))
