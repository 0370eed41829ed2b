"""The execution plan: every model choice decided and checked once, before any weight is read.

`read_header` reads what a model says without its weights (a GGUF's metadata and tensor
table, a Hugging Face directory's config.json and safetensors headers); `plan` turns an
`EngineConfig` and that header into one `ExecutionPlan` (device, dtype, packed or float, KV
dtype, CUDA graphs, ranks, threads, pooling), recording why each automatic choice was made,
or refuses a combination the model cannot run with a `ConfigError` naming both options.
The loader then follows the plan; it decides nothing of its own.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ft.config import Q8_0_KV_PATH, RECURRENT_REFUSAL, EngineConfig, resolve_pooling
from ft.model.architectures import Architecture, by_name
from ft.model.gguf_file import ModelFileError
from ft.model.llama import LlamaConfig

if TYPE_CHECKING:
    from ft.model.runners import RunnerKind

MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own bound on its JSON header


class ConfigError(ValueError):
    """A combination of options (or of an option and the model) that cannot run; the message
    names both."""


@dataclass(frozen=True, slots=True)
class ModelHeader:
    """What a model file says without its weights.

    `weight_types`: how many 2-D weights are stored in each type (a GGUF's GGML type names, a
    safetensors directory's dtypes). `can_rank`: the model has a classification head.
    """

    path: pathlib.Path
    is_gguf: bool
    config: LlamaConfig
    weight_types: dict[str, int]
    can_rank: bool = False

    @property
    def family(self) -> Architecture:
        """The model's architecture entry."""
        return by_name(self.config.architecture)

    @property
    def main_type(self) -> str:
        """The type most 2-D weights are stored in ("Q4_K", "BF16"; "?" when none is listed)."""
        return max(self.weight_types, key=self.weight_types.__getitem__) if self.weight_types else "?"

    @property
    def is_quantized(self) -> bool:
        """Whether this is a GGUF whose 2-D weights are mostly of a quantized (not float) type."""
        if not self.is_gguf or not self.weight_types:
            return False
        floats = sum(n for t, n in self.weight_types.items() if t in ("F32", "F16", "BF16"))
        return 2 * floats <= sum(self.weight_types.values())


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """How the draft model of `--speculative-method draft` runs, decided with the target's plan.

    It runs where the target runs, its KV cache on the target's pages: `packed` (its blocks as
    stored, float16 KV) where the packed kernels run it, else float (`dtype`, its KV too).
    """

    path: str
    packed: bool
    dtype: str
    kv_dtype: str
    weights: str  # the type most of its 2-D weights are stored in
    reasons: tuple[str, ...]

    def summary(self) -> str:
        """The draft model's part of the plan's line."""
        weights = f"packed {self.weights}" if self.packed else f"{self.dtype} from {self.weights}"
        return f"{weights}, KV {self.kv_dtype}"


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """How a model runs, decided once before its weights load.

    `dtype`: the compute dtype, "auto" when it is measured at load (`ft.model.dtypes`).
    `kv_dtype`: the KV cache's element type ("q8_0": blocks; "auto": the compute dtype).
    `threads`: a fixed CPU thread count, None when measured per batch size. `reasons`: why each
    automatic choice was made, one line each ("packed: a Q4_K GGUF on the CPU in one process").
    """

    device: str  # "cpu", "cuda" or "cuda:N" (rank r of a node takes the r-th GPU from it)
    dtype: str
    packed: bool
    quantize: str | None
    kv_dtype: str
    cuda_graphs: bool
    tensor_parallel_size: int
    threads: int | None
    speculative_method: str | None
    pooling: str
    weights: str  # the type most 2-D weights are stored in
    reasons: tuple[str, ...]
    draft: DraftPlan | None = None  # the draft model's, with `--speculative-method draft`

    @property
    def runner(self) -> RunnerKind:
        """The runner class that runs it (`ft.model.runners.build_runner`)."""
        return "packed" if self.packed else "graphed" if self.cuda_graphs else "float"

    def summary(self) -> str:
        """The plan in one line, as the engine logs it at load."""
        if self.packed:
            weights = f"packed {self.weights}"
        elif self.quantize:
            weights = f"{self.quantize} linears from {self.weights}"
        else:
            weights = f"{'measured float' if self.dtype == 'auto' else self.dtype} from {self.weights}"
        where = self.device.upper() if self.device == "cpu" else self.device
        if self.device == "cpu":
            where += f", {self.threads} threads" if self.threads else ", threads measured"
        parts = [f"{weights} ({where})", f"KV {self.kv_dtype}"]
        if self.tensor_parallel_size > 1:
            parts.append(f"{self.tensor_parallel_size} ranks")
        if self.device != "cpu":
            parts.append("CUDA graphs" if self.cuda_graphs else "eager")
        if self.draft is not None:
            parts.append(f"speculative draft ({self.draft.summary()})")
        elif self.speculative_method:
            parts.append(f"speculative {self.speculative_method}")
        parts.append(f"pooling {self.pooling}")
        return ", ".join(parts)


def read_header(path: str | pathlib.Path | None) -> ModelHeader:
    """What `path` (a GGUF file or a Hugging Face directory; None: the default model) says
    without reading a weight: its config, its weights' types, whether it has a classifier.

    Raises:
        FileNotFoundError: `path` does not exist.
        ModelFileError: a GGUF's header or metadata is malformed.
        ValueError: not a model `ft` can run (unknown family, no config.json, ...).
    """
    from ft.model import gguf_loader, hf_loader
    from ft.model.loader import is_gguf, model_path

    p = model_path(path)
    if p.is_dir():
        config = hf_loader.hf_config(p)
        return ModelHeader(p, False, config, _safetensors_types(p), can_rank=config.pooling == "rank")
    if not is_gguf(p):
        raise ValueError(f"{p} is neither a .gguf file nor a Hugging Face model directory")
    reader = gguf_loader.open_gguf(p)  # maps the file; the tensor table is read, no tensor data
    try:
        config = gguf_loader.gguf_config(reader, {t.name for t in reader.tensors}, 0)
    except ModelFileError as e:
        raise ModelFileError(f"{p}: {e}") from None
    types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    can_rank = any(t.name == "cls.output.weight" for t in reader.tensors)
    return ModelHeader(p, True, config, dict(types), can_rank=can_rank)


def _safetensors_types(directory: pathlib.Path) -> dict[str, int]:
    """How many 2-D tensors each dtype holds across `directory`'s safetensors headers."""
    types: Counter[str] = Counter()
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelFileError(f"{file}: {len(raw)} bytes, too few for a safetensors header")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_SAFETENSORS_HEADER:
                raise ModelFileError(f"{file}: a header of {size} bytes (corrupt?)")
            try:
                header = json.loads(f.read(size))
            except ValueError as e:
                raise ModelFileError(f"{file}: the header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ModelFileError(f"{file}: the header is not a JSON object")
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict) and len(info.get("shape", ())) == 2:
                types[str(info.get("dtype"))] += 1
    return dict(types)


def plan(config: EngineConfig, header: ModelHeader, draft: ModelHeader | None = None) -> ExecutionPlan:
    """The one plan `config` runs `header`'s model with (and `draft`'s, the draft model of
    `--speculative-method draft`; None: its header is read here).

    Raises:
        ConfigError: a combination that cannot run (`--quantize int8 --device cuda`,
            `--kv-cache-dtype q8_0` off the packed path, more ranks than kv heads, ...).
    """
    import torch

    from ft.model import kernels
    from ft.model.parallel.shard import check_shardable

    c = header.config
    world = config.tensor_parallel_size
    reasons: list[str] = []
    has_cuda = torch.cuda.is_available()
    if c.is_hybrid:
        _check_recurrent(config, header)

    # Device.
    device = config.device
    if device == "auto":
        if config.quantize is not None and has_cuda:
            device = "cpu"
            reasons.append(f"device cpu: --quantize {config.quantize} runs on the CPU")
        else:
            device = "cuda" if has_cuda else "cpu"
            reasons.append(f"device {device}: torch sees {'a' if has_cuda else 'no'} CUDA device")
    on_cpu = device == "cpu"
    if not on_cpu and not has_cuda:
        raise ConfigError(f"--device {device} was asked for, but torch sees no CUDA device")
    if not on_cpu and config.quantize is not None:
        raise ConfigError(
            f"--quantize {config.quantize} runs on the CPU; it cannot be combined with --device {device}"
        )

    # Packed (the GGUF's blocks as stored, run by the native kernels) or float weights.
    packed = False
    if not header.is_quantized:
        why = "a float GGUF" if header.is_gguf else "a Hugging Face directory"
        reasons.append(f"float: {why} ({header.main_type}) loads as floats")
    elif not header.family.packed:
        reasons.append(f"float: the packed kernels do not run {header.family.name}; dequantized")
    elif config.quantize is not None:
        reasons.append(f"float: --quantize {config.quantize} asked for; dequantized")
    elif config.dtype != "auto":
        reasons.append(f"float: --dtype {config.dtype} asked for; dequantized")
    elif world > 1:
        reasons.append("float: the packed kernels run in one process; dequantized for tensor parallelism")
    elif not on_cpu:
        reasons.append(f"float: the packed kernels run on the CPU; dequantized for {device}")
    elif not kernels.available():
        reasons.append(f"float: the packed kernels cannot be built here ({kernels.build_error()})")
    else:
        packed = True
        reasons.append(f"packed: a {header.main_type} GGUF on the CPU in one process")

    # Compute dtype.
    if config.quantize is not None or packed:
        dtype = "float32"
        reasons.append(
            f"dtype float32: {'packed kernels' if packed else 'int8 linears'} take float32 activations"
        )
    elif config.dtype != "auto":
        dtype = config.dtype
    elif not on_cpu:
        dtype = "bfloat16"
        reasons.append("dtype bfloat16: auto on CUDA")
    elif world > 1:
        # NOTE: "auto" is measured in each process: ranks that measured differently would
        # all-reduce tensors of different dtypes (gloo aborts the process). One choice for all.
        dtype = "float32"
        reasons.append("dtype float32: auto with ranks (one dtype for all of them)")
    else:
        dtype = "auto"
        reasons.append("dtype auto: float32 or bfloat16, measured at load")

    # KV cache dtype.
    if config.kv_cache_dtype == kernels.Q8_0_KV:
        if not packed:
            raise ConfigError(f"{Q8_0_KV_PATH} ({_not_packed_why(config, header, device)})")
        try:
            kernels.kv_head_bytes(kernels.Q8_0_KV, c.head_dim)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        kv_dtype = kernels.Q8_0_KV
    elif config.kv_cache_dtype != "auto":
        kv_dtype = config.kv_cache_dtype
    elif packed:
        # NOTE: packed weights keep float16 KV by default: half the memory and half the bytes
        # decode attention reads, for 0.014 of max logit change against transformers (float32 5e-5).
        kv_dtype = "float16"
        reasons.append("KV float16: auto with packed weights")
    else:
        kv_dtype = dtype

    # Ranks.
    if world > 1 and header.family.decoder != "llama":
        raise ConfigError(f"--tensor-parallel-size {world}: {header.family.name} runs in one process")
    if world > 1:
        try:
            check_shardable(c, world)
        except ValueError as e:
            raise ConfigError(f"--tensor-parallel-size {world}: {e}") from None

    # CUDA graphs.
    cuda_graphs = False
    if not on_cpu and config.cuda_graphs:
        if world > 1:
            reasons.append("eager: tensor-parallel steps' all_reduce calls are not captured")
        elif c.num_experts:
            reasons.append("eager: expert layers size their work from the routing (a host sync)")
        elif header.family.decoder != "llama":
            reasons.append(f"eager: {header.family.name}'s decode steps are not captured in graphs")
        elif c.is_hybrid:
            reasons.append("eager: the recurrent layers' states are not captured in graphs")
        else:
            cuda_graphs = True

    # CPU threads.
    threads = config.compute_threads
    if threads is None and world > 1 and on_cpu:
        # Ranks on one machine share its cores (torchrun says how many ranks run on this node).
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        threads = max(1, (os.cpu_count() or 1) // local_ranks)
        reasons.append(f"threads {threads}: the cores shared by {local_ranks} ranks")

    # Context and pooling.
    if config.max_model_len is not None and config.max_model_len > c.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len {config.max_model_len} exceeds the model's context {c.max_position_embeddings}"
        )
    try:
        pooling = resolve_pooling(config.pooling, c.pooling, can_rank=header.can_rank)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.pooling == "auto":
        reasons.append(f"pooling {pooling}: {'the model file says' if c.pooling else 'the default'}")

    draft_plan = None
    if config.speculative_method == "draft":
        assert config.speculative_model is not None  # `EngineConfig` checks it
        draft = draft or read_header(config.speculative_model)
        draft_plan = plan_draft(config.speculative_model, draft, device)

    return ExecutionPlan(
        device=device,
        dtype=dtype,
        packed=packed,
        quantize=config.quantize,
        kv_dtype=kv_dtype,
        cuda_graphs=cuda_graphs,
        tensor_parallel_size=world,
        threads=threads,
        speculative_method=config.speculative_method,
        pooling=pooling,
        weights=header.main_type,
        reasons=tuple(reasons),
        draft=draft_plan,
    )


def _check_recurrent(config: EngineConfig, header: ModelHeader) -> None:
    """Refuse what a model with recurrent layers (`LlamaConfig.is_hybrid`) cannot run with.

    Raises:
        ConfigError: speculative decoding, the disk tier or tensor parallelism was asked for.
    """
    name = header.family.name
    if config.speculative_method is not None:
        raise ConfigError(
            f"--speculative-method {config.speculative_method}: speculative decoding is "
            f"{RECURRENT_REFUSAL} ({name})"
        )
    if config.prompt_cache_dir is not None:
        raise ConfigError(f"--prompt-cache-dir: the prompt cache's disk tier is {RECURRENT_REFUSAL} ({name})")
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size}: tensor parallelism is "
            f"{RECURRENT_REFUSAL} ({name})"
        )


