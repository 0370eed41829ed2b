"""What a text's length says about its token count, and where a long text may be cut.

**The bound.** Byte-level BPE (GPT-2's scheme, the default model's) spells every token as bytes
of the text: a text's tokens, end to end, are its UTF-8 bytes, but for the bytes the vocabulary
cannot spell, which are dropped. So a text of B such bytes has at least ceil(B / L) tokens, L
the longest token's bytes, added tokens included (81 on the default model: 4 MB of text is at
least 51,782 tokens, refused for an 8,192-token context without being tokenized). It holds
only where nothing rewrites the text first: no normalizer (NFC composes characters;
SentencePiece's replaces spaces and prepends one), pre-tokenizers that only split (none that
drops whitespace), no prefix space, no added token that strips the whitespace around it. For
any other tokenizer `TextBounds.max_token_bytes` is None and no bound is claimed.

**The cuts.** Such a tokenizer splits a text into pieces first (`pre_tokenizer`) and never
merges across a piece's edge, so a text cut where a piece ends tokenizes as its two halves do,
end to end. For the splits ft knows (`ft.tokenizer.spec.KNOWN_SPLITS`: GPT-2's and the ones
adapted from it), a piece always ends after an ASCII letter followed by a space and another
letter ("a| b"); each cut is also checked on the pre-tokenizer itself (a window around it) and
against the added tokens that hold a space. `cut_points` finds such places about every
`SLICE_CHARS` characters, so a long text is tokenized a slice at a time (and refused as soon as
its count passes the context), never in one call of unbounded length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from ft.tokenizer.spec import KNOWN_SPLITS, WORD_SPLITS, bytes_to_unicode

SLICE_CHARS = 32 * 1024  # characters tokenized in one call at most, where a cut can be found
CUT_WINDOW = 64  # characters either side of a cut that the pre-tokenizer is checked on
MAX_TRIES = 16  # candidate cuts tried per slice before searching the next stretch
# Byte values UTF-8 never holds: a vocabulary that cannot spell them drops nothing of a text.
NEVER_IN_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
_CANDIDATE = re.compile(r"[A-Za-z](?= [A-Za-z])")
# Pre-tokenizers that only split (keep every character): and the one byte-level map.
_SPLIT_BEHAVIORS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})


@dataclass(frozen=True, slots=True)
class TextBounds:
    """What a tokenizer lets ft say about a text from its bytes, and whether it may be cut.

    `max_token_bytes`: the longest token's UTF-8 bytes, None when the tokenizer is not
    byte-level BPE as the module describes (no bound then). `unspelled`: the byte values that
    may occur in UTF-8 and that the vocabulary cannot spell. `can_cut`: its pre-tokenizer is one
    `cut_points` may cut at. `spaced_added_tokens`: added tokens that hold a space (a cut must
    not fall inside one).
    """

    max_token_bytes: int | None = None
    unspelled: bytes = b""
    can_cut: bool = False
    spaced_added_tokens: tuple[str, ...] = ()

    def min_tokens(self, encoded: bytes) -> int:
        """The fewest tokens the text whose UTF-8 is `encoded` can have (0: no bound)."""
        if self.max_token_bytes is None:
            return 0
        spelled = len(encoded) - sum(encoded.count(b) for b in self.unspelled)
        return -(-spelled // self.max_token_bytes)


def too_long(at_least: int, max_tokens: int, how: str) -> str:
    """The refusal of a prompt known to have at least `at_least` tokens (`how` says why) where
    `max_tokens` fit: `ContextLengthExceeded`'s message."""
    return (
        f"the prompt has at least {at_least} tokens ({how}); this model's maximum context "
        f"length is {max_tokens} tokens"
    )


