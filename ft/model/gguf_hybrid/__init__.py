"""The hybrid families' GGUFs (attention and recurrent layers) read back into the Hugging Face
form: the `config.json` dict their checkpoints have and their safetensors' tensors, by name,
dequantized — every transform llama.cpp's converter (`convert_hf_to_gguf.py`) applied undone.

So a hybrid GGUF loads as its checkpoint would (`load_hybrid_gguf`), through the hybrid
decoder's Hugging Face loader, on the float path. One `HybridFamily` per GGUF architecture
(`FAMILIES`): Qwen3.5, Qwen3.5-MoE, Qwen3-Next (`qwen.py`), LFM2 (`lfm2.py`) and Granite 4.0-H
(`granite.py`). The file is untrusted: every number is range-checked as it is read, every
size derived from them is checked against the others, and every tensor against the derived
config (`common.check_pieces`) before one is dequantized.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ft.model.architectures import ConverterLoss, by_name
from ft.model.gguf_file import GGUFFile, ModelFileError
from ft.model.gguf_hybrid.common import Config, Piece, build_state_dict, check_pieces
from ft.model.gguf_hybrid.granite import GRANITE_LOSSES, granite_config, granite_pieces
from ft.model.gguf_hybrid.lfm2 import lfm2_config, lfm2_pieces
from ft.model.gguf_hybrid.qwen import qwen_config, qwen_pieces
from ft.model.gguf_loader import gguf_tokenizer, open_gguf
from ft.model.llama import LlamaConfig, Progress
from ft.tokenizer.spec import TokenizerSpec

log = logging.getLogger("ft.model")


@dataclass(frozen=True, slots=True)
class HybridFamily:
    """One hybrid GGUF architecture: its family's name for messages, its checkpoint's
    `config.json` from the metadata (`config(meta, arch)`), the pieces that make the
    checkpoint's tensors from that config, and the checkpoint settings the converter does not
    write (`ConverterLoss`: they read back as llama.cpp runs them)."""

    title: str
    config: Callable[[GGUFFile, str], Config]
    pieces: Callable[[Config], list[Piece]]
    losses: tuple[ConverterLoss, ...] = ()


_NORM_TOPK = ConverterLoss("norm_topk_prob", "expert_weights_norm", "the top-k routing weights renormalized")
FAMILIES: dict[str, HybridFamily] = {
    "qwen35": HybridFamily("Qwen3.5", qwen_config, qwen_pieces),
    "qwen35moe": HybridFamily("Qwen3.5-MoE", qwen_config, qwen_pieces),
    "qwen3next": HybridFamily("Qwen3-Next", qwen_config, qwen_pieces, (_NORM_TOPK,)),
    "lfm2": HybridFamily("LFM2", lfm2_config, lfm2_pieces),
    "granitehybrid": HybridFamily("Granite 4.0-H", granite_config, granite_pieces, GRANITE_LOSSES),
}


class HybridGGUF(NamedTuple):
    """What a hybrid GGUF holds, as its Hugging Face checkpoint would: `config.json`'s dict,
    the state dict under the checkpoint's names, and the tokenizer."""

    config: Config
    state_dict: dict[str, torch.Tensor]
    tokenizer: TokenizerSpec


def family_of(meta: GGUFFile) -> HybridFamily | None:
    """The hybrid family `meta`'s `general.architecture` names, None for any other."""
    return FAMILIES.get(str(meta.text("general.architecture", "") or ""))


def hf_config_from_gguf(meta: GGUFFile) -> Config:
    """The checkpoint's `config.json` (a dict of transformers' keys) a hybrid GGUF's metadata
    describes.

    Raises:
        ModelFileError: not a hybrid family's file, or a key missing, of the wrong type, out of
            range or inconsistent with another (named in the message).
    """
    family = family_of(meta)
    if family is None:
        raise ModelFileError(
            f"GGUF architecture {meta.text('general.architecture')!r} is not a hybrid family "
            f"(supported: {', '.join(FAMILIES)})"
        )
    return family.config(meta, str(meta.text("general.architecture")))


