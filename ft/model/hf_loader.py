"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections import Counter
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ft.model.architectures import by_hf
from ft.model.llama import LlamaConfig, Progress
from ft.model.rerank import RankFormat
from ft.tokenizer.spec import TokenizerSpec, tokenizer_json_of

log = logging.getLogger("ft.model")

GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# a multimodal checkpoint's weights that are not its text model's own names
MULTIMODAL_PREFIXES = (
    "model.language_model.", "model.vision", "model.visual", "model.multi_modal", "model.audio",
    "model.embed_vision", "model.embed_audio",
)  # fmt: skip


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def hf_config(directory: pathlib.Path) -> LlamaConfig:
    """A `LlamaConfig` from `config.json` (its family looked up in `ft.model.architectures`).

    Raises:
        ValueError: no config.json, or a family ft does not run (naming the supported ones).
    """
    cfg = _read_json(directory / "config.json")
    if not cfg:
        raise ValueError(f"{directory} has no config.json")
    config = LlamaConfig.from_hf(cfg)
    if is_sequence_classifier(cfg):
        # NOTE: no lm_head in the checkpoint: the embedding stands in for it (never used to score).
        config = dataclasses.replace(config, tie_word_embeddings=True, pooling="rank")
    return config


def is_sequence_classifier(cfg: dict[str, Any]) -> bool:
    """Whether `config.json` names a `*ForSequenceClassification` (a reranker's checkpoint)."""
    archs = cfg.get("architectures") or []
    return isinstance(archs, list) and any(str(a).endswith("ForSequenceClassification") for a in archs)


def hf_rank_format(directory: pathlib.Path, spec: TokenizerSpec, labels: int) -> RankFormat:
    """A sequence classifier's pair format (`ft.model.rerank`): the special-token rule, with BOS
    and EOS where `tokenizer_config.json` adds them (`add_bos_token`, `add_eos_token`)."""
    tcfg = _read_json(directory / "tokenizer_config.json")
    tok = Tokenizer.from_str(spec.tokenizer_json)
    bos = tok.token_to_id(spec.bos_token) if spec.bos_token else None
    eos = tok.token_to_id(spec.eos_token) if spec.eos_token else None
    sep_text = _token_text(tcfg.get("sep_token"))
    sep = tok.token_to_id(sep_text) if sep_text else None
    return RankFormat(
        num_labels=labels,
        bos_id=bos,
        eos_id=eos if eos is not None else sep,
        sep_id=sep,
        add_bos=spec.add_bos_token,
        add_eos=bool(tcfg.get("add_eos_token", False)),
    )


def hf_state_dict(
    directory: pathlib.Path, dtype: torch.dtype, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the (possibly sharded) safetensors checkpoint, cast to `dtype` (those
    the family names in `hf_float32_weights` to float32)."""
    index = _read_json(directory / "model.safetensors.index.json")
    if index:
        files = sorted(set(index["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} has no *.safetensors files")
    family = by_hf(_read_json(directory / "config.json"))
    prefixes = family.hf_weight_prefixes
    keep = family.hf_float32_weights
    sd: dict[str, torch.Tensor] = {}
    left_out: Counter[str] = Counter()
    for i, name in enumerate(files):
        if progress is not None:
            progress(i / len(files))
        for key, tensor in load_file(str(directory / name)).items():
            text_key = _text_weight(key, prefixes) if prefixes else key
            if text_key is not None:
                kept = keep and any(part in key for part in keep)
                sd[family.hf_weight_name(text_key)] = tensor.to(torch.float32 if kept else dtype)
            else:
                left_out[_module_of(key)] += 1
    if left_out:
        parts = ", ".join(f"{module}.* ({n})" for module, n in sorted(left_out.items()))
        log.info("%s: weights outside the text model left out, not run: %s", directory.name, parts)
    return sd


def _module_of(key: str) -> str:
    """The module a weight left out belongs to, for the log: `mtp`, `model.visual`, ..."""
    parts = key.split(".")
    return ".".join(parts[:2] if parts[0] == "model" and len(parts) > 2 else parts[:1])


def _text_weight(key: str, prefixes: tuple[tuple[str, str], ...]) -> str | None:
    """A multimodal checkpoint's weight under its text model's name, or None (the vision and
    audio towers, their projectors, a multi-token prediction head: not run). A checkpoint of
    the text model alone keeps its names."""
    if key.startswith("model.") and not key.startswith(MULTIMODAL_PREFIXES):
        return key  # Gemma3ForCausalLM's (Gemma4ForCausalLM's) own
    for old, new in prefixes:
        if key.startswith(old):
            return new + key.removeprefix(old)
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def hf_tokenizer(directory: pathlib.Path, context_length: int) -> TokenizerSpec:
    """The tokenizer from `tokenizer.json` + `tokenizer_config.json` (+ generation_config eos ids)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    tcfg = _read_json(directory / "tokenizer_config.json")
    gen = _read_json(directory / "generation_config.json")
    cfg = _read_json(directory / "config.json")
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    bos = _token_text(tcfg.get("bos_token"))
    eos = _token_text(tcfg.get("eos_token"))
    eos_ids: list[int] = []
    for source in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
    if eos is not None:
        eos_id = tok.token_to_id(eos)
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
    max_len = tcfg.get("model_max_length")
    return TokenizerSpec(
        tokenizer_json=tokenizer_json_of(tok),
        chat_template=template if isinstance(template, str) else None,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=bool(tcfg.get("add_bos_token", False)),
        eos_token_ids=tuple(eos_ids),
        context_length=min(context_length, max_len)
        if isinstance(max_len, int) and max_len > 0
        else context_length,
    )


def generation_defaults(directory: pathlib.Path) -> dict[str, float | int]:
    """Sampling defaults from `generation_config.json` (temperature, top_p, top_k, repetition_penalty)."""
    gen = _read_json(directory / "generation_config.json")
    return {
        k: gen[k]
        for k in GENERATION_KEYS
        if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)
    }
