"""A sequence classifier's head: what turns a reranker's pooled hidden state into its scores.

Hugging Face `LlamaForSequenceClassification` / `Qwen3ForSequenceClassification` hold it as
`score.weight` `[num_labels, hidden]` (no bias), applied to the last token's hidden state after
the final norm. A GGUF holds llama.cpp's names: an optional dense layer `cls.weight`
`[hidden, hidden]` (+ `cls.bias`) followed by tanh, then `cls.output.weight` `[num_labels, width]`
(+ `cls.output.bias`); for Qwen3 llama.cpp softmaxes the outputs (its converter writes the
lm_head's `yes` and `no` rows of Qwen3-Reranker as the two labels), and so does `ClassifierHead`.

The loaders take these tensors out of the state dict (`pop_head`), so the decoder never sees
them; the runner applies the head to each rank-pooling work's last row (`TorchRunner._pool`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HF_NAMES = ("score.weight", "score.bias")
GGUF_NAMES = ("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias")


@dataclass(frozen=True)
class ClassifierHead:
    """`[dense + tanh] -> out [+ bias] [-> softmax]`, in float64 (a handful of rows a step)."""

    out_weight: torch.Tensor  # [num_labels, width]
    out_bias: torch.Tensor | None = None  # [num_labels]
    dense_weight: torch.Tensor | None = None  # [width, hidden]
    dense_bias: torch.Tensor | None = None  # [width]
    softmax: bool = False

    @property
    def num_labels(self) -> int:
        """Outputs per pooled row."""
        return int(self.out_weight.shape[0])

    def to(self, device: torch.device) -> ClassifierHead:
        """The same head, its tensors on `device` in float64."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=torch.float64)

        out = move(self.out_weight)
        assert out is not None
        dense, dense_bias = move(self.dense_weight), move(self.dense_bias)
        return ClassifierHead(out, move(self.out_bias), dense, dense_bias, self.softmax)

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """Scores `[N, num_labels]` of pooled hidden states `[N, hidden]`."""
        x = pooled.to(self.out_weight.dtype)
        if self.dense_weight is not None:
            x = x @ self.dense_weight.T  # [N, width]
            if self.dense_bias is not None:
                x = x + self.dense_bias
            x = torch.tanh(x)
        x = x @ self.out_weight.T  # [N, num_labels]
        if self.out_bias is not None:
            x = x + self.out_bias
        return torch.softmax(x, dim=-1) if self.softmax else x


def pop_head(
    sd: dict[str, torch.Tensor], hidden_size: int, *, softmax: bool = False
) -> ClassifierHead | None:
    """Take the classifier tensors (either naming) out of `sd`; their head, or None if absent.

    Raises:
        ValueError: a tensor's shape does not fit the hidden size or the others, naming it (the
            GGUF loader checks a file's shapes first, against its metadata, with the same names).
    """
    names: tuple[str, str, str | None, str | None]
    if "score.weight" in sd:
        names = ("score.weight", "score.bias", None, None)
    elif "cls.output.weight" in sd:
        names = ("cls.output.weight", "cls.output.bias", "cls.weight", "cls.bias")
    else:
        return None
    out, out_bias, dense, dense_bias = (sd.pop(n, None) if n else None for n in names)
    assert out is not None
    width = hidden_size
    if dense is not None:
        width = _rows(dense, str(names[2]), hidden_size)
        if dense_bias is not None:
            _check(dense_bias, str(names[3]), (width,))
    num_labels = _rows(out, str(names[0]), width)
    if out_bias is not None:
        _check(out_bias, str(names[1]), (num_labels,))
    return ClassifierHead(out.float(), _float(out_bias), _float(dense), _float(dense_bias), softmax)


def _rows(t: torch.Tensor, name: str, width: int) -> int:
    """The rows of 2-D `t` `[rows, width]` (at least one)."""
    if t.ndim != 2 or t.shape[1] != width or t.shape[0] < 1:
        raise ValueError(f"tensor {name}: expected shape [labels, {width}], found {list(t.shape)}")
    return int(t.shape[0])


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _check(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"tensor {name}: expected shape {list(shape)}, found {list(t.shape)}")
