"""`tokenizer.ggml.pre` picks how text is cut before BPE merges: a GGUF of Phi-4-mini's
(`gpt-4o`) and of Granite 3.x's (`refact`, StarCoder's digits-then-GPT-2 split) gives the ids of
the `tokenizers` library running the same vocabulary under the pre-tokenizer those models'
own `tokenizer.json` declare.

The vocabulary is trained here with no split at all, so its merges cross every boundary a
pre-tokenizer draws (digit runs, a contraction and its word, case changes, spaces before a
newline): a wrong split gives other ids on the adversarial strings below, which is checked too.
"""

from __future__ import annotations

import json
import logging
import pathlib

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ft.model.gguf_file import GGUFFile
from ft.model.gguf_loader import gguf_tokenizer

ADVERSARIAL = [
    "1234567 and 12345678901, 3.14159; 2026-12-02 12:30",
    "I'M don't WE'LL you're She'S it'd THEY'VE",
    "camelCaseWord HTTPServer getHTTPResponseCode iPhone XMLHttpRequest",
    "line one\n\n\nline two  \n   indented\r\n\ttab\t\tend   ",
    "emoji 🙂🚀 1️⃣ 👩‍💻 and ½ ² ٣",
    "中文字符 日本語のテキスト 한국어 mixed中文English123",
    "Ünïcödé naïve café — Ωmega ΣΑΣ straße",
    "def f(x):\n    return x**2 + 10  # comment\nif a/b>=c: print(f'{a!r}')\n",
    'path/to/file.py: https://example.com/a/b?c=1&d=22 <tag attr="v"/>',
    "    \n\n  12  \n 3 ",
]

# The pre-tokenizers of the models' own tokenizer.json, as published.
PHI4_MINI_PRE = {
    "type": "Sequence",
    "pretokenizers": [
        {
            "type": "Split",
            "pattern": {
                "Regex": (
                    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
                    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                )
            },
            "behavior": "Removed",
            "invert": True,
        },
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
GRANITE_PRE = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
CASES = {"gpt-4o": PHI4_MINI_PRE, "refact": GRANITE_PRE, "smollm": GRANITE_PRE}


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    """A byte-level BPE of 800 tokens learned over the adversarial strings without any split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(ADVERSARIAL * 4, trainer)
    return tok


def _vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _oracle(trained: Tokenizer, pre_tokenizer: dict[str, object]) -> Tokenizer:
    data = json.loads(trained.to_str())
    data["pre_tokenizer"] = pre_tokenizer
    data["decoder"] = json.loads(Tokenizer(models.BPE()).to_str())["decoder"]
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.ByteLevel()
    return tok


def _gguf_tokenizer(path: pathlib.Path, trained: Tokenizer, pre: str | None) -> Tokenizer:
    tokens, merges = _vocab_and_merges(trained)
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_tokenizer(GGUFFile(path), 4096).build()


@pytest.mark.parametrize("pre", sorted(CASES))
def test_ids_match_the_models_own_pre_tokenizer(trained: Tokenizer, tmp_path: pathlib.Path, pre: str) -> None:
    ours = _gguf_tokenizer(tmp_path / f"{pre}.gguf", trained, pre)
    theirs = _oracle(trained, CASES[pre])
    for text in ADVERSARIAL:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text


@pytest.mark.parametrize("pre", sorted(CASES))
def test_gpt2s_split_would_give_other_ids(trained: Tokenizer, tmp_path: pathlib.Path, pre: str) -> None:
    """The vocabulary tells the splits apart: GPT-2's (the fallback) differs on some string."""
    gpt2 = _gguf_tokenizer(tmp_path / "gpt2.gguf", trained, "gpt-2")
    theirs = _oracle(trained, CASES[pre])
    differ = [t for t in ADVERSARIAL if gpt2.encode(t).ids != theirs.encode(t).ids]
    assert len(differ) >= 3, differ


def test_an_unknown_pre_tokenizer_splits_as_gpt2_with_a_warning(
    trained: Tokenizer, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpt2 = _gguf_tokenizer(tmp_path / "gpt2.gguf", trained, "gpt-2")
    with caplog.at_level(logging.WARNING, logger="ft.tokenizer"):
        unknown = _gguf_tokenizer(tmp_path / "unknown.gguf", trained, "some-future-model")
    assert "'some-future-model' is not known to ft" in caplog.text and "gpt-4o" in caplog.text
    for text in ADVERSARIAL:
        assert unknown.encode(text).ids == gpt2.encode(text).ids


def test_a_file_without_the_key_splits_as_gpt2_quietly(
    trained: Tokenizer, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpt2 = _gguf_tokenizer(tmp_path / "gpt2.gguf", trained, "gpt-2")
    with caplog.at_level(logging.WARNING, logger="ft.tokenizer"):
        missing = _gguf_tokenizer(tmp_path / "missing.gguf", trained, None)
    assert not caplog.text
    assert all(missing.encode(t).ids == gpt2.encode(t).ids for t in ADVERSARIAL)
