"""What the hybrid families' GGUF translations share: llama.cpp's metadata read as a checked
`config.json` would say it, and `Piece`s — Hugging Face tensors made from GGUF tensors.

A family's translation is two functions: its config from the metadata (every number range-
and consistency-checked here, before any size derived from it is used) and its pieces from
that config. Each piece names the GGUF tensors it reads with the shape each must have, so the
whole file is checked against the config — every tensor present, of its shape, nothing else —
before one tensor is dequantized (`build_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ft.model.gguf_file import (
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    GGUFFile,
    GGUFTensor,
    ModelFileError,
)
from ft.model.gguf_loader import dequantized
from ft.model.llama import Progress

Shape = tuple[int, ...]
Config = dict[str, Any]
MAX_CONV_KERNEL = 1 << 10  # a causal conv's taps (real models: 3 or 4)
MAX_STATE = 1 << 12  # a recurrent head's key / state size (real models: 16 to 256)


@dataclass(frozen=True, slots=True)
class Piece:
    """Hugging Face tensors made from GGUF tensors: `sources` the GGUF names with the torch
    shape each must have, `build` the Hugging Face tensors (by name) from their float32 values,
    in that order, undoing what llama.cpp's converter did to them. `mtp`: a multi-token
    prediction layer's (built only when asked for: ft, like transformers, does not run them)."""

    sources: tuple[tuple[str, Shape], ...]
    build: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]
    mtp: bool = False


def same(gguf: str, shape: Shape, hf: str, undo: Callable[[torch.Tensor], torch.Tensor] | None = None,
         *, mtp: bool = False) -> Piece:  # fmt: skip
    """One GGUF tensor as one Hugging Face tensor (`undo` applied)."""
    return Piece(((gguf, shape),), lambda ts: {hf: undo(ts[0]) if undo else ts[0]}, mtp)


def per_expert(gguf: str, shape: Shape, stem: str, projection: str, *, mtp: bool = False) -> Piece:
    """A stack of experts `[experts, rows, cols]` as one `{stem}.{e}.{projection}.weight` each
    (the converter stacked the checkpoint's per-expert tensors)."""
    return Piece(
        ((gguf, shape),),
        lambda ts: {f"{stem}.{e}.{projection}.weight": ts[0][e].clone() for e in range(shape[0])},
        mtp,
    )


def joined(sources: tuple[tuple[str, Shape], ...], hf: str, dim: int) -> Piece:
    """GGUF tensors the converter split out of one Hugging Face tensor, concatenated back."""
    return Piece(sources, lambda ts: {hf: torch.cat(ts, dim=dim)})


def minus_one(t: torch.Tensor) -> torch.Tensor:
    """A `(1 + w)` norm's `w`: the converter stored `w + 1`."""
    return t - 1


def conv_weight(t: torch.Tensor) -> torch.Tensor:
    """A depthwise conv's `[channels, 1, kernel]` weight: the converter squeezed out the 1."""
    return t.unsqueeze(1)