def hf_tensors_from_gguf(
    meta: GGUFFile,
    config: Config,
    dtype: torch.dtype = torch.float32,
    *,
    mtp: bool = False,
    float32: tuple[str, ...] = (),
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (its safetensors' names) of a hybrid GGUF whose metadata gave
    `config` (`hf_config_from_gguf`), dequantized to `dtype` (those whose names hold a `float32`
    part to float32); with `mtp`, the multi-token prediction layers' too (`mtp.*`; always
    checked, built only when asked for: ft does not run them, and transformers drops them).

    Raises:
        ModelFileError: a tensor missing, of another shape than the config gives, left over,
            of a type that cannot be dequantized, or holding NaN/Inf or an impossible value.
    """
    family = family_of(meta)
    if family is None:
        arch = meta.text("general.architecture")
        raise ModelFileError(f"GGUF architecture {arch!r} is not a hybrid family")
    pieces = family.pieces(config)
    blocks = config["num_hidden_layers"] + config.get("mtp_num_hidden_layers", 0)
    check_pieces(meta, pieces, blocks, _described(family, config))
    return build_state_dict(meta, pieces, dtype, mtp=mtp, float32=float32, progress=progress)


def load_hybrid_gguf(
    path: pathlib.Path,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    float32: tuple[str, ...] = (),
) -> HybridGGUF:
    """A hybrid GGUF's config dict, state dict (in `dtype`, names holding a `float32` part in
    float32) and tokenizer, as its Hugging Face checkpoint would give them; each setting the
    converter dropped is logged (`ConverterLoss`).

    Raises:
        ModelFileError: the file is malformed, or its tensors disagree with its metadata (the
            message starts with the path and names the key or tensor).
    """
    meta = open_gguf(path)
    try:
        family = family_of(meta)
        config = hf_config_from_gguf(meta)
        assert family is not None
        for loss in family.losses:
            if loss.key is None or f"{meta.text('general.architecture')}.{loss.key}" not in meta.fields:
                log.log(
                    logging.WARNING if loss.warns else logging.INFO,
                    "%s: the checkpoint's %r is not in this GGUF (llama.cpp's converter does not write "
                    "it): %s, as llama.cpp runs it", path.name, loss.setting, loss.assumed,
                )  # fmt: skip
        state_dict = hf_tensors_from_gguf(meta, config, dtype, float32=float32, progress=progress)
        tokenizer = gguf_tokenizer(meta, config["max_position_embeddings"])
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None
    return HybridGGUF(config, state_dict, tokenizer)


def llama_config(meta: GGUFFile) -> LlamaConfig:
    """The config ft runs a hybrid GGUF with: its checkpoint's `config.json` read as ft reads
    one (`LlamaConfig.from_hf`, through the registry), from the metadata alone.

    Raises:
        ModelFileError: the metadata is wrong, or describes a model ft does not run.
    """
    family = family_of(meta)
    assert family is not None
    try:
        return LlamaConfig.from_hf(hf_config_from_gguf(meta))
    except ModelFileError:
        raise
    except ValueError as e:
        raise ModelFileError(f"{family.title} metadata: {e}") from None


def load_runnable(
    path: pathlib.Path, dtype: torch.dtype, progress: Progress | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor], TokenizerSpec]:
    """A hybrid GGUF as ft loads its Hugging Face checkpoint: `llama_config` (refusing what ft
    does not run before a tensor is read), the tensors dequantized under the names the
    family's safetensors load under (`Architecture.hf_weight_name`; its `hf_float32_weights` in
    float32, as from safetensors), the tokenizer.

    Raises:
        ModelFileError: as `llama_config` and `load_hybrid_gguf`.
    """
    try:
        config = llama_config(open_gguf(path))
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None
    family = by_name(config.architecture)
    hybrid = load_hybrid_gguf(path, dtype, progress, family.hf_float32_weights)
    state_dict = {family.hf_weight_name(k): v for k, v in hybrid.state_dict.items()}
    return config, state_dict, hybrid.tokenizer


def _described(family: HybridFamily, c: Config) -> str:
    """The config in a few words, for tensor errors."""
    kinds = c["layer_types"]
    attention = sum(k in ("full_attention", "attention") for k in kinds)
    return (
        f"{family.title}: {len(kinds)} layers ({attention} attention, {len(kinds) - attention} recurrent), "
        f"hidden {c['hidden_size']}, {c['num_attention_heads']} heads / {c['num_key_value_heads']} kv heads, "
        f"vocab {c['vocab_size']}"
    )
