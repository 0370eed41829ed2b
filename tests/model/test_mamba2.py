"""Mamba-2's mixer against transformers' Granite 4.0-H mamba layer (float32, random weights).

The slot tensors here are written by the test from the states each call returns, as the runner
writes them once a step has succeeded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig
from transformers.cache_utils import DynamicCache
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

from ft.model.mamba2 import MAX_CHUNK_SIZE, Mamba2Config, Mamba2Mixer, mamba2_weights_from_hf
from ft.model.recurrent import StateSpan

HIDDEN = 64
NUM_SLOTS = 6
TOL = {"rtol": 1e-5, "atol": 2e-5}


class Pair(NamedTuple):
    theirs: GraniteMoeHybridMambaLayer
    ours: Mamba2Mixer
    hf_config: Any


@functools.cache
def _pair(num_groups: int, num_heads: int = 8, chunk_size: int = 8, **extra: Any) -> Pair:
    """transformers' mamba layer with every parameter randomized, and the mixer loaded from it."""
    torch.manual_seed(1000 + 10 * num_groups + num_heads)
    hf_config = AutoConfig.for_model(
        "granitemoehybrid",
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=4,
        vocab_size=128,
        intermediate_size=32,
        shared_intermediate_size=32,
        mamba_n_heads=num_heads,
        mamba_d_state=16,
        mamba_n_groups=num_groups,
        mamba_chunk_size=chunk_size,
        mamba_expand=2,
        **extra,
    )
    theirs = GraniteMoeHybridMambaLayer(hf_config, 0).eval()
    with torch.no_grad():
        # Decays from nearly none to fast (A in [-6, -0.02]), time steps around 0.1-1.
        theirs.A_log.copy_(torch.empty(num_heads).uniform_(math.log(0.02), math.log(6.0)))
        theirs.dt_bias.copy_(torch.randn(num_heads) * 0.7 - 1.0)
        theirs.D.copy_(torch.randn(num_heads))
        theirs.norm.weight.copy_(1.0 + 0.3 * torch.randn_like(theirs.norm.weight))
        theirs.conv1d.weight.mul_(3.0)
    ours = Mamba2Mixer(Mamba2Config.from_hf(hf_config.to_dict()))
    ours.load_state_dict(mamba2_weights_from_hf(theirs.state_dict(), ""), strict=True)
    return Pair(theirs, ours, hf_config)


def _slots(mixer: Mamba2Mixer, fill: float = 0.0) -> list[torch.Tensor]:
    return [torch.full((NUM_SLOTS, *shape), fill) for shape in mixer.state_shapes()]


def _run(
    mixer: Mamba2Mixer, x: torch.Tensor, spans: Sequence[StateSpan], slots: list[torch.Tensor]
) -> torch.Tensor:
    """One step: the mixer's output, its returned states written into `slots` afterwards."""
    before = [t.clone() for t in slots]
    with torch.no_grad():
        out, new_states = mixer(x, spans, slots)
    for t, b in zip(slots, before, strict=True):
        assert torch.equal(t, b) or torch.isnan(b).any(), "the mixer wrote a slot"
    assert len(new_states) == len(spans)
    for span, states in zip(spans, new_states, strict=True):
        for t, s in zip(slots, states, strict=True):
            t[span.slot] = s
    return out


def _reference(pair: Pair, x: torch.Tensor, cuts: Sequence[int] = ()) -> tuple[torch.Tensor, DynamicCache]:
    """transformers' outputs for one sequence `x` `[n, hidden]` run in calls split at `cuts`."""
    cache = DynamicCache(config=pair.hf_config)
    bounds = [0, *cuts, len(x)]
    outs = []
    with torch.no_grad():
        for a, b in zip(bounds, bounds[1:], strict=False):
            outs.append(pair.theirs(x[None, a:b], cache=cache)[0])
    return torch.cat(outs), cache