def a_log(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """`A_log` from the converter's `A = -exp(A_log)` (tensor `name`, each value negative)."""

    def undo(a: torch.Tensor) -> torch.Tensor:
        if not bool((a < 0).all()):
            bad = float(a[a >= 0].flatten()[0])
            raise ModelFileError(
                f"tensor {name}: A must be negative (llama.cpp stores -exp(A_log)), found {bad:g}"
            )
        return torch.log(-a)

    return undo


def f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (the 1e-06 a
    checkpoint says, not 9.99999997e-07, its float32 read back as a float64)."""
    return float(str(np.float32(value)))


class Keys:
    """The `{arch}.*` metadata of one GGUF, each value type- and range-checked as it is read."""

    def __init__(self, meta: GGUFFile, arch: str) -> None:
        self.meta, self.arch = meta, arch

    def key(self, name: str) -> str:
        """The full key of `{arch}.name`."""
        return f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        """Whether the file says `{arch}.name`."""
        return self.key(name) in self.meta.fields

    def integer(self, name: str, low: int, high: int, default: int | None = None) -> int:
        """An integer from `low` to `high` (`default` when absent; required if None)."""
        return self.meta.integer(self.key(name), low, high, default)

    def number(self, name: str, low: float, high: float, default: float) -> float:
        """A finite number from `low` to `high` (`default` when absent)."""
        return self.meta.number(self.key(name), low, high, default)

    def flag(self, name: str, default: bool) -> bool:
        """A boolean (`default` when absent)."""
        value = self.meta.get(self.key(name), default)
        if not isinstance(value, bool):
            raise ModelFileError(f"metadata key {self.key(name)!r}: expected a boolean, found {value!r:.80}")
        return value

    def per_layer(self, name: str, low: int, high: int, num_layers: int) -> list[int]:
        """One integer per layer: an array of `num_layers` of them, or one for every layer."""
        value = self.meta.get(self.key(name))
        if not isinstance(value, list):
            return [self.integer(name, low, high)] * num_layers
        if len(value) != num_layers or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ModelFileError(
                f"metadata key {self.key(name)!r}: expected an integer or an array of {num_layers} "
                f"integers (one per layer of {self.key('block_count')!r}), found {len(value)} items"
            )
        bad = next((v for v in value if not low <= v <= high), None)
        if bad is not None:
            raise ModelFileError(
                f"metadata key {self.key(name)!r}: expected integers from {low} to {high}, found {bad}"
            )
        return list(value)

    def flags(self, name: str, num_layers: int) -> list[bool] | None:
        """One boolean per layer (None when absent)."""
        value = self.meta.get(self.key(name))
        if value is None:
            return None
        if (
            not isinstance(value, list)
            or len(value) != num_layers
            or not all(isinstance(v, bool) for v in value)
        ):
            size = f"{len(value)} items" if isinstance(value, list) else f"{value!r:.40}"
            raise ModelFileError(
                f"metadata key {self.key(name)!r}: expected {num_layers} booleans (one per layer of "
                f"{self.key('block_count')!r}), found {size}"
            )
        return list(value)

    def quotient(self, name: str, value: int, divisor: int, what: str) -> int:
        """`value` (the value of key `name`) divided by `divisor` (`what`), which must divide it."""
        if value % divisor:
            raise ModelFileError(
                f"metadata key {self.key(name)!r}: {value} is not a multiple of {what} {divisor}"
            )
        return value // divisor


def common_config(meta: GGUFFile, keys: Keys, num_layers: int) -> Config:
    """What every family's `config.json` says the same way: the embedding's width and rows
    (`token_embd.weight`'s, which `{arch}.vocab_size` must agree with), whether the lm_head is
    the embedding (no `output.weight`), the context, rotary base and epsilon, and the special
    token ids the converter copied from the checkpoint."""
    hidden = keys.integer("embedding_length", 1, MAX_WIDTH)
    embedding = next((t for t in meta.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ModelFileError("tensor token_embd.weight is missing")
    if len(embedding.shape) != 2 or embedding.shape[1] != hidden or not 1 <= embedding.shape[0] <= MAX_VOCAB:
        raise ModelFileError(
            f"tensor token_embd.weight: expected shape [vocab, {hidden}] (from "
            f"{keys.key('embedding_length')!r}, vocab 1 to {MAX_VOCAB}), found {list(embedding.shape)}"
        )
    vocab = embedding.shape[0]
    if keys.has("vocab_size") and keys.integer("vocab_size", 1, MAX_VOCAB) != vocab:
        raise ModelFileError(
            f"metadata key {keys.key('vocab_size')!r}: {keys.integer('vocab_size', 1, MAX_VOCAB)}, but "
            f"token_embd.weight has {vocab} rows"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    num_tokens = len(tokens) if isinstance(tokens, list) else 0
    if not 0 < num_tokens <= vocab:
        raise ModelFileError(
            f"metadata key 'tokenizer.ggml.tokens': {num_tokens} tokens for an embedding of {vocab} rows "
            f"(expected 1 to {vocab})"
        )
    cfg: Config = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "max_position_embeddings": keys.integer("context_length", 1, 1 << 24, default=2048),
        "tie_word_embeddings": all(t.name != "output.weight" for t in meta.tensors),
    }
    for name, hf in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):  # (None: the file has none,
        key = f"tokenizer.ggml.{name}_token_id"  # not the family's default)
        cfg[f"{hf}_token_id"] = meta.integer(key, 0, num_tokens - 1) if key in meta.fields else None
    return cfg


def rope_theta(keys: Keys, default: float = 10000.0) -> float:
    """The rotary base, refusing a rotary scaling these translations do not carry over."""
    scaling = keys.meta.text(keys.key("rope.scaling.type"))
    if scaling not in (None, "none"):
        raise ModelFileError(f"metadata key {keys.key('rope.scaling.type')!r}: {scaling!r} is not supported")
    return f32(keys.number("rope.freq_base", 1e-3, 1e12, default))


def attention_kv_heads(keys: Keys, num_layers: int, num_heads: int) -> tuple[list[bool], int]:
    """Which layers attend and their kv heads, from `attention.head_count_kv` as LFM2's and
    Granite 4.0-H's converters write it: one count per layer, 0 for a recurrent layer (how
    llama.cpp tells the layers apart); every attention layer must have the same count."""
    counts = keys.per_layer("attention.head_count_kv", 0, num_heads, num_layers)
    attends = [c > 0 for c in counts]
    kv = {c for c in counts if c}
    if len(kv) > 1:
        raise ModelFileError(
            f"metadata key {keys.key('attention.head_count_kv')!r}: attention layers with different kv "
            f"heads ({sorted(kv)}) are not supported"
        )
    num_kv = kv.pop() if kv else num_heads
    if num_heads % num_kv:
        raise ModelFileError(
            f"metadata key {keys.key('attention.head_count_kv')!r}: {num_kv} does not divide the {num_heads} "
            f"heads of {keys.key('attention.head_count')!r}"
        )
    return attends, num_kv


def heads(keys: Keys) -> int:
    """`attention.head_count`: one count for every layer."""
    return keys.integer("attention.head_count", 1, MAX_HEADS)


def layer_count(keys: Keys) -> int:
    """`block_count`."""
    return keys.integer("block_count", 1, MAX_LAYERS)


def global_pieces(cfg: Config, final_norm: str, final_norm_undo: Callable[[torch.Tensor], torch.Tensor] | None
                  = None, gguf_final_norm: str = "output_norm.weight") -> list[Piece]:  # fmt: skip
    """The embedding, the final norm (`final_norm`, its Hugging Face name) and the lm_head."""
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    out = [
        same("token_embd.weight", (vocab, hidden), "model.embed_tokens.weight"),
        same(gguf_final_norm, (hidden,), final_norm, final_norm_undo),
    ]
    if not cfg["tie_word_embeddings"]:
        out.append(same("output.weight", (vocab, hidden), "lm_head.weight"))
    return out


def check_pieces(meta: GGUFFile, pieces: Iterable[Piece], num_blocks: int, described: str) -> None:
    """Every tensor the pieces read is in the file with its shape, and the file holds nothing
    else.

    Raises:
        ModelFileError: naming the tensor, the shape expected from the metadata (`described`)
            and the one found.
    """
    expected: dict[str, Shape] = {}
    for piece in pieces:
        for name, shape in piece.sources:
            expected[name] = shape
    found = {t.name: t for t in meta.tensors}
    for name, shape in expected.items():
        tensor = found.get(name)
        if tensor is None:
            raise ModelFileError(f"tensor {name} is missing (the metadata describes {described})")
        if tensor.shape != shape:
            raise ModelFileError(
                f"tensor {name}: expected shape {list(shape)} from the metadata ({described}), "
                f"found {list(tensor.shape)}"
            )
    for name in found.keys() - expected.keys():
        layer = name.split(".")[1] if name.startswith("blk.") else ""
        if layer.isdecimal() and int(layer) >= num_blocks:
            raise ModelFileError(
                f"tensor {name} is past the {num_blocks} layers of the metadata's block_count"
            )
        raise ModelFileError(f"unexpected tensor {name} (not part of {described})")


def build_state_dict(
    meta: GGUFFile,
    pieces: list[Piece],
    dtype: torch.dtype,
    *,
    mtp: bool,
    float32: tuple[str, ...] = (),
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict the (checked) pieces make, in `dtype` (a tensor whose name
    holds one of the `float32` parts in float32), each GGUF tensor dequantized when its piece is
    built and its mapped pages released after (`progress`: called with the fraction built)."""
    found = {t.name: t for t in meta.tensors}
    sd: dict[str, torch.Tensor] = {}
    for i, piece in enumerate(pieces):
        if progress is not None:
            progress(i / len(pieces))
        if piece.mtp and not mtp:
            continue
        sources = [found[name] for name, _ in piece.sources]
        built = piece.build([_floats(t) for t in sources])
        for name, values in built.items():
            kept = any(part in name for part in float32)
            sd[name] = values.to(torch.float32 if kept else dtype).contiguous()
        for tensor in sources:
            meta.release(tensor)
    return sd


def _floats(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor's values as float32, every one finite.

    Raises:
        ModelFileError: its type cannot be dequantized, or it holds NaN or Inf.
    """
    values = dequantized(tensor).reshape(tensor.shape)
    if not np.isfinite(values).all():
        raise ModelFileError(f"tensor {tensor.name} holds NaN or Inf values")
    return torch.from_numpy(values)
