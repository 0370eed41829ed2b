"""The served model's names: the one id every surface shows, and the names a request may send.

Decided once, from the configuration alone (no file is read), so `/health` while the weights
load, `/v1/models`, the responses' `model` fields, the metrics' label and the logs all show the
same id from the first second on. The id is the first `--served-model-name`, else the model's
file name without `.gguf` (a Hugging Face directory's name; `Org/Name` for a directory in the
Hugging Face cache): `SmolLM2-135M-Instruct.Q4_1` for the default model.

A name is accepted when it is the id, a served name, or an alias, compared case-insensitively
with an owner prefix (`HuggingFaceTB/`), a `.gguf` extension and a `-GGUF` repository suffix
ignored. The aliases are the file name, its stem, and the stem without its quantization
suffix (`SmolLM2-135M-Instruct`), so the model's repository name (`HuggingFaceTB/SmolLM2-135M-
Instruct`) is accepted too. What the server does with any other name is its policy
(`ServerSettings.strict_model_names`).
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

# The quantization or precision suffix of a GGUF file's stem: `.Q4_1`, `-Q4_K_M`, `-IQ3_XS`, `.f16`.
_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)
_REPO_SUFFIX = re.compile(r"[\-_]gguf$", re.IGNORECASE)
_HF_CACHE_DIR = re.compile(r"^models--([^/]+?)--(.+)$")  # `models--Org--Name/snapshots/<hash>`
DEFAULT_MODEL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # where the default model's weights come from


def name_key(name: str) -> str:
    """The form names are compared in: lower case, no owner prefix, no `.gguf`, no `-GGUF`."""
    key = name.strip().rstrip("/").lower().rsplit("/", 1)[-1]
    key = key.removesuffix(".gguf")
    return _REPO_SUFFIX.sub("", key)


@dataclass(frozen=True, slots=True)
class ModelNames:
    """The id shown everywhere, the names `/v1/models` lists, and every other accepted name."""

    id: str
    listed: tuple[str, ...]  # one `/v1/models` entry each: the served names, else (id,)
    aliases: tuple[str, ...]  # accepted too, never listed: the file's names

    def accepts(self, name: str) -> bool:
        """Whether a request's `model` names this model (see the module docstring)."""
        key = name_key(name)
        return any(name_key(n) == key for n in (*self.listed, *self.aliases))


def model_names(model: str | None, served: Sequence[str] = ()) -> ModelNames:
    """The names of `model` (a path; None: the default model) served as `served` (may be empty)."""
    if model is None:
        from ft.model.pull import DEFAULT_MODEL_FILE

        file_names = [*_file_names(pathlib.PurePath(DEFAULT_MODEL_FILE)), DEFAULT_MODEL_REPO]
    else:
        file_names = _file_names(pathlib.PurePath(model.rstrip("/\\") or model))
    listed = tuple(dict.fromkeys(served)) or (file_names[0],)
    aliases = tuple(n for n in dict.fromkeys(file_names) if n not in listed)
    return ModelNames(id=listed[0], listed=listed, aliases=aliases)


def _file_names(path: pathlib.PurePath) -> list[str]:
    """The names a model file or directory goes by, the one to show first."""
    if path.parent.name == "snapshots" and (cached := _HF_CACHE_DIR.match(path.parent.parent.name)):
        owner, name = cached.groups()
        return [name, f"{owner}/{name}"]
    stem = path.stem if path.suffix.lower() == ".gguf" else path.name
    names = [stem, path.name]
    bare = _QUANT_SUFFIX.sub("", stem)
    if bare and bare != stem:
        names.append(bare)
    return names
