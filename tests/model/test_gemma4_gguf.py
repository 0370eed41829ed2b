"""Gemma 4 GGUFs written by llama.cpp's own converter, against transformers and the safetensors.

The checkpoints are the tiny random Gemma 4 models of `tests.support.tiny_gemma4` (sliding
layers with heads of 16, global ones with heads of 32, a window of 8 under a 45-token prompt in
chunks of 16), each variant converted by the real `convert_hf_to_gguf.py --outtype f32`
(`tests.support.llama_converter`: fetched once into its cache, else the tests skip saying how
to get it) and loaded as `ft serve` loads a `.gguf`: dequantized, on Gemma 4's own float
decoder. float32 logits at the end of each prompt chunk and at every greedy step agree with
transformers' and with the same checkpoint served from its safetensors within `TOLERANCE`; the
top log-probabilities `/v1/completions` returns over real HTTP do too.

The converter writes the KV-sharing layers' count, and llama.cpp has a shared sliding layer read
layer `n - shared - 2`, a shared global one layer `n - shared - 1`: the 3 shared layers here
(two sliding, one global) read layers 1 and 2, as transformers' rule has them. With 2 shared,
those layers are a global then a sliding one, which llama.cpp cannot run (it asserts): the load
refuses that file. A checkpoint without a final soft-cap converts to a file without the key,
which llama.cpp (and so ft) runs capped at 30, and says so in the load log.
"""

from __future__ import annotations

import logging
import pathlib
import re
import struct
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from ft.config import EngineConfig
from ft.model.gemma4_config import Gemma4Config
from ft.model.gguf_file import ModelFileError
from ft.model.loader import load_model
from ft.model.plan import plan, read_header
from tests.support.gguf_files import U32, Edit, RawGGUF, scalar
from tests.support.llama_converter import HOW_TO_GET, Conversion, convert, find_converter
from tests.support.server import running_server
from tests.support.tiny_gemma4 import (
    CHUNK,
    NEW_TOKENS,
    PROMPT,
    VARIANTS,
    chunked_then_greedy,
    gemma4_model,
    gemma4_multimodal_model,
    reference,
    runner_of,
    save_gemma4_dir,
)

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # float32 logits on every side (measured at most 2e-5)
LOGPROB_TOLERANCE = 1e-3  # the served top log-probabilities (nats)
KV_SHARED = {"num_kv_shared_layers": 3, "use_double_wide_mlp": True}  # llama.cpp's sources: layers 1, 2
EVERYTHING = VARIANTS["ple"] | VARIANTS["k_eq_v"] | VARIANTS["moe"] | KV_SHARED


@dataclass(frozen=True)
class Case:
    """A checkpoint to convert: the tiny base's overrides, whether it is the multimodal class,
    the GGUF weight type, and the overrides of the checkpoint llama.cpp runs the file as (None:
    the same)."""

    overrides: dict[str, Any]
    multimodal: bool = False
    outtype: str = "f32"
    runs_as: dict[str, Any] | None = None

    def model(self, runs_as: bool = False) -> Any:
        """The checkpoint (with `runs_as`: the one llama.cpp runs its GGUF as)."""
        fields_ = self.overrides | ((self.runs_as or {}) if runs_as else {})
        return gemma4_multimodal_model(**fields_) if self.multimodal else gemma4_model(**fields_)


CASES = {
    "dense": Case({}),
    "ple": Case(VARIANTS["ple"]),
    "k_eq_v": Case(VARIANTS["k_eq_v"]),
    "kv_shared": Case(KV_SHARED),
    "moe": Case(VARIANTS["moe"]),
    "multimodal": Case(VARIANTS["ple"] | KV_SHARED, multimodal=True),
    "q8_0": Case(EVERYTHING, outtype="q8_0"),
    "no_softcap": Case({"final_logit_softcapping": None}, runs_as={"final_logit_softcapping": 30.0}),
    "kv_shared_2": Case(VARIANTS["kv_shared"]),  # (sources llama.cpp cannot run)
}
MATCHING = ("dense", "ple", "k_eq_v", "kv_shared", "moe", "multimodal")


