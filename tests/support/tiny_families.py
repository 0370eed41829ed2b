"""Tiny random Phi-3, SmolLM3 and Granite models, built by transformers itself, saved as
safetensors and as GGUFs with llama.cpp's names.

Each model is transformers' own `*ForCausalLM` from a small config (hidden 128, 4 heads / 2 kv
heads of 32, 4 layers) with every weight random (norms around 1), saved with `save_pretrained`.
The GGUF holds the same weights as llama.cpp's converter writes them: `phi3` with the fused
`attn_qkv` and `ffn_up` (gate | up) as stored, its rotary width, `original_context_length`,
`attn_factor` and the longrope factors as the tensors `rope_factors_long` / `rope_factors_short`;
`smollm3` and `granite` with their q/k rows permuted into rotary pairs (`LlamaModel.permute`),
Granite's four multipliers as `granite.embedding_scale`, `granite.residual_scale`,
`granite.attention.scale` and `granite.logit_scale`. Projections and embedding Q8_0, norms F32.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import numpy as np
import torch
import trio
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from ft.core.batch import SeqWork
from ft.model.cuda_graphs import GraphedRunner
from ft.model.loader import LoadedModel, load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.tokenizer.spec import byte_level_bpe_from_gguf
from tests.support.chat_templates import TEMPLATES
from tests.support.gguf_files import tiny_tokens
from tests.support.tiny_qwen3 import GREEDY, PAGES, generate

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 128, 4, 2, 256, 4
HEAD_DIM = HIDDEN // HEADS
EOS = "<|im_end|>"
PHI_ORIGINAL_CONTEXT = 32  # shorter than the tests' prompt, so transformers takes the long factors
PHI_ROTARY = int(HEAD_DIM * 0.75)  # Phi-4-mini's partial_rotary_factor

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: gate | up in one
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _common(**overrides: Any) -> dict[str, Any]:
    tokens, _, _ = tiny_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=tokens.index(EOS), pad_token_id=0,
        bos_token_id=None,
    )  # fmt: skip
    fields.update(overrides)
    return fields


def _randomized(model: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def phi3_model(seed: int = 0, **overrides: Any) -> Any:
    """A random `Phi3ForCausalLM`: Phi-4-mini's partial rotary (0.75) and longrope (random short
    and long factors, a trained context of `PHI_ORIGINAL_CONTEXT`, stretched to 512)."""
    import transformers

    rng = np.random.default_rng(seed + 1)
    pairs = PHI_ROTARY // 2
    scaling = {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in 1 + rng.random(pairs)],
        "long_factor": [float(f) for f in 1 + 4 * rng.random(pairs)],
    }
    fields = _common(
        original_max_position_embeddings=PHI_ORIGINAL_CONTEXT, rope_scaling=scaling,
        partial_rotary_factor=0.75, rope_theta=10000.0,
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    return _randomized(transformers.Phi3ForCausalLM(transformers.Phi3Config(**fields)), seed)


def smollm3_model(seed: int = 0, **overrides: Any) -> Any:
    """A random `SmolLM3ForCausalLM`: layer 3 (every fourth) without rotary, tied embeddings."""
    import transformers

    fields = _common(rope_theta=2_000_000.0, tie_word_embeddings=True)
    fields.update(overrides)
    torch.manual_seed(seed)
    return _randomized(transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**fields)), seed)


def granite_model(seed: int = 0, **overrides: Any) -> Any:
    """A random `GraniteForCausalLM` with Granite-3's kinds of multipliers (embedding 12,
    residual 0.22, attention 1/64 instead of 1/sqrt(32), logits divided by 8)."""
    import transformers

    fields = _common(
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        logits_scaling=8.0, rope_theta=10000.0,
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**fields))
    model = _randomized(model, seed)
    with torch.no_grad():  # a smaller embedding, so that 12x it keeps the activations sane
        model.model.embed_tokens.weight.mul_(0.1)
    return model


def save_dir(directory: pathlib.Path, model: Any, template: str | None = None) -> pathlib.Path:
    """`model` as a Hugging Face directory: config.json, safetensors, tokenizer (and template)."""
    tokens, merges, types = tiny_tokens()
    model.save_pretrained(str(directory))
    byte_level_bpe_from_gguf(tokens, merges, types, "llama-bpe").save(str(directory / "tokenizer.json"))
    tcfg: dict[str, Any] = {"eos_token": EOS, "bos_token": None}
    if template is not None:
        tcfg["chat_template"] = TEMPLATES[template]
    (directory / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return directory


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's half-split rows interleaved by rotary pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: Any, permuted: bool) -> dict[str, np.ndarray]:
    """`model`'s weights under llama.cpp's names (q/k rows permuted for `permuted` families)."""
    c = model.config
    out = {}
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if not name.startswith("model.layers."):
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            out[_GLOBAL_NAMES[name]] = data
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if permuted and rest == "self_attn.q_proj.weight":
            data = permute(data, c.num_attention_heads)
        elif permuted and rest == "self_attn.k_proj.weight":
            data = permute(data, c.num_key_value_heads)
        out[f"blk.{layer}." + _LAYER_NAMES[rest]] = data
    return out


def write_gguf(
    path: pathlib.Path,
    model: Any,
    *,
    tensors: dict[str, np.ndarray] | None = None,
    quant: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    template: str | None = None,
) -> pathlib.Path:
    """`model` as llama.cpp's converter writes its family (`tensors` replaces the weights: a
    test's malformed file; `template` names a chat template of `TEMPLATES`). The 2-D weights
    are `quant`, everything else F32."""
    c = model.config
    arch = {"phi3": "phi3", "smollm3": "smollm3", "granite": "granite"}[c.model_type]
    tokens, merges, types = tiny_tokens()
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    extra: dict[str, np.ndarray] = {}
    if arch == "phi3":
        original = rope["original_max_position_embeddings"]
        w.add_rope_dimension_count(
            int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads
        )
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = c.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            )
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    else:
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    if arch == "granite":
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index(EOS))
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template(TEMPLATES[template])
    weights = tensors if tensors is not None else gguf_tensors(model, permuted=arch != "phi3")
    for gguf_name, data in {**extra, **weights}.items():
        if data.ndim >= 2 and quant != GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.asarray(quantize(data, quant)), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- checks every family's tests share ------------------------------------------------------

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
NEW_TOKENS = 8
# Q8_0 weights with int8 activations against the same weights dequantized: a share of the logits'
# spread (max |diff| / spread measured 0.6-1.5% on these models, 9 steps)
PACKED_RELATIVE_TOLERANCE = 0.04


def runner_of(loaded: LoadedModel, **kwargs: Any) -> TorchRunner:
    """A float32 runner of 32 pages of 4."""
    return build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32, **kwargs)


def forced_logits(runner: TorchRunner, prompt: tuple[int, ...], forced: list[int]) -> list[torch.Tensor]:
    """Each step's logits `[vocab]` when the tokens after `prompt` are `forced`."""
    out = []
    logits = runner.forward([SeqWork(0, prompt, 0, PAGES, True, GREEDY, 0)])
    for i, token in enumerate([*forced, None]):
        assert logits is not None
        out.append(logits[0])
        if token is not None:
            logits = runner.forward([SeqWork(0, (token,), len(prompt) + i, PAGES, True, GREEDY, i + 1)])
    return out


