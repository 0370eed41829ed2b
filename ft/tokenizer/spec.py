"""The tokenizer a model ships, as plain data, and its construction from GGUF vocabularies."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger("ft.tokenizer")

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (Phi-4-mini, Llama 4): a word is a run of upper-case letters then lower-case ones, a
# contraction stays on its word, digits by three, "/" kept after punctuation
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_SPLIT = r"\p{N}"  # every digit a piece of its own, before GPT-2's split
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# The splits llama.cpp applies per `tokenizer.ggml.pre` (`llm_tokenizer_bpe`, as the
# tokenizer.json regexes they were adapted from), one after the other, each piece of one split
# by the next. transformers mirrors the single-regex ones, so ids agree with it on those files.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O_SPLIT,)),
    # StarCoder's vocabulary and those trained like it (SmolLM, Granite 3.x: "refact")
    **dict.fromkeys(
        ("starcoder", "refact", "smollm", "command-r", "codeshell", "exaone"), (_DIGITS_SPLIT, _GPT2_SPLIT)
    ),
}
# The splits above and GPT-2's that cut words: each piece of theirs ends after a letter that
# a space and a letter follow (`ft.tokenizer.bounds` cuts long texts there); the digit split
# cuts only around digits, so it keeps those places.
WORD_SPLITS = frozenset(
    {*(s for splits in PRE_TOKENIZER_SPLITS.values() for s in splits), _GPT2_SPLIT} - {_DIGITS_SPLIT}
)
KNOWN_SPLITS = WORD_SPLITS | {_DIGITS_SPLIT}
# Types llama.cpp splits as GPT-2 does, ft's fallback too (a file without the key is "default").
GPT2_PRE_TOKENIZERS = frozenset(
    ("default", "gpt-2", "phi-2", "olmo", "mpt", "jais", "roberta-bpe", "granite-docling", "trillion")
)


# The longest token whose merges are reconstructed from scores: real vocabularies stay under
# ~100 characters, and trying every split of a token costs the square of its length (one
# 400,000-character token in a downloaded file took minutes to load).
MAX_MERGED_TOKEN_CHARS = 256


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """A model's tokenizer as CBOR-encodable plain fields, so worker processes can rebuild it."""

    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    eos_token_ids: tuple[int, ...]
    context_length: int

    def build(self) -> Tokenizer:
        """A `tokenizers.Tokenizer` (cached per process by its JSON)."""
        return build_tokenizer(self.tokenizer_json)