@dataclass(frozen=True)
class Converted:
    """A case's checkpoint directory and the GGUF the converter wrote from it."""

    checkpoint: pathlib.Path
    gguf: pathlib.Path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Converted]:
    """Every case converted by llama.cpp's converter (in one process)."""
    converter = find_converter()
    if converter is None:
        pytest.skip(HOW_TO_GET)
    root = tmp_path_factory.mktemp("gemma4-gguf")
    out, jobs = {}, []
    for name, case in CASES.items():
        checkpoint = save_gemma4_dir(root / f"tiny-gemma4-{name.replace('_', '-')}", case.model())
        out[name] = Converted(checkpoint, root / f"{name}.gguf")
        jobs.append(Conversion(checkpoint, out[name].gguf, "gemma4", case.outtype))
    convert(converter, jobs)
    return out


def max_diff(got: list[torch.Tensor], want: list[torch.Tensor] | torch.Tensor) -> float:
    """The largest absolute difference between two runs' logits, step by step."""
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


LAYER_FIELDS = (
    "sliding_layers", "sliding_window", "layer_head_dims", "layer_kv_heads", "kv_sources", "k_eq_v",
    "per_layer_input_size", "per_layer_vocab_size", "double_wide_mlp", "intermediate_size", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "final_softcap", "tie_word_embeddings", "vocab_size",
)  # fmt: skip


@pytest.mark.parametrize("name", MATCHING)
def test_gguf_logits_match_the_safetensors_and_transformers(
    name: str, converted: dict[str, Converted]
) -> None:
    prompt_logits, expected_tokens, expected_steps = reference(CASES[name].model())
    from_gguf, from_safetensors = (
        load_model(converted[name].gguf, torch.float32),
        load_model(converted[name].checkpoint, torch.float32),
    )
    assert isinstance(from_gguf.config, Gemma4Config) and isinstance(from_safetensors.config, Gemma4Config)
    for field in LAYER_FIELDS:  # the file says the same layers
        assert getattr(from_gguf.config, field) == getattr(from_safetensors.config, field), field
    chunks, tokens, steps = chunked_then_greedy(runner_of(from_gguf))
    _, _, safetensors_steps = chunked_then_greedy(runner_of(from_safetensors))
    ends = [min(start + CHUNK, len(PROMPT)) - 1 for start in range(0, len(PROMPT), CHUNK)]
    print(f"{name}: max |d logit| {max_diff(steps, expected_steps):.3g} against transformers")
    assert max_diff(chunks, [prompt_logits[end] for end in ends]) < TOLERANCE
    assert tokens == expected_tokens
    assert max_diff(steps, expected_steps) < TOLERANCE
    assert max_diff(steps, safetensors_steps) < TOLERANCE


