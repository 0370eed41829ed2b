"""The contract of a recurrent mixer: a layer that carries per-sequence state from step to step.

A hybrid model (Qwen3.5's Gated DeltaNet, LFM2's short convolutions, Granite 4.0-H's Mamba-2)
has attention layers, whose past lives in KV pages, and recurrent layers, whose whole past is a
fixed-size state per sequence: DeltaNet's matrix state, a convolution's last k-1 inputs, Mamba's
SSM and convolution states. The runner holds each recurrent layer's states as tensors of
`[num_state_slots, *shape]` (float32: the recurrences are summed in float32 whatever the
activations' dtype), and `SeqWork.state_slot` says which slot is a sequence's.

A mixer never writes a slot. It reads the spans' states, and returns the states after each
span's last row; the runner writes them back once the whole step has succeeded, so a step that
raises leaves every slot as it was and rerunning its works alone is exact (`SeqWork.state_slot`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class StateSpan:
    """One sequence's rows in a step: rows `[row_start, row_start + num_rows)` of the flat batch
    (in order of position), its state in slot `slot`; `fresh`: the span starts the sequence
    (position 0), so its state starts from zeros whatever the slot holds."""

    slot: int
    row_start: int
    num_rows: int
    fresh: bool


class RecurrentMixer(Protocol):
    """A recurrent layer's mixer (the part that replaces attention; the norms, residual and MLP
    around it are the decoder layer's)."""

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each of this layer's state tensors for one sequence."""
        ...

    def forward(
        self, x: torch.Tensor, spans: Sequence[StateSpan], states: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """`x` `[T, hidden]` (after the layer's input norm) → the mixer's output `[T, hidden]`,
        and for each span, in order, its state tensors after its last row. `states` are this
        layer's slot tensors, `[num_state_slots, *shape]` each, read only."""
        ...