def text_bounds(tokenizer_json: str) -> TextBounds:
    """The bounds of the tokenizer serialized as `tokenizer_json` (see the module)."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    added = data.get("added_tokens") or []
    pre = data.get("pre_tokenizer")
    if (
        model.get("type") != "BPE"
        or data.get("normalizer") is not None
        or not _is_byte_level(pre)
        or any(token.get("lstrip") or token.get("rstrip") for token in added)
    ):
        return TextBounds()
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = bytes_to_unicode()
    # A vocabulary token spells one byte per character of the byte-level alphabet; one with
    # other characters is counted at its UTF-8 length (more than it can spell: still sound).
    spelling = frozenset(alphabet.values())
    longest = max((len(t) if set(t) <= spelling else len(t.encode()) for t in vocab), default=1)
    longest = max([longest, *(len(str(token.get("content", "")).encode()) for token in added)])
    unspelled = bytes(b for b, c in alphabet.items() if c not in vocab and b not in NEVER_IN_UTF8)
    spaced = tuple(str(t["content"]) for t in added if " " in str(t.get("content", "")))
    return TextBounds(longest, unspelled, _has_known_splits(pre), spaced)


def _parts(pre: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]


def _is_byte_level(pre: Any) -> bool:
    """A pre-tokenizer of splits that keep every character, then GPT-2's byte-level map with
    no prefix space."""
    if not isinstance(pre, dict):
        return False
    parts = _parts(pre)
    if not parts or parts[-1].get("type") != "ByteLevel" or parts[-1].get("add_prefix_space"):
        return False
    return all(p.get("type") == "Split" and p.get("behavior") in _SPLIT_BEHAVIORS for p in parts[:-1])


def _has_known_splits(pre: dict[str, Any]) -> bool:
    """Whether every split is one ft knows (`KNOWN_SPLITS`) and one of them cuts words
    (`WORD_SPLITS`, or GPT-2's, which the byte-level map applies with `use_regex`)."""
    *splits, byte_level = _parts(pre)
    patterns = [
        (p.get("pattern") or {}).get("Regex")
        if p.get("behavior") == "Isolated" and not p.get("invert")
        else None
        for p in splits
    ]
    cuts_words = bool(byte_level.get("use_regex")) or any(p in WORD_SPLITS for p in patterns)
    return cuts_words and all(p in KNOWN_SPLITS for p in patterns)


def cut_points(text: str, tokenizer: Tokenizer, bounds: TextBounds, *, every: int = SLICE_CHARS) -> list[int]:
    """Offsets, increasing and inside `text`, where it may be cut into slices that tokenize as
    the whole does: about one every `every` characters (farther apart where no place to cut is
    near). Empty when `bounds.can_cut` is false or the text is shorter than `every`.

    Linear in the text: a regex search per slice, and the pre-tokenizer on `2 * CUT_WINDOW`
    characters per candidate (at most `MAX_TRIES` candidates per stretch of `every`).
    """
    cuts: list[int] = []
    if not bounds.can_cut or tokenizer.pre_tokenizer is None:
        return cuts
    start = 0
    search = every
    while search < len(text):
        cut = _find_cut(text, tokenizer, bounds, search, min(len(text), search + every))
        if cut is None:
            search += every  # nothing to cut at here: the slice grows
            continue
        cuts.append(cut)
        start = cut
        search = start + every
    return cuts


def _find_cut(text: str, tokenizer: Tokenizer, bounds: TextBounds, begin: int, end: int) -> int | None:
    pre = tokenizer.pre_tokenizer
    assert pre is not None
    for tries, match in enumerate(_CANDIDATE.finditer(text, begin, end)):
        if tries >= MAX_TRIES:
            return None
        cut = match.end()
        if _inside_added_token(text, cut, bounds.spaced_added_tokens):
            continue
        lo = max(0, cut - CUT_WINDOW)
        window = text[lo : cut + CUT_WINDOW]
        if any(stop == cut - lo for _, (_, stop) in pre.pre_tokenize_str(window)):
            return cut
    return None


def _inside_added_token(text: str, cut: int, tokens: tuple[str, ...]) -> bool:
    # An occurrence within `len - 1` characters either side of the cut spans it.
    return any(token in text[max(0, cut - len(token) + 1) : cut + len(token) - 1] for token in tokens)
