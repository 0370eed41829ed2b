"""Qwen3.5's gated attention and norms (`ft.model.qwen35`) against transformers.

transformers' layer (random weights, eager attention, its multimodal rotary over text
positions) runs a whole sequence; ft's `GatedAttention` over the paged KV cache must give the
same outputs in float32 whether the sequence comes as one prefill or as a chunk followed by
decode rows batched with another sequence's. The norms' stored weights are centred on zero and
scaled by 1 + w: a module that scaled by w would fail. Last, the pieces (with the Gated
DeltaNet mixer) put together as transformers' decoder layers give `Qwen3_5ForCausalLM`'s logits.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ft.model.attention import SeqSpan, build_metadata
from ft.model.deltanet import hf_weights
from ft.model.llama import rope_cos_sin, rope_inv_freq
from ft.model.qwen35 import (
    GatedAttention,
    OffsetRMSNorm,
    attention_config,
    deltanet_from_hf,
    hf_attention_weights,
    layer_types,
)
from ft.model.recurrent import StateSpan
from tests.support.tiny_qwen35 import HIDDEN, attention_layer, randomize, text_config

transformers = pytest.importorskip("transformers")

PAGE = 4
LENGTH = 21


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    """Equal within `tolerance` of the expected values' scale."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * scale)


@functools.cache
def _layers() -> tuple[Any, Any, GatedAttention]:
    hf_config, hf = attention_layer()
    attn = GatedAttention(attention_config(hf_config.to_dict()))
    attn.load_state_dict(hf_attention_weights(hf.state_dict(), ""), strict=True)
    return hf_config, hf, attn.eval()


def _sequence(seed: int) -> torch.Tensor:
    return torch.randn(LENGTH, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _reference(seed: int) -> torch.Tensor:
    """transformers' output over the whole sequence, with its own rotary and a causal mask."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    hf_config, hf, _ = _layers()
    x = _sequence(seed)[None]
    positions = torch.arange(LENGTH)[None]
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        rotary = Qwen3_5TextRotaryEmbedding(hf_config)(x, positions)
        out: torch.Tensor = hf(x, position_embeddings=rotary, attention_mask=mask)[0][0]
    return out


def _run(
    attn: GatedAttention,
    caches: tuple[torch.Tensor, torch.Tensor],
    parts: list[tuple[torch.Tensor, int, tuple[int, ...]]],  # (rows, start position, pages)
) -> list[torch.Tensor]:
    """One step over `parts` through the paged cache → each part's output rows."""
    spans = [SeqSpan(start, rows.shape[0], pages) for rows, start, pages in parts]
    positions = torch.cat([torch.arange(s.start_pos, s.start_pos + s.num_tokens) for s in spans])
    cos, sin = rope_cos_sin(rope_inv_freq(attn.config), positions, torch.float32)
    with torch.no_grad():
        out = attn(torch.cat([r for r, _, _ in parts]), cos, sin, *caches, build_metadata(spans, PAGE))
    return list(out.split([s.num_tokens for s in spans]))


def _caches(attn: GatedAttention) -> tuple[torch.Tensor, torch.Tensor]:
    c = attn.config
    return torch.zeros(64 * PAGE, c.num_kv_heads, c.head_dim), torch.zeros(
        64 * PAGE, c.num_kv_heads, c.head_dim
    )


def test_config_turns_a_quarter_of_each_head() -> None:
    hf_config, _, attn = _layers()
    c = attn.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_width) == (4, 2, 32, 8)
    assert layer_types({"text_config": hf_config.to_dict()}) == ("linear_attention",) * 3 + (
        "full_attention",
    )


def test_one_prefill_matches_transformers() -> None:
    _, _, attn = _layers()
    (out,) = _run(attn, _caches(attn), [(_sequence(0), 0, tuple(range(6)))])
    _close(out, _reference(0))


def test_prefill_then_batched_decodes_match_transformers() -> None:
    _, _, attn = _layers()
    caches = _caches(attn)
    a, b = _sequence(0), _sequence(1)
    pages_a, pages_b = tuple(range(10, 16)), tuple(range(20, 26))
    first = _run(attn, caches, [(a[:13], 0, pages_a), (b[:9], 0, pages_b)])
    outs_a, outs_b = [first[0]], [first[1]]
    for pos in range(13, 16):  # both decode
        step = _run(
            attn, caches, [(a[pos : pos + 1], pos, pages_a), (b[pos - 4 : pos - 3], pos - 4, pages_b)]
        )
        outs_a.append(step[0])
        outs_b.append(step[1])
    # a decodes beside b's last chunk, then alone
    step = _run(attn, caches, [(a[16:17], 16, pages_a), (b[12:], 12, pages_b)])
    outs_a.append(step[0])
    outs_b.append(step[1])
    for pos in range(17, LENGTH):
        outs_a += _run(attn, caches, [(a[pos : pos + 1], pos, pages_a)])
    _close(torch.cat(outs_a), _reference(0))
    _close(torch.cat(outs_b), _reference(1))


def test_offset_norm_keeps_bfloat16_weights_exact() -> None:
    norm = OffsetRMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.full((8,), 1e-3))
    x = torch.randn(3, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * 1.001
    low = norm.to(torch.bfloat16)
    torch.testing.assert_close(low(x.bfloat16()).float(), expected, rtol=1e-2, atol=1e-2)
    assert float(low.weight.detach()[0]) != 0.0  # 1 + 1e-3 would have been 1 in bfloat16


def _composed_logits(cfg: dict[str, Any], sd: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """ft's mixers and norms stacked as transformers' `Qwen3_5DecoderLayer`s, one prefill."""
    length = ids.shape[0]
    config = attention_config(cfg)

    def norm(name: str) -> OffsetRMSNorm:
        n = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        n.load_state_dict({"weight": sd[name]})
        return n

    cos, sin = rope_cos_sin(rope_inv_freq(config), torch.arange(length), torch.float32)
    meta = build_metadata([SeqSpan(0, length, tuple(range(-(-length // PAGE))))], PAGE)
    x = sd["model.embed_tokens.weight"][ids]
    for i, kind in enumerate(layer_types(cfg)):
        p = f"model.layers.{i}."
        h = norm(p + "input_layernorm.weight")(x)
        if kind == "linear_attention":
            mixer = deltanet_from_hf(cfg)
            mixer.load_state_dict(hf_weights(mixer.config, sd, p + "linear_attn."))
            slots = [torch.zeros(1, *shape) for shape in mixer.state_shapes()]
            h, _ = mixer(h, [StateSpan(0, 0, length, True)], slots)
        else:
            attn = GatedAttention(config)
            attn.load_state_dict(hf_attention_weights(sd, p + "self_attn."))
            h = attn(h, cos, sin, *_caches(attn), meta)
        x = x + h
        h = norm(p + "post_attention_layernorm.weight")(x)
        gate, up = (h @ sd[p + f"mlp.{name}_proj.weight"].T for name in ("gate", "up"))
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return norm("model.norm.weight")(x) @ sd["lm_head.weight"].T


def test_pieces_stacked_give_transformers_logits() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    hf_config = text_config()
    model = randomize(Qwen3_5ForCausalLM(hf_config), seed=5)
    ids = torch.randint(0, hf_config.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
        got = _composed_logits(hf_config.to_dict(), model.state_dict(), ids)
    # NOTE: through four layers float32 rounding grows: both this and transformers' logits are
    # 1.3e-4 (3e-5 of their scale) away from the same stack run in float64
    _close(got, expected, tolerance=1e-4)
