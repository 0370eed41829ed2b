"""Gated DeltaNet (`ft.model.deltanet`) against transformers' layer, in float32.

transformers' `Qwen3_5GatedDeltaNet` (and `Qwen3NextGatedDeltaNet`, whose projections are fused
and grouped by key head) with random weights runs each whole sequence in one call; ft's mixer
must give the same outputs (1e-5 of their scale) however the sequence is cut into steps — whole,
split at arbitrary points, decode rows batched with other sequences' prefill spans — with each
step's returned states written into the slot tensors between steps, as the runner does. The
slots start full of noise, so a fresh span that read them would fail.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.model.deltanet import DeltaNetConfig, GatedDeltaNet, hf_weights
from ft.model.recurrent import StateSpan
from tests.support.tiny_qwen35 import HIDDEN, deltanet_layer

transformers = pytest.importorskip("transformers")

LENGTH = 150  # three chunks of 64, the last one partial
NUM_SLOTS = 5


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within 1e-5 of the expected values' scale (float32 sums in another order)."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@functools.cache
def _layers(model_type: str = "qwen3_5", **overrides: Any) -> tuple[Any, Any, GatedDeltaNet]:
    """transformers' text config, its layer, and ft's mixer holding the layer's weights."""
    hf_config, hf = deltanet_layer(model_type, **overrides)
    config = DeltaNetConfig.from_hf(hf_config.to_dict())
    mixer = GatedDeltaNet(config)
    mixer.load_state_dict(hf_weights(config, hf.state_dict(), ""), strict=True)
    return hf_config, hf, mixer.eval()


@functools.cache
def _sequence(seed: int, length: int = LENGTH) -> torch.Tensor:
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _reference(seed: int, model_type: str = "qwen3_5") -> torch.Tensor:
    """transformers' output over the whole sequence `seed`, `[LENGTH, hidden]`."""
    _, hf, _ = _layers(model_type)
    with torch.no_grad():
        out: torch.Tensor = hf(_sequence(seed)[None])[0]
    return out


def _noisy_slots(mixer: GatedDeltaNet, seed: int = 99) -> list[torch.Tensor]:
    """The layer's slot tensors, filled with noise (what other sequences left there)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_SLOTS, *shape, generator=gen) for shape in mixer.state_shapes()]


def _step(
    mixer: GatedDeltaNet,
    slots: list[torch.Tensor],
    parts: Sequence[tuple[torch.Tensor, int, bool]],  # (rows, slot, fresh) per sequence
) -> list[torch.Tensor]:
    """One step over `parts` in one call; writes the returned states into `slots` (as the
    runner does once the step succeeded) and returns each part's output rows."""
    spans, row = [], 0
    for rows, slot, fresh in parts:
        spans.append(StateSpan(slot=slot, row_start=row, num_rows=rows.shape[0], fresh=fresh))
        row += rows.shape[0]
    with torch.no_grad():
        out, states = mixer(torch.cat([rows for rows, _, _ in parts]), spans, slots)
    assert len(states) == len(spans)
    for span, new in zip(spans, states, strict=True):
        for tensor, value in zip(slots, new, strict=True):
            assert value.shape == tensor.shape[1:] and value.dtype == torch.float32
            tensor[span.slot] = value
    return [out[s.row_start : s.row_start + s.num_rows] for s in spans]


def _run_split(mixer: GatedDeltaNet, x: torch.Tensor, cuts: Sequence[int], slot: int = 2) -> torch.Tensor:
    """`x` fed in consecutive steps cut at `cuts`, its state carried through slot `slot`."""
    slots = _noisy_slots(mixer)
    bounds = [0, *sorted(set(cuts) - {0, x.shape[0]}), x.shape[0]]
    outs = [_step(mixer, slots, [(x[a:b], slot, a == 0)])[0] for a, b in itertools.pairwise(bounds)]
    return torch.cat(outs)


def test_state_shapes_follow_the_config() -> None:
    _, _, mixer = _layers()
    # conv channels q | k | v: 2 * 2 * 16 + 4 * 32; matrices per value head [dk, dv]
    assert mixer.state_shapes() == ((3, 192), (4, 16, 32))


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_one_fresh_span_matches_transformers(model_type: str) -> None:
    _, _, mixer = _layers(model_type)
    (out,) = _step(mixer, _noisy_slots(mixer), [(_sequence(0), 1, True)])
    _close(out, _reference(0, model_type))


def test_equal_key_and_value_heads_match_transformers() -> None:
    _, hf, mixer = _layers(linear_num_value_heads=2, linear_value_head_dim=16)
    x = _sequence(3, 70)
    with torch.no_grad():
        expected = hf(x[None])[0]
    (out,) = _step(mixer, _noisy_slots(mixer), [(x, 0, True)])
    _close(out, expected)


