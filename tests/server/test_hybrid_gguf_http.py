"""`ft serve --model F.gguf` of hybrid GGUFs written by llama.cpp's own converter, over real HTTP.

Tiny random Qwen3.5, Qwen3.5-MoE, Qwen3-Next, LFM2 and Granite 4.0-H checkpoints
(`tests.support.tiny_hybrids`) are converted by the real `convert_hf_to_gguf.py` (skipped saying
how to get it when it is not there) to float32, and three of them to Q8_0; each file is served
(`ft.model.gguf_hybrid`: read back into the checkpoint's form, on the float path) and
`/v1/completions`' greedy tokens and their log-probabilities (top 5 each step) match
transformers' on the same weights: the checkpoint itself for the float32 file, the Q8_0 file's
dequantized weights (read back, saved as a checkpoint) for the Q8_0 one.
"""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest
import torch

from ft.config import EngineConfig
from ft.model.gguf_hybrid import load_hybrid_gguf
from tests.support.llama_converter import HOW_TO_GET, Conversion, convert, find_converter
from tests.support.server import running_server
from tests.support.tiny_hybrids import HYBRIDS, build_hybrid, save_hybrid

transformers = pytest.importorskip("transformers")

PROMPT = [5, 70, 100, 33, 200, 17, 90, 140, 61, 12]
STEPS = 12
TOLERANCE = 2e-3  # nats; float32 on both sides agrees to about 1e-5


FAMILIES = ("qwen35", "qwen35moe", "qwen3next", "lfm2", "granite")
QUANTIZED = ("qwen35", "lfm2", "granite")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Each family's checkpoint (`lfm2`, `granite`) and GGUFs (`lfm2.f32`, `lfm2.q8_0`, ...)."""
    converter = find_converter()
    if converter is None:
        pytest.skip(HOW_TO_GET)
    root = tmp_path_factory.mktemp("hybrid-gguf")
    out: dict[str, pathlib.Path] = {}
    jobs = []
    for name in FAMILIES:
        out[name] = save_hybrid(root / f"tiny-{name}", build_hybrid(HYBRIDS[name]))
        for outtype in ("f32", "q8_0") if name in QUANTIZED else ("f32",):
            out[f"{name}.{outtype}"] = root / f"tiny-{name}-{outtype}.gguf"
            jobs.append(Conversion(out[name], out[f"{name}.{outtype}"], "qwen2", outtype, HYBRIDS[name].args))
    convert(converter, jobs)
    return out


def reference(checkpoint: pathlib.Path) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `PROMPT` and the log-probabilities `[STEPS, vocab]`
    before each."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = list(PROMPT)
    steps = []
    with torch.inference_mode():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            steps.append(torch.log_softmax(logits.float(), dim=-1))
            ids.append(int(logits.argmax()))
    return ids[len(PROMPT) :], torch.stack(steps)


def dequantized_checkpoint(gguf: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """`gguf`'s weights as ft reads them back, saved as a checkpoint transformers loads."""
    from safetensors.torch import save_file

    cfg, sd, _ = load_hybrid_gguf(gguf)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize(
    ("name", "outtype"), [*((n, "f32") for n in FAMILIES), *((n, "q8_0") for n in QUANTIZED)]
)
async def test_a_served_hybrid_gguf_answers_as_transformers(
    name: str, outtype: str, files: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    gguf = files[f"{name}.{outtype}"]
    checkpoint = dequantized_checkpoint(gguf, tmp_path / "q8_0") if outtype == "q8_0" else files[name]
    tokens, expected = reference(checkpoint)
    config = EngineConfig(model=str(gguf), dtype="float32", compute_threads=1, kv_cache_memory=4 << 20)
    body = {"prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "logprobs": 5, "ignore_eos": True}
    async with running_server(config) as s, httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        detokenized = {i: s.engine.detokenize([i]) for i in range(expected.shape[1])}
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [detokenized[t] for t in tokens]
    chosen = [expected[step, t].item() for step, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"], chosen, strict=True)) < TOLERANCE
    for step, top in enumerate(logprobs["top_logprobs"]):
        for text, value in top.items():  # a text several byte tokens share is one of theirs
            candidates = [expected[step, i].item() for i, t in detokenized.items() if t == text]
            assert min(abs(value - v) for v in candidates) < TOLERANCE, (step, text)
