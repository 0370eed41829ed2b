"""Tool-call markers that a vocabulary marks special (Phi-4-mini's, Granite's `<|tool_call|>`, Gemma
4's call, string and channel markers) stay in decoded text, so the parsers see them; other
special tokens are still skipped."""

from __future__ import annotations

from tokenizers import Tokenizer

from ft.tokenizer.spec import byte_level_bpe_from_gguf, tokenizer_json_of
from tests.support.gguf_files import tiny_tokens

CONTROL = 3


def test_tool_call_markers_survive_skipping_special_tokens() -> None:
    tokens, merges, types = tiny_tokens()
    markers = ["<|tool_call|>", "<|/tool_call|>", "<|end|>"]
    tok = byte_level_bpe_from_gguf([*tokens, *markers], merges, [*types, *[CONTROL] * 3], None)
    served = Tokenizer.from_str(tokenizer_json_of(tok))
    ids = served.encode("<|tool_call|>[1]<|/tool_call|><|end|>", add_special_tokens=False).ids
    assert ids[0] == len(tokens) and ids[-2:] == [len(tokens) + 1, len(tokens) + 2]  # one token each
    assert served.decode(ids, skip_special_tokens=True) == "<|tool_call|>[1]<|/tool_call|>"


def test_a_vocabulary_without_markers_serializes_unchanged() -> None:
    tokens, merges, types = tiny_tokens()
    tok = byte_level_bpe_from_gguf(tokens, merges, types, None)
    assert tokenizer_json_of(tok) == tok.to_str()


def test_gemma4_call_string_and_channel_markers_survive_skipping_special_tokens() -> None:
    """Gemma 4's `<|tool_call>`, `<tool_call|>`, `<|"|>`, `<|channel>` and `<channel|>` stay in
    decoded text (the gemma4 parsers read them); its `<turn|>` is still skipped."""
    tokens, merges, types = tiny_tokens()
    markers = ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>", "<turn|>"]
    tok = byte_level_bpe_from_gguf([*tokens, *markers], merges, [*types, *[CONTROL] * len(markers)], None)
    served = Tokenizer.from_str(tokenizer_json_of(tok))
    text = '<|channel>thought\n<channel|><|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|><turn|>'
    ids = served.encode(text, add_special_tokens=False).ids
    assert {len(tokens) + i for i in range(len(markers))} <= set(ids)  # one token each
    assert served.decode(ids, skip_special_tokens=True) == text.removesuffix("<turn|>")
