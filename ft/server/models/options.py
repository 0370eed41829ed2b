"""What a router-mode server serves: its models (`ServedModel`, from `--model` and
`--models-dir`) and the rules for loading and unloading them (`RouterSettings`)."""

from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass

from ft.config import DEFAULT_DRAIN_TIMEOUT_S
from ft.model_names import model_names, name_key

# Split GGUF shards (`name-00001-of-00003.gguf`): one model, named without the suffix.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})$")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model the router serves: its name (the id it is listed and answers under) and path."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The models of a router-mode server and the rules for loading and unloading them.

    `max_loaded`: the most models loaded at once (None: no limit). `memory_bytes`: the most the
    loaded models may cost together (`ModelSlot.cost`; None: no budget). `sleep_idle_s`: a
    model nobody used for that long is unloaded (None: never). `load_timeout_s` bounds a
    request's wait for its model's load (and the load itself), `busy_timeout_s` its wait for
    room when every loaded model is busy, `unload_timeout_s` the wait for a model's requests
    before an unload aborts them.
    """

    models: tuple[ServedModel, ...]
    max_loaded: int | None = None
    memory_bytes: int | None = None
    sleep_idle_s: float | None = None
    load_timeout_s: float = 600.0
    busy_timeout_s: float = 30.0
    unload_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("router mode needs at least one model (--model or --models-dir)")
        keys: dict[str, str] = {}
        for m in self.models:
            if not m.name or len(m.name) > 256 or not m.name.isprintable():
                raise ValueError(f"a model name must be 1..256 printable characters, got {m.name!r}")
            key = name_key(m.name)
            if key in keys:
                raise ValueError(f"two models are named {keys[key]!r} and {m.name!r}; name one NAME=PATH")
            keys[key] = m.name
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError(f"models_max must be at least 1, got {self.max_loaded}")
        if self.memory_bytes is not None and self.memory_bytes < 1 << 20:
            raise ValueError(f"models_memory must be at least 1 MiB, got {self.memory_bytes}")
        if self.sleep_idle_s is not None and not 0 < self.sleep_idle_s <= 7 * 86400:
            raise ValueError(f"sleep_idle_seconds must be in (0, 604800], got {self.sleep_idle_s}")
        for name in ("load_timeout_s", "busy_timeout_s", "unload_timeout_s"):
            if not 0 <= getattr(self, name) <= 86400:
                raise ValueError(f"{name} must be in 0..86400, got {getattr(self, name)}")


def parse_model_option(text: str) -> ServedModel:
    """`--model PATH` or `--model NAME=PATH` (a name has no `/`; an existing path wins)."""
    name, sep, path = text.partition("=")
    if sep and name and path and "/" not in name and "\\" not in name and not os.path.exists(text):
        return ServedModel(name, path)
    return ServedModel(model_names(text).id, text)


def discover_models(directory: str) -> list[ServedModel]:
    """Every model in `directory`, by name: each `*.gguf` file (a split GGUF's shards are one
    model, its first shard loaded) and each folder holding a Hugging Face `config.json`.

    Raises:
        ValueError: `directory` is not a folder, or holds no model.
    """
    root = pathlib.Path(directory)
    if not root.is_dir():
        raise ValueError(f"--models-dir {directory!r} is not a folder")
    found: list[ServedModel] = []
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix.lower() == ".gguf":
            shard = _SHARD.match(entry.stem)
            if shard is None:
                found.append(ServedModel(entry.stem, str(entry)))
            elif int(shard["part"]) == 1:
                found.append(ServedModel(shard["stem"], str(entry)))
        elif entry.is_dir() and (entry / "config.json").is_file():
            found.append(ServedModel(entry.name, str(entry)))
    if not found:
        raise ValueError(f"--models-dir {directory!r} holds no *.gguf file and no model folder")
    return found


def file_bytes(path: str) -> int:
    """The bytes of a model's weights on disk: the file, every shard of a split GGUF, or a
    folder's weight files (0 where none can be read)."""
    p = pathlib.Path(path)
    try:
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
        shard = _SHARD.match(p.stem)
        if shard is not None:
            return sum(f.stat().st_size for f in p.parent.glob(f"{shard['stem']}-*-of-{shard['count']}.gguf"))
        return p.stat().st_size
    except OSError:
        return 0