def _inputs(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _whole(num_groups: int, n: int, seed: int) -> torch.Tensor:
    """transformers' output for `_inputs(n, seed)` in one call."""
    with torch.no_grad():
        return _pair(num_groups).theirs(_inputs(n, seed)[None])[0]


@pytest.mark.parametrize("num_groups", [1, 2])
def test_fresh_span_of_several_chunks_matches_transformers(num_groups: int) -> None:
    pair = _pair(num_groups)
    x = _inputs(29, 1)  # 4 chunks of 8, the last partial
    with torch.no_grad():
        expected = pair.theirs(x[None])[0]
    got = _run(pair.ours, x, [StateSpan(slot=3, row_start=0, num_rows=29, fresh=True)], _slots(pair.ours))
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunk_size_changes_only_the_rounding(chunk_size: int) -> None:
    pair = _pair(2)
    x = _inputs(29, 1)
    other = Mamba2Mixer(dataclasses.replace(pair.ours.config, chunk_size=chunk_size))
    other.load_state_dict(pair.ours.state_dict())
    got = _run(other, x, [StateSpan(slot=0, row_start=0, num_rows=29, fresh=True)], _slots(other))
    torch.testing.assert_close(got, _whole(2, 29, 1), **TOL)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_sequence_split_across_calls_matches_one_call(num_groups: int) -> None:
    pair = _pair(num_groups)
    x = _inputs(40, 2)
    expected, _ = _reference(pair, x)
    slots = _slots(pair.ours)
    # One-row calls take the decode path; a 2-row call is shorter than the conv's past.
    bounds = [0, 1, 3, 12, 13, 14, 16, 31, 40]
    outs = [
        _run(pair.ours, x[a:b], [StateSpan(slot=4, row_start=0, num_rows=b - a, fresh=a == 0)], slots)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    torch.testing.assert_close(torch.cat(outs), expected, **TOL)


@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=33), max_size=6, unique=True).map(sorted))
def test_any_split_of_a_sequence_matches_one_call(cuts: list[int]) -> None:
    pair = _pair(2)
    x = _inputs(34, 3)
    expected = _whole(2, 34, 3)
    slots = _slots(pair.ours)
    bounds = [0, *cuts, len(x)]
    outs = [
        _run(pair.ours, x[a:b], [StateSpan(slot=1, row_start=0, num_rows=b - a, fresh=a == 0)], slots)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    torch.testing.assert_close(torch.cat(outs), expected, **TOL)


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("listed_in_row_order", [True, False])
def test_one_call_of_several_sequences_matches_each_alone(num_groups: int, listed_in_row_order: bool) -> None:
    """Prefills, continuations and decodes of five sequences in one step, in mixed order and
    slots, each against transformers running that sequence alone with its cache: the outputs
    and the states the step returns."""
    pair = _pair(num_groups, num_heads=4)
    histories = {0: _inputs(9, 10), 1: _inputs(5, 11), 5: _inputs(17, 12)}  # slot -> earlier rows
    slots = _slots(pair.ours)
    for slot, past in histories.items():
        _run(pair.ours, past, [StateSpan(slot=slot, row_start=0, num_rows=len(past), fresh=True)], slots)

    new = {0: _inputs(1, 20), 3: _inputs(11, 21), 1: _inputs(10, 22), 5: _inputs(1, 23), 2: _inputs(1, 24)}
    order = [0, 3, 1, 5, 2]  # decode, fresh prefill, continuation, decode, fresh single row
    spans, start = [], 0
    for slot in order:
        spans.append(
            StateSpan(slot=slot, row_start=start, num_rows=len(new[slot]), fresh=slot not in histories)
        )
        start += len(new[slot])
    listed = spans if listed_in_row_order else spans[::-1]
    got = _run(pair.ours, torch.cat([new[s] for s in order]), listed, slots)

    for span in spans:
        past = histories.get(span.slot, torch.empty(0, HIDDEN))
        full = torch.cat([past, new[span.slot]])
        expected, cache = _reference(pair, full, [len(past)] if len(past) else [])
        rows = slice(span.row_start, span.row_start + span.num_rows)
        torch.testing.assert_close(got[rows], expected[len(past) :], **TOL)
        torch.testing.assert_close(slots[0][span.slot], cache.get_conv_state(0)[0, :, 1:].T, **TOL)
        torch.testing.assert_close(slots[1][span.slot], cache.get_recurrent_state(0)[0], **TOL)


def test_fresh_span_ignores_what_its_slot_holds() -> None:
    pair = _pair(2)
    x = _inputs(13, 4)
    clean = _run(pair.ours, x, [StateSpan(0, 0, 12, True), StateSpan(1, 12, 1, True)], _slots(pair.ours))
    stale = _slots(pair.ours, fill=float("nan"))
    got = _run(pair.ours, x, [StateSpan(0, 0, 12, True), StateSpan(1, 12, 1, True)], stale)
    assert torch.equal(got, clean)
    assert all(torch.isfinite(t[:2]).all() for t in stale)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_states_match_transformers_cache(num_groups: int) -> None:
    pair = _pair(num_groups)
    x = _inputs(22, 5)
    slots = _slots(pair.ours)
    _run(pair.ours, x[:21], [StateSpan(2, 0, 21, True)], slots)
    _run(pair.ours, x[21:], [StateSpan(2, 0, 1, False)], slots)
    _, cache = _reference(pair, x, [21])
    conv, ssm = slots
    # transformers keeps the conv's last k inputs channel-major; the mixer the last k-1 by time.
    torch.testing.assert_close(conv[2], cache.get_conv_state(0)[0, :, 1:].T, **TOL)
    torch.testing.assert_close(ssm[2], cache.get_recurrent_state(0)[0], **TOL)


def test_time_step_limit_clamps_in_every_path() -> None:
    """A finite limit changes the output, and a split run (decode rows included) still equals
    transformers' chunked scan of the whole sequence."""
    pair = _pair(2, time_step_limit=(0.2, 0.6))
    x = _inputs(20, 6)
    with torch.no_grad():
        expected = pair.theirs(x[None])[0]
    slots = _slots(pair.ours)
    bounds = [0, 7, 8, 9, 20]
    outs = [
        _run(pair.ours, x[a:b], [StateSpan(0, 0, b - a, a == 0)], slots)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    torch.testing.assert_close(torch.cat(outs), expected, **TOL)
    unclamped = _pair(2)
    with torch.no_grad():
        assert not torch.allclose(unclamped.theirs(x[None])[0], expected, atol=1e-3)


def test_config_from_granite_4_h_config_json() -> None:
    """granite-4.0-h-tiny's shapes: the states, and the chunk capped."""
    config = Mamba2Config.from_hf(
        {
            "model_type": "granitemoehybrid",
            "hidden_size": 1536,
            "mamba_n_heads": 48,
            "mamba_d_head": 64,
            "mamba_d_state": 128,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 256,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "rms_norm_eps": 1e-5,
        }
    )
    with torch.device("meta"):
        mixer = Mamba2Mixer(config)
    assert mixer.state_shapes() == ((3, 3072 + 2 * 128), (48, 64, 128))
    assert config.chunk_size == MAX_CHUNK_SIZE
    assert (config.time_step_min, config.time_step_max) == (0.0, math.inf)
    with pytest.raises(ValueError, match="num_groups"):
        Mamba2Config.from_hf({"hidden_size": 64, "mamba_n_heads": 4, "mamba_n_groups": 3})