@lru_cache(maxsize=4)
def build_tokenizer(tokenizer_json: str) -> Tokenizer:
    """Deserialize a `tokenizers.Tokenizer`."""
    return Tokenizer.from_str(tokenizer_json)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _add_gguf_special_tokens(
    tok: Tokenizer, tokens: list[str], token_types: list[int], alphabet: set[str] | None
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens."""
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == TOKEN_TYPE_USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)


def byte_level_bpe_from_gguf(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str | None
) -> Tokenizer:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`), built as transformers' GGUF converter does."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))  # type: ignore[arg-type]
    tok.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(tok, tokens, token_types, alphabet)
    return tok


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """How a byte-level BPE vocabulary's text is cut before merging, for `tokenizer.ggml.pre`.

    A type ft does not know is split as GPT-2 (llama.cpp's default) with a warning: its ids may
    differ from the ones the model was trained on wherever its own split differs.
    """
    name = pre or "default"
    splits = PRE_TOKENIZER_SPLITS.get(name)
    if splits is None:
        if name not in GPT2_PRE_TOKENIZERS:
            log.warning(
                "GGUF pre-tokenizer %r is not known to ft: splitting text as GPT-2 does (known: %s)",
                pre,
                ", ".join(sorted({*PRE_TOKENIZER_SPLITS, *GPT2_PRE_TOKENIZERS})),
            )
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def sentencepiece_bpe_from_gguf(
    tokens: list[str], scores: list[float], merges: list[str] | None, token_types: list[int]
) -> Tokenizer:
    """Sentencepiece-style BPE (`tokenizer.ggml.model == "llama"`) with byte fallback."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs: list[tuple[str, str]]
    if merges:
        pairs = [(m.split(" ", 1)[0], m.split(" ", 1)[1]) for m in merges]
    else:
        pairs = _merges_from_scores(tokens, scores)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            unk_token="<unk>" if "<unk>" in vocab else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    _add_gguf_special_tokens(tok, tokens, token_types, None)
    return tok


def gemma_from_gguf(tokens: list[str], token_types: list[int]) -> Tokenizer:
    """Gemma's SentencePiece BPE from a GGUF (`tokenizer.ggml.model == "llama"`, no merges):
    as transformers' `GemmaTokenizer` builds it from the same file.

    No prefix space (spaces become "▁" and nothing is prepended), byte fallback, merges rebuilt
    from the vocabulary in file order (Gemma's scores do not follow its merge order); the tokens
    of several "▁" that llama.cpp's converter stores as spaces are spelled back.
    """
    spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=gemma_merges(spelled),
            unk_token="<unk>" if "<unk>" in vocab else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_gguf_special_tokens(tok, spelled, token_types, None)
    return tok


def gemma4_from_gguf(tokens: list[str], merges: list[str], token_types: list[int]) -> Tokenizer:
    """Gemma 4's BPE from a GGUF (`tokenizer.ggml.model == "gemma4"`), as llama.cpp reads it
    (its `LLAMA_VOCAB_PRE_TYPE_GEMMA4`): spaces become "▁" (nothing prepended), runs of
    newlines split from the rest, the file's merges ranked in file order over UTF-8
    characters, byte fallback to the `<0x..>` tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(m.split(" ", 1)[0], m.split(" ", 1)[1]) for m in merges],  # (each checked to be two)
            unk_token="<unk>" if "<unk>" in vocab else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_gguf_special_tokens(tok, tokens, token_types, None)
    return tok


def gemma_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the earlier tokens' first (transformers'
    `generate_merges` with the file's order as scores), bounded as `_merges_from_scores`."""
    vocab = {t: i for i, t in enumerate(tokens)}
    lengths = {len(t) for t in vocab if len(t) < MAX_MERGED_TOKEN_CHARS}
    found: list[tuple[int, int, int, int, int, tuple[str, str]]] = []
    for merged, index in vocab.items():
        if len(merged) > MAX_MERGED_TOKEN_CHARS:
            continue
        for cut in range(1, len(merged)):
            if cut not in lengths or len(merged) - cut not in lengths:
                continue
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                # best first: earlier token, then (as transformers' reversed stable sort) the
                # longer left piece, then the order of the pieces' ids
                found.append((index, -len(left), -len(right), vocab[left], vocab[right], (left, right)))
    found.sort()
    return [pair for *_, pair in found]


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary: every split of a token into two tokens.

    Linear in the vocabulary's characters: a token longer than `MAX_MERGED_TOKEN_CHARS` gets
    no merges, and a cut is only tried where both halves have the length of some token.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores, strict=False))
    lengths = {len(t) for t in vocab if len(t) < MAX_MERGED_TOKEN_CHARS}
    found: list[tuple[float, int, int, tuple[str, str]]] = []
    for merged in vocab:
        if len(merged) > MAX_MERGED_TOKEN_CHARS:
            continue
        for cut in range(1, len(merged)):
            if cut not in lengths or len(merged) - cut not in lengths:
                continue
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                found.append((-score.get(merged, 0.0), vocab[left], vocab[right], (left, right)))
    found.sort()
    return [pair for *_, pair in found]


# Special tokens that decoded text keeps even when special tokens are skipped: the tool-call
# markers of Phi-4-mini's and Granite's vocabularies, which the tool-call parsers read
# (`ft.core.toolcall_lists`), and Gemma 4's call, string and thought-channel markers
# (`ft.core.toolcall_gemma4`, `ft.core.reasoning`). Encoding still maps their text to the one
# token.
TEXT_MARKERS = (
    "<|tool_call|>", "<|/tool_call|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>",
)  # fmt: skip


def tokenizer_json_of(tok: Tokenizer) -> str:
    """Serialize, checking that it round-trips; `TEXT_MARKERS` among its added tokens are made
    non-special, so that decoding with `skip_special_tokens` keeps them."""
    text = tok.to_str()
    data = json.loads(text)
    added = data.get("added_tokens") or []
    markers = [t for t in added if t.get("content") in TEXT_MARKERS and t.get("special")]
    if not markers:
        return text
    for token in markers:
        token["special"] = False
    return json.dumps(data, ensure_ascii=False)


def special_token_text(tokens: list[str], token_id: Any) -> str | None:
    """The text of `token_id` in `tokens`, or None when absent or out of range."""
    if isinstance(token_id, int) and 0 <= token_id < len(tokens):
        return tokens[token_id]
    return None
