"""Weights kept as GGUF stores them: blocks of packed integers with their scales.

A `QuantTensor` is a 2-D weight `[rows, cols]` whose rows are `row_bytes` bytes of blocks of one
GGML type (F16 and BF16 as rows of 2-byte floats). The kernels in `kernels.cpp` multiply the
`KERNEL_TYPES` directly (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS); a weight of any other type (IQ1/IQ2/IQ3, TQ, MXFP4, or an F32 weight in a
quantized model) is requantized to Q8_0 once at load, which keeps it within about 0.5% of its
float value (the loader logs which types it requantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS = 6, 7, 10, 11, 13, 20, 23
F16, BF16 = 1, 30
KERNEL_TYPES = {
    F16: "F16", BF16: "BF16",
    Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K",
    Q5_0: "Q5_0", Q5_1: "Q5_1", Q2_K: "Q2_K", Q3_K: "Q3_K", Q5_K: "Q5_K", IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A `[rows, cols]` weight stored as `data` `[rows, row_bytes]` uint8 blocks of `qtype`.

    `columns` > 0: the bytes reordered into groups of `columns` interleaved rows for the
    column kernels (`kernels.repacked`); `row_bytes` is then a row's share of its group
    (6-bit scales unpacked to bytes: per 256 elements Q4_K 148 bytes instead of 144, Q5_K 180
    instead of 176, IQ4_XS 138 instead of 136).
    """

    data: torch.Tensor
    qtype: int
    cols: int
    columns: int = 0

    @property
    def rows(self) -> int:
        """Output features."""
        return int(self.data.shape[0])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight `[rows, cols]` (tests and fallbacks only)."""
        if self.columns:
            from ft.model.kernels import dequantize_rows

            return dequantize_rows(self, torch.arange(self.rows))
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        array = dequantize(self.data.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).view(self.rows, self.cols)

    def permute_rows(self, order: torch.Tensor) -> QuantTensor:
        """Rows reordered (a rows permutation keeps every block intact)."""
        assert not self.columns, "permute before repacking"
        return QuantTensor(self.data[order].contiguous(), self.qtype, self.cols)


def to_q8_0(weight: np.ndarray) -> QuantTensor:
    """A float weight `[rows, cols]` (cols a multiple of 32) requantized to Q8_0 blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.ascontiguousarray(weight, dtype=np.float32)
    data = quantize(w, GGMLQuantizationType.Q8_0)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(data)), Q8_0, int(w.shape[1]))