def packed_error(gguf: pathlib.Path, kv_dtype: Any, reference: LoadedModel | None = None) -> float:
    """The packed path's largest logit error against the float path (fed the float path's
    greedy tokens), as a share of each step's logit spread; asserts its greedy choice is never
    more than twice the tolerance behind the float path's (random weights leave near-ties).
    `reference`: the float model to compare with (default: the same GGUF dequantized)."""
    reference = reference or load_model(gguf, torch.float32)
    float_tokens, _ = generate(runner_of(reference), PROMPT, NEW_TOKENS)
    packed = runner_of(load_model(gguf, torch.float32, quantized=True), kv_dtype=kv_dtype)
    assert packed.packed is not None
    worst = 0.0
    steps = zip(
        forced_logits(runner_of(reference), PROMPT, float_tokens),
        forced_logits(packed, PROMPT, float_tokens),
        strict=True,
    )
    for step, (want, got) in enumerate(steps):
        spread = (want.max() - want.min()).item()
        worst = max(worst, (got - want).abs().max().item() / spread)
        lead = (want.max() - want[int(got.argmax())]).item()
        assert lead <= 2 * PACKED_RELATIVE_TOLERANCE * spread, f"step {step}: a token {lead:.3g} behind"
    return worst


async def engine_greedy(model: pathlib.Path, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy tokens of `model` served by a whole engine (`ft serve`'s loading and runner)."""
    from ft.config import EngineConfig
    from ft.engine.engine import open_engine
    from ft.params import SamplingParams
    from ft.prompt import PromptSpec

    config = EngineConfig(model=str(model), compute_threads=1, kv_cache_memory=4 << 20)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with trio.fail_after(300):
        async with open_engine(config) as engine:
            async with engine.open_request(PromptSpec(token_ids=prompt), params=params) as stream:
                (choice,) = await stream.collect()
    return list(choice.token_ids)


def assert_cuda_graphs_give_the_cpu_tokens(directory: pathlib.Path) -> None:
    """float32 on the GPU (SDPA, decode graphs with the family's blocks inside) against the CPU."""
    loaded = load_model(directory, torch.float32)
    gpu = runner_of(loaded, device=torch.device("cuda"))
    tokens_gpu, logits_gpu = generate(gpu, PROMPT, NEW_TOKENS)
    tokens_cpu, logits_cpu = generate(runner_of(loaded), PROMPT, NEW_TOKENS)
    assert isinstance(gpu, GraphedRunner) and gpu.graphs.num_captured >= 1
    assert tokens_gpu == tokens_cpu
    assert (logits_gpu.cpu() - logits_cpu).abs().max().item() < 1e-3