def test_a_q8_0_file_runs_its_own_weights_exactly_and_the_checkpoint_within_their_rounding(
    converted: dict[str, Converted],
) -> None:
    """Every block of the converter's Q8_0 is 32 int8 times an fp16 scale: each weight within
    1/200 of its tensor's largest (half a step of 1/127, the scale's fp16 rounding included).
    transformers on those dequantized weights is what ft computes from the file; against the
    float checkpoint the logits move with the rounding (this random model amplifies it)."""
    loaded = load_model(converted["q8_0"].gguf, torch.float32)
    raw = RawGGUF.read(converted["q8_0"].gguf)
    assert sum(t.kind == 8 for t in raw.tensors) >= 30  # Q8_0: attention, MLP, experts, PLE gates
    model = CASES["q8_0"].model()
    original = model.state_dict()
    for name, weight in loaded.state_dict.items():
        assert isinstance(weight, torch.Tensor)
        scale = original[name].abs().max().item()
        assert (weight - original[name]).abs().max().item() <= scale / 200, name
    _, _, float_steps = reference(model)
    missing, unexpected = model.load_state_dict(dict(loaded.state_dict), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # (tied to the embedding)
    _, expected_tokens, expected_steps = reference(model)
    _, tokens, steps = chunked_then_greedy(runner_of(loaded))
    assert tokens == expected_tokens and max_diff(steps, expected_steps) < TOLERANCE
    spread = max((s.max() - s.min()).item() for s in float_steps)
    moved = max_diff(steps, float_steps) / spread
    print(f"q8_0: max |d logit| against the float checkpoint {moved:.3g} of the logits' spread")
    assert 0 < moved < 0.25


def test_a_setting_the_converter_drops_runs_as_llama_cpp_runs_it_and_is_logged(
    converted: dict[str, Converted], caplog: pytest.LogCaptureFixture
) -> None:
    case = CASES["no_softcap"]
    with caplog.at_level(logging.INFO, logger="ft.model"):
        loaded = load_model(converted["no_softcap"].gguf, torch.float32)
    (said,) = [r for r in caplog.records if "'final_logit_softcapping'" in r.getMessage()]
    assert "soft-capped at 30" in said.getMessage() and said.levelno == logging.INFO
    _, _, steps = chunked_then_greedy(runner_of(loaded))
    _, _, as_llama_cpp = reference(case.model(runs_as=True))
    assert max_diff(steps, as_llama_cpp) < TOLERANCE
    _, _, as_trained = reference(case.model())
    print(f"no_softcap: max |d logit| against the checkpoint as it was {max_diff(steps, as_trained):.3g}")
    assert max_diff(steps, as_trained) > 10 * TOLERANCE


def test_a_file_with_its_soft_cap_logs_only_what_no_gemma4_gguf_says(
    converted: dict[str, Converted], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ft.model"):
        load_model(converted["dense"].gguf, torch.float32)
    said = [r for r in caplog.records if "converter does not write" in r.getMessage()]
    named = {m.group(1) for r in said if (m := re.search(r"checkpoint's '([^']+)'", r.getMessage()))}
    rotaries = {"rope_parameters.full_attention.factor", "rope_parameters.sliding_attention"}
    assert named == {"hidden_activation", *rotaries}
    assert all(r.levelno == logging.INFO for r in said)


def test_kv_sharing_llama_cpp_cannot_run_is_refused(converted: dict[str, Converted]) -> None:
    message = r"shared_kv_layers.*2 \(sliding\) and 3 \(global\).*are global and sliding"
    with pytest.raises(ModelFileError, match=message):
        load_model(converted["kv_shared_2"].gguf, torch.float32)


def test_the_vocabulary_tokenizes_as_the_checkpoints_tokenizer(converted: dict[str, Converted]) -> None:
    """The converter writes Gemma 4's tokenizer as `gemma4`: its tokens, merges and token types."""
    spec = load_model(converted["dense"].gguf, torch.float32).tokenizer
    assert spec.add_bos_token and spec.bos_token == "<bos>" and spec.chat_template is not None
    ours = Tokenizer.from_str(spec.tokenizer_json)
    theirs = Tokenizer.from_file(str(converted["dense"].checkpoint / "tokenizer.json"))
    for text in ("Hello you\n\nthe model", "  the   user ", "héllo, wörld!? 🙂", "<bos>hi<eos>\n"):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text


async def test_served_top_logprobs_over_http_match_transformers(converted: dict[str, Converted]) -> None:
    _, tokens, steps = reference(CASES["kv_shared"].model())
    expected = torch.log_softmax(steps.float(), dim=-1)
    config = EngineConfig(model=str(converted["kv_shared"].gguf), dtype="float32", num_pages=64)
    body = {
        "prompt": list(PROMPT),
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": 5,
        "ignore_eos": True,
    }
    async with running_server(config) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        detokenized = {i: s.engine.detokenize([i]) for i in range(expected.shape[1])}
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [detokenized[t] for t in tokens]
    for step, top in enumerate(logprobs["top_logprobs"]):
        for text, value in top.items():  # a text several byte tokens share is one of theirs
            candidates = [expected[step, i].item() for i, t in detokenized.items() if t == text]
            assert min(abs(value - v) for v in candidates) < LOGPROB_TOLERANCE, (step, text)
    chosen = [expected[step, t].item() for step, t in enumerate(tokens)]
    errors = [abs(a - b) for a, b in zip(logprobs["token_logprobs"], chosen, strict=True)]
    assert max(errors) < LOGPROB_TOLERANCE


def _u32(key: str, value: int) -> Edit:
    return lambda raw: raw.set(key, U32, scalar(U32, value))


def _renamed(old: str, new: str) -> Edit:
    def edit(raw: RawGGUF) -> RawGGUF:
        out = raw.copy()
        out.tensors = [replace(t, name=new) if t.name == old else t for t in out.tensors]
        return out

    return edit


HOSTILE = {
    "more heads than projected": (_u32("gemma4.attention.head_count", 8), r"blk\.0\.attn_q\.weight"),
    "no heads": (_u32("gemma4.attention.head_count", 0), r"'gemma4\.attention\.head_count'"),
    "a layer more": (_u32("gemma4.block_count", 7), r"sliding_window_pattern': expected 7 booleans"),
    "a layer less": (_u32("gemma4.block_count", 5), r"sliding_window_pattern': expected 5 booleans"),
    "a billion layers": (_u32("gemma4.block_count", 1 << 30), r"'gemma4\.block_count'"),
    "kv heads that do not divide": (_u32("gemma4.attention.head_count_kv", 3), r"do not divide"),
    "every layer sharing": (_u32("gemma4.attention.shared_kv_layers", 6), r"shared_kv_layers"),
    "an odd head": (_u32("gemma4.attention.key_length_swa", 15), r"key_length_swa'.*odd"),
    "a partial rotary": (_u32("gemma4.rope.dimension_count", 16), r"rope\.dimension_count'.*not supported"),
    "per-layer embeddings not there": (
        _u32("gemma4.embedding_length_per_layer_input", 8),
        r"per_layer_token_embd\.weight is missing",
    ),
    "rope factors of another head": (
        lambda raw: raw.retensor("rope_freqs.weight", dims=(8,)),
        r"rope_freqs\.weight: expected shape \[16\]",
    ),
    "a missing value projection": (
        _renamed("blk.0.attn_v.weight", "blk.0.attn_w.weight"),
        r"blk\.0\.attn_v\.weight is missing",
    ),
}


@pytest.mark.parametrize("lie", HOSTILE)
def test_metadata_that_lies_is_refused_naming_the_key_or_tensor(
    lie: str, converted: dict[str, Converted], tmp_path: pathlib.Path
) -> None:
    edit, message = HOSTILE[lie]
    raw = RawGGUF.read(converted["dense"].gguf)
    assert struct.unpack("<I", raw.get("gemma4.attention.head_count").payload)[0] == 4  # type: ignore[union-attr]
    edit(raw).write(tmp_path / "lying.gguf")
    with pytest.raises(ModelFileError, match=message):
        load_model(tmp_path / "lying.gguf", torch.float32)


def test_the_plan_runs_a_quantized_file_dequantized_on_the_float_path(
    converted: dict[str, Converted],
) -> None:
    """The packed kernels run Llama's decoder only: a Q8_0 Gemma 4 runs as floats, said why."""
    header = read_header(converted["q8_0"].gguf)
    assert isinstance(header.config, Gemma4Config) and header.is_quantized
    chosen = plan(EngineConfig(model=str(converted["q8_0"].gguf)), header)
    assert not chosen.packed
    assert any("packed kernels do not run gemma4" in reason for reason in chosen.reasons)
