"""Grammar helpers for tests: a byte-tokenizer llguidance tokenizer and a tiny constrained model."""

from __future__ import annotations

import pathlib
from dataclasses import asdict

import cbor2
import torch

from ft.core.batch import SeqWork
from ft.engine.fake import byte_tokenizer_spec
from ft.grammar.compiled import LLMatcher, Matcher, compile_matcher, grammar_text, grammar_tokenizer
from ft.grammar.spec import GrammarSpec
from ft.model.loader import LoadedModel
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.tiny_model import random_hf_state_dict, tiny_config

BYTE_VOCAB = 259  # the fake byte tokenizer: 3 specials + 256 bytes
EOS = byte_tokenizer_spec().eos_token_ids


def byte_matcher(spec: GrammarSpec) -> LLMatcher:
    """`spec` compiled for the byte tokenizer (llguidance's matcher: a template)."""
    s = byte_tokenizer_spec()
    tokenizer = grammar_tokenizer(s.tokenizer_json, BYTE_VOCAB, s.eos_token_ids)
    return compile_matcher(grammar_text(spec), tokenizer, BYTE_VOCAB)


def byte_seq_matcher(spec: GrammarSpec) -> Matcher:
    """`spec` compiled for the byte tokenizer, as a sequence's matcher (what a `SeqWork` carries)."""
    return Matcher(byte_matcher(spec))


def write_byte_spec(directory: pathlib.Path) -> str:
    """The byte tokenizer's spec as the engine writes it for workers (CBOR); its path."""
    path = directory / "tokenizer.cbor"
    path.write_bytes(cbor2.dumps(asdict(byte_tokenizer_spec())))
    return str(path)


def byte_runner(seed: int = 0, num_pages: int = 64) -> TorchRunner:
    """A tiny random float32 model over the byte tokenizer's vocabulary."""
    config = tiny_config(vocab_size=BYTE_VOCAB)
    loaded = LoadedModel(
        config, dict(random_hf_state_dict(config, seed)), byte_tokenizer_spec(), "tiny", torch.float32
    )
    return build_runner(loaded, num_pages=num_pages, page_size=16, dtype=torch.float32)


def generate(
    runner: TorchRunner, matchers: list[Matcher | None], params: list[SamplingParams], max_tokens: int
) -> list[tuple[list[int], bool]]:
    """Decode one sequence per matcher in one batch; each: (tokens before EOS, ended by EOS)."""
    prompt = (byte_tokenizer_spec().eos_token_ids[0] + 1, 60, 61)
    out: list[list[int]] = [[] for _ in matchers]
    done = [False] * len(matchers)
    fed = [prompt for _ in matchers]
    pos = [0] * len(matchers)
    for _ in range(max_tokens):
        live = [i for i in range(len(matchers)) if not done[i]]
        if not live:
            break
        works = [
            SeqWork(i, fed[i], pos[i], tuple(range(i * 16, i * 16 + 16)), True, params[i], len(out[i]),
                    matcher=matchers[i])
            for i in live
        ]  # fmt: skip
        for i, s in zip(live, runner.step(works), strict=True):
            pos[i] += len(fed[i])
            if s.token_id in EOS:
                done[i] = True
            else:
                out[i].append(s.token_id)
                fed[i] = (s.token_id,)
    return [(tokens, ended) for tokens, ended in zip(out, done, strict=True)]


def text_of(tokens: list[int]) -> str:
    """The byte tokenizer's text of `tokens` (no specials)."""
    return bytes(t - 3 for t in tokens).decode("utf-8", errors="replace")
