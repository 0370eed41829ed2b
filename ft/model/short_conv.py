"""LFM2's short convolution mixer: a gated causal depthwise convolution over a few positions.

    B, C, x = in_proj(h)            # [T, hidden] each
    y = conv(B * x)                 # causal, depthwise, kernel `ShortConvConfig.kernel` (LFM2: 3)
    out = out_proj(C * y)

The convolution reads each channel's last `kernel` inputs, so a sequence's whole past is the
last `kernel - 1` values of `B * x` per channel: the state, `[hidden, kernel - 1]`. A prefill
span is one `conv1d` over its rows after its state (zeros for a fresh sequence); the decode
spans of a step (one row each) are one batched multiply-add over their windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ft.model.llama import LlamaConfig
from ft.model.recurrent import StateSpan


@dataclass(frozen=True, slots=True)
class ShortConvConfig:
    """A short convolution's settings (`LlamaConfig.mixer_config` of LFM2): its kernel
    (`conv_L_cache`) and whether its projections and convolution have biases (`conv_bias`)."""

    kernel: int
    bias: bool = False

    def __post_init__(self) -> None:
        if self.kernel < 1:
            raise ValueError(f"a short convolution needs a kernel of at least 1, got {self.kernel}")


class ShortConv(nn.Module):
    """The mixer of LFM2's "conv" layers (`ft.model.recurrent.RecurrentMixer`); weights named
    as Hugging Face's `Lfm2ShortConv` (`in_proj`, `conv`, `out_proj`)."""

    def __init__(self, config: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        settings = config.mixer_config
        if not isinstance(settings, ShortConvConfig):
            raise ValueError(
                f"layer {index}: a short convolution's settings are not a ShortConvConfig: {settings!r:.80}"
            )
        hidden, kernel, bias = config.hidden_size, settings.kernel, settings.bias
        self.hidden, self.kernel = hidden, kernel
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias)  # weight [hidden, 1, kernel]
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The last `kernel - 1` inputs of each channel."""
        return ((self.hidden, self.kernel - 1),)

    def forward(
        self, x: torch.Tensor, spans: Sequence[StateSpan], states: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """`x` `[T, hidden]` (normed) → `[T, hidden]`, and each span's state after its last row."""
        (slots,) = states  # [num_state_slots, hidden, kernel - 1], float32
        b, c, v = self.in_proj(x).chunk(3, dim=-1)  # [T, hidden] each
        bx = b * v  # [T, hidden]: the convolution's input
        y = torch.empty_like(bx)
        new: list[tuple[torch.Tensor, ...] | None] = [None] * len(spans)
        singles = [i for i, span in enumerate(spans) if span.num_rows == 1]
        if singles:
            windows = self._decode(bx, y, [spans[i] for i in singles], slots)  # [N, hidden, kernel - 1]
            for i, window in zip(singles, windows, strict=True):
                new[i] = (window,)
        for i, span in enumerate(spans):
            if span.num_rows > 1:
                new[i] = (self._prefill(bx, y, span, slots),)
        out: torch.Tensor = self.out_proj(c * y)
        return out, [state for state in new if state is not None]

    def _past(self, slots: torch.Tensor, span: StateSpan, dtype: torch.dtype) -> torch.Tensor:
        """The span's state `[hidden, kernel - 1]` in `dtype` (zeros for a fresh sequence)."""
        if span.fresh:
            return torch.zeros(self.hidden, self.kernel - 1, dtype=dtype, device=slots.device)
        return slots[span.slot].to(dtype)

    def _prefill(
        self, bx: torch.Tensor, y: torch.Tensor, span: StateSpan, slots: torch.Tensor
    ) -> torch.Tensor:
        """One span's rows through one `conv1d` after its state; returns its new state."""
        rows = slice(span.row_start, span.row_start + span.num_rows)
        full = torch.cat([self._past(slots, span, bx.dtype), bx[rows].T], dim=-1)  # [hidden, k - 1 + n]
        out = F.conv1d(full[None], self.conv.weight, self.conv.bias, groups=self.hidden)[0]  # [hidden, n]
        y[rows] = out.T
        return full[:, full.shape[-1] - (self.kernel - 1) :]

    def _decode(
        self, bx: torch.Tensor, y: torch.Tensor, spans: list[StateSpan], slots: torch.Tensor
    ) -> torch.Tensor:
        """The one-row spans together: each window (state, then its row) times the kernel;
        returns their new states `[N, hidden, kernel - 1]`."""
        rows = torch.tensor([s.row_start for s in spans], device=bx.device)
        past = slots[torch.tensor([s.slot for s in spans], device=slots.device)].to(bx.dtype)  # [N, h, k-1]
        fresh = torch.tensor([s.fresh for s in spans], device=bx.device)
        past = past.masked_fill(fresh[:, None, None], 0.0)
        window = torch.cat([past, bx[rows][:, :, None]], dim=-1)  # [N, hidden, kernel]
        out = (window * self.conv.weight[:, 0, :]).sum(-1)  # [N, hidden]
        if self.conv.bias is not None:
            out = out + self.conv.bias
        y[rows] = out
        return window[:, :, 1:]