def plan_draft(path: str, draft: ModelHeader, device: str) -> DraftPlan:
    """How the draft model `draft` (at `path`) runs beside a target on `device`.

    Its tokenizer is compared with the target's from the files, before any weight is read
    (`ft.model.draft.check_tokenizer_files`), where the loader follows this plan.
    """
    from ft.model import kernels

    reasons: list[str] = []
    packed = False
    if not draft.is_quantized:
        reasons.append(f"draft float: {'a float GGUF' if draft.is_gguf else 'a Hugging Face directory'}")
    elif not draft.family.packed:
        reasons.append(f"draft float: the packed kernels do not run {draft.family.name}")
    elif device != "cpu":
        reasons.append(f"draft float: the packed kernels run on the CPU; dequantized for {device}")
    elif not kernels.available():
        reasons.append(f"draft float: the packed kernels cannot be built here ({kernels.build_error()})")
    else:
        packed = True
        reasons.append(f"draft packed: a {draft.main_type} GGUF on the CPU")
    dtype = "float32" if packed or device == "cpu" else "bfloat16"
    # NOTE: packed weights keep float16 KV (as the target's do by default); float ones their dtype.
    kv_dtype = "float16" if packed else dtype
    return DraftPlan(path, packed, dtype, kv_dtype, draft.main_type, tuple(reasons))


def _not_packed_why(config: EngineConfig, header: ModelHeader, device: str) -> str:
    """Why a run is off the packed path, for the q8_0 KV refusal."""
    from ft.model import kernels

    if not header.is_quantized:
        return "the model is not a quantized GGUF"
    if not header.family.packed:
        return f"the packed kernels do not run {header.family.name}"
    if not kernels.available():
        return f"the packed kernels cannot be built here ({kernels.build_error()})"
    return f"this run is not on the CPU in one process ({device}, {config.tensor_parallel_size} rank(s))"
