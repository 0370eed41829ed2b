"""Load a model from a GGUF file or a Hugging Face directory into plain tensors + config."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

import torch

from ft.model import gguf_hybrid, gguf_loader, hf_loader
from ft.model.architectures import by_gguf, by_name
from ft.model.classifier import ClassifierHead, pop_head
from ft.model.gguf_file import ModelFileError
from ft.model.llama import LlamaConfig, Progress
from ft.model.quant import QuantTensor
from ft.model.rerank import RankFormat
from ft.tokenizer.spec import TokenizerSpec


@dataclass(frozen=True)
class LoadedModel:
    """What a model directory or file holds: config, weights (HF names), tokenizer, defaults.

    Weights are float tensors, or packed GGUF blocks (`QuantTensor`) when loaded `quantized`.
    A reranker's classification head is not in `state_dict`: it is `classifier` (float), and
    `rank_format` says how its pairs are formatted and its outputs read.
    """

    config: LlamaConfig
    state_dict: dict[str, torch.Tensor | QuantTensor]
    tokenizer: TokenizerSpec
    model_id: str
    dtype: torch.dtype
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    classifier: ClassifierHead | None = None
    rank_format: RankFormat | None = None


def load_model(
    path: str | pathlib.Path | None,
    dtype: torch.dtype,
    progress: Progress | None = None,
    quantized: bool = False,
) -> LoadedModel:
    """Load `path` (a `.gguf` file or a HF directory; None: the default model) in `dtype`.

    `progress` is called with the fraction of weights loaded so far (from this thread). With
    `quantized`, a GGUF's 2-D weights stay as stored (see `gguf_loader.as_stored`); a Hugging
    Face directory always loads as float.

    Raises:
        ModelNotFound: the default model is missing or corrupt and cannot be fetched.
        FileNotFoundError: `path` does not exist.
        ValueError: the file or directory is not a model `ft` can run.
    """
    p = model_path(path)
    if p.is_dir():
        config = hf_loader.hf_config(p)
        floats = hf_loader.hf_state_dict(p, dtype, progress)
        head = pop_head(floats, config.hidden_size)  # `score.weight` of a *ForSequenceClassification
        if config.pooling == "rank" and head is None:
            raise ValueError(f"{p}: a sequence classifier without its score.weight")
        sd: dict[str, torch.Tensor | QuantTensor] = dict(floats)
        spec = hf_loader.hf_tokenizer(p, config.max_position_embeddings)
        rank_format = hf_loader.hf_rank_format(p, spec, head.num_labels) if head is not None else None
        if rank_format is not None and rank_format.num_labels != 1:
            raise ValueError(
                f"{p}: the classifier has {rank_format.num_labels} labels; ft serves a sequence "
                "classifier as a reranker, whose score.weight has one row (the relevance logit)"
            )
        defaults = hf_loader.generation_defaults(p)
        return LoadedModel(config, sd, spec, p.name, dtype, defaults, head, rank_format)
    if p.suffix.lower() == ".gguf" or _is_gguf(p):
        config, sd, spec, model_id = gguf_loader.load_gguf(p, dtype, progress, quantized)
        # (`load_gguf` checked the head's shapes against the metadata; its tensors are floats.)
        cls = {k: sd.pop(k) for k in list(sd) if k.startswith("cls.")}
        softmax = by_name(config.architecture).rank_softmax
        head = pop_head(cls, config.hidden_size, softmax=softmax)  # type: ignore[arg-type]
        if head is None:
            return LoadedModel(config, sd, spec, model_id, dtype, {})
        try:
            rank_format = gguf_loader.gguf_rank_format(p, spec, head.num_labels)
        except ModelFileError as e:
            raise ModelFileError(f"{p}: {e}") from None
        return LoadedModel(config, sd, spec, model_id, dtype, {}, head, rank_format)
    raise ValueError(f"{p} is neither a .gguf file nor a Hugging Face model directory")


def read_tokenizer(path: str | pathlib.Path | None) -> tuple[TokenizerSpec, int]:
    """`path`'s tokenizer and its embedding rows, as `load_model` reads them, without a weight.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: not a model `ft` can run (`ModelFileError`: a malformed GGUF).
    """
    p = model_path(path)
    if p.is_dir():
        config = hf_loader.hf_config(p)
        return hf_loader.hf_tokenizer(p, config.max_position_embeddings), config.vocab_size
    reader = gguf_loader.open_gguf(p)
    try:
        tokens = gguf_loader.token_list(reader)
        config = gguf_loader.gguf_config(reader, {t.name for t in reader.tensors}, len(tokens))
        return gguf_loader.gguf_tokenizer(reader, config.max_position_embeddings), config.vocab_size
    except ModelFileError as e:
        raise ModelFileError(f"{p}: {e}") from None


def model_path(path: str | pathlib.Path | None) -> pathlib.Path:
    """`path` expanded (None: the default model, fetched when missing).

    Raises:
        ModelNotFound: the default model is missing or corrupt and cannot be fetched.
        FileNotFoundError: `path` does not exist.
    """
    if path is None:
        from ft.model.pull import default_model_path

        path = default_model_path()
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    return p


def is_gguf(path: str | pathlib.Path | None) -> bool:
    """Whether `path` (None: the default model) is a GGUF file."""
    if path is None:
        return True
    p = pathlib.Path(path).expanduser()
    return p.is_file() and (p.suffix.lower() == ".gguf" or _is_gguf(p))


def is_quantized_gguf(path: str | pathlib.Path | None) -> bool:
    """Whether `path` (None: the default model) is a GGUF whose 2-D weights are mostly of a
    quantized type (not F32/F16/BF16), of a family the packed kernels run: those run as stored;
    float files, and families the kernels do not run (mixture of experts), load as floats."""
    if not is_gguf(path):
        return False
    if path is None:
        from ft.model.pull import default_model_path

        path = default_model_path()
    reader = gguf_loader.open_gguf(pathlib.Path(path).expanduser())
    if gguf_hybrid.family_of(reader) is not None:
        return False  # (the hybrid families run dequantized, as their checkpoints)
    try:
        arch = str(reader.text("general.architecture"))
        family = by_gguf(
            arch, str(reader.text("general.name", "") or ""), f"{arch}.expert_count" in reader.fields
        )
    except ValueError:
        family = None  # unsupported: `load_model` names it
    if family is not None and not family.packed:
        return False
    weights = [t.tensor_type for t in reader.tensors if len(t.shape) == 2]
    quantized = [t for t in weights if int(t) not in (0, 1, 30)]  # F32, F16, BF16
    return bool(weights) and 2 * len(quantized) >= len(weights)


def _is_gguf(p: pathlib.Path) -> bool:
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"
