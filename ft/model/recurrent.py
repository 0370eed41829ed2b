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

from ft.core.batch import SeqWork, StateCopy


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


class StateTensors:
    """A runner's recurrent states: per recurrent layer, one `[num_slots, *shape]` float32 tensor
    per state shape (`RecurrentMixer.state_shapes`), made resident only where written on the CPU.

    `copy` runs a batch's `StateCopy`s; `spans` turns a step's works into the mixers' spans;
    `write` stores the states a step returned (the runner calls it once the step succeeded).
    """

    def __init__(
        self, shapes: Sequence[tuple[tuple[int, ...], ...]], num_slots: int, device: torch.device
    ) -> None:
        from ft.model.torch_runner import lazy_zeros

        if num_slots < 1:
            raise ValueError("a model with recurrent layers needs at least one state slot")

        def zeros(shape: tuple[int, ...]) -> torch.Tensor:
            if device.type == "cpu":
                return lazy_zeros((num_slots, *shape), torch.float32)
            return torch.zeros((num_slots, *shape), dtype=torch.float32, device=device)

        self.num_slots = num_slots
        self.layers = [tuple(zeros(shape) for shape in layer) for layer in shapes]

    @property
    def slot_bytes(self) -> int:
        """The bytes of one slot over every layer."""
        return sum(t[0].numel() * t.element_size() for layer in self.layers for t in layer)

    def copy(self, copies: Sequence[StateCopy]) -> None:
        """Copy each `src` slot into its `dst`, in order, in every layer.

        Raises:
            ValueError: a slot out of range (nothing is copied).
        """
        for c in copies:
            if not (0 <= c.src < self.num_slots and 0 <= c.dst < self.num_slots):
                raise ValueError(f"state copy {c.src} -> {c.dst} is outside the {self.num_slots} slots")
        for c in copies:
            for layer in self.layers:
                for t in layer:
                    t[c.dst].copy_(t[c.src])

    @staticmethod
    def spans(works: Sequence[SeqWork]) -> list[StateSpan]:
        """Each work's rows of the step, in order (a work at position 0 starts fresh)."""
        out, row = [], 0
        for w in works:
            out.append(StateSpan(w.state_slot, row, len(w.token_ids), w.start_pos == 0))
            row += len(w.token_ids)
        return out

    def write(self, spans: Sequence[StateSpan], new: Sequence[Sequence[tuple[torch.Tensor, ...]]]) -> None:
        """Store `new` (per layer, per span, the mixer's returned states) into the spans' slots."""
        if not spans:
            return
        first = self.layers[0][0] if self.layers and self.layers[0] else None
        device = first.device if first is not None else torch.device("cpu")
        slots = torch.tensor([s.slot for s in spans], device=device)
        for layer, per_span in zip(self.layers, new, strict=True):
            for k, t in enumerate(layer):
                t.index_copy_(0, slots, torch.stack([states[k] for states in per_span]).to(t.dtype))