def test_final_state_is_transformers_cache_state() -> None:
    hf_config, hf, mixer = _layers()
    cache = transformers.DynamicCache(config=hf_config)
    with torch.no_grad():
        hf(_sequence(0)[None], cache=cache)
    slots = _noisy_slots(mixer)
    _step(mixer, slots, [(_sequence(0), 4, True)])
    layer = cache.layers[0]
    hf_conv = layer.conv_states[0][0]  # [conv_dim, kernel]: one input more than the next token needs
    _close(slots[0][4], hf_conv[:, 1:].T)
    _close(slots[1][4], layer.recurrent_states[0][0])


def test_split_steps_match_one_call() -> None:
    _, _, mixer = _layers()
    # decode rows at the start and in the middle, spans shorter than the conv, a chunk boundary
    out = _run_split(mixer, _sequence(0), [1, 2, 4, 64, 70, 71, 72, 140])
    _close(out, _reference(0))


def test_decoding_every_token_matches_one_call() -> None:
    _, _, mixer = _layers()
    out = _run_split(mixer, _sequence(1), range(1, LENGTH))
    _close(out, _reference(1))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=LENGTH - 1), max_size=8))
def test_any_split_matches_one_call(cuts: list[int]) -> None:
    _, _, mixer = _layers()
    _close(_run_split(mixer, _sequence(2), cuts), _reference(2))


def test_mixed_step_of_several_sequences_matches_each_alone() -> None:
    _, _, mixer = _layers()
    slots = _noisy_slots(mixer)
    a, b, c, d = (_sequence(seed) for seed in range(4))
    # before: b and d have their first rows in slots 0 and 3
    first = _step(mixer, slots, [(b[:30], 0, True), (d[:65], 3, True)])
    # the step: a's prompt (fresh, slot 4), b decodes, c's one-token prompt (fresh, slot 2, noise
    # there), d's next chunk, b's neighbour
    parts = [(a[:40], 4, True), (b[30:31], 0, False), (c[:1], 2, True), (d[65:140], 3, False)]
    step = _step(mixer, slots, parts)
    # after: c and b decode together, then a
    last = _step(mixer, slots, [(c[1:2], 2, False), (b[31:32], 0, False), (a[40:], 4, False)])
    _close(step[0], _reference(0)[:40])
    _close(torch.cat([first[0], step[1], last[1]]), _reference(1)[:32])
    _close(torch.cat([step[2], last[0]]), _reference(2)[:2])
    _close(torch.cat([first[1], step[3]]), _reference(3)[:140])
    _close(last[2], _reference(0)[40:])


def test_batched_decode_equals_one_sequence_at_a_time() -> None:
    _, _, mixer = _layers()
    slots = _noisy_slots(mixer)
    seqs = [_sequence(seed, 20) for seed in range(NUM_SLOTS)]
    _step(mixer, slots, [(s[:19], i, True) for i, s in enumerate(seqs)])
    saved = [t.clone() for t in slots]
    together = _step(mixer, slots, [(s[19:], i, False) for i, s in enumerate(seqs)])
    for i, s in enumerate(seqs):
        alone = _step(mixer, [t.clone() for t in saved], [(s[19:], i, False)])
        _close(together[i], alone[0])


def test_fresh_span_ignores_what_the_slot_held() -> None:
    _, _, mixer = _layers()
    outs = []
    for noise in (1, 2):
        slots = _noisy_slots(mixer, seed=noise)
        outs.append(_step(mixer, slots, [(_sequence(0)[:1], 1, True), (_sequence(0)[:9], 2, True)]))
    for one, other in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(one, other, rtol=0, atol=0)


def test_mixer_never_writes_the_slots() -> None:
    _, _, mixer = _layers()
    slots = _noisy_slots(mixer)
    before = [t.clone() for t in slots]
    spans = [StateSpan(0, 0, 1, False), StateSpan(1, 1, 1, True), StateSpan(3, 2, 70, False)]
    with torch.no_grad():
        mixer(_sequence(0)[:72], spans, slots)
    for tensor, old in zip(slots, before, strict=True):
        assert torch.equal(tensor, old)


def test_bfloat16_activations_stay_near_float32() -> None:
    _, _, mixer = _layers()
    x = _sequence(0)
    low = GatedDeltaNet(mixer.config)
    low.load_state_dict(mixer.state_dict())
    low = low.to(torch.bfloat16)
    slots = _noisy_slots(mixer)
    with torch.no_grad():
        out, states = low(x.bfloat16(), [StateSpan(0, 0, LENGTH, True)], slots)
    assert out.dtype == torch.bfloat16 and states[0][1].dtype == torch.float32
    scale = float(_reference(0).abs().max())
    assert float((out.float() - _reference(0)).abs().max()) < 0.05 * scale


def test_config_from_hf_reads_the_text_config() -> None:
    hf_config, _, _ = _layers()
    nested = {"model_type": "qwen3_5", "text_config": hf_config.to_dict()}
    assert DeltaNetConfig.from_hf(nested) == DeltaNetConfig(
        hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32
    )
    with pytest.raises(ValueError, match="multiple"):
        DeltaNetConfig(hidden_size=64, num_k_heads=3, num_v_heads=4, head_k_dim=16, head_v_dim=16)
