"""Engine configuration: one frozen record, validated once, built by the CLI and by embedders."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16")
# auto: the model's dtype; q8_0 (int8 blocks of 32 with a half scale) on the packed path only
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0")
Q8_0_KV_PATH = (
    "--kv-cache-dtype q8_0 runs only on the packed CPU path: a quantized GGUF run as stored "
    "(--dtype auto, no --quantize), on the CPU, in one process; use float16 or bfloat16 here"
)
# auto: the model file's (a reranker's: rank), else last
POOLING_CHOICES = ("auto", "mean", "cls", "last", "rank")
ADMISSIONS = ("need", "reserve")
QUANTIZATIONS = ("int8",)
SPECULATIVE_METHODS = ("ngram", "draft")
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"  # auto: CUDA when torch sees one, else the CPU
DEFAULT_STEP_TIMEOUT_S = 60.0  # far above any step, a grammar's bounded masks included
# A chat template renders in milliseconds; one that runs for seconds loops without end.
DEFAULT_TEMPLATE_TIMEOUT_S = 5.0
# 1 GiB of KV holds ~23k tokens of the default model in float32 (46 KiB a token).
DEFAULT_KV_CACHE_MEMORY = 1 << 30
# A drain's defaults (`Engine.prepare_stop`, `POST /v1/admin/prepare-stop`): seconds in-flight
# requests get to finish, then seconds the aborted rest get to close their scopes (every stop's
# abort grace, `ft serve`'s on SIGINT/SIGTERM too; its drain is `ServerSettings.drain_timeout_s`).
DEFAULT_DRAIN_TIMEOUT_S = 5.0
DEFAULT_ABORT_TIMEOUT_S = 3.0
# The prompt cache's disk tier (`--prompt-cache-dir`): its bound, and the fewest leading tokens
# on disk worth a read (a load takes a step of its own; below it they are prefilled).
DEFAULT_PROMPT_CACHE_SIZE = 4 << 30
DEFAULT_PROMPT_CACHE_MIN_TOKENS = 64
# A model with recurrent layers: snapshots of sequences' states kept for prefix reuse (their
# slots beside one per running sequence, out of the KV budget); 0 turns its prefix cache off.
DEFAULT_STATE_SNAPSHOTS = 16
MAX_STATE_SNAPSHOTS = 4096
RECURRENT_REFUSAL = "not supported for models with recurrent layers"  # how each refusal begins
MAX_SERVED_NAME_LEN = 256  # a request's `model` is at most this long too


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything `open_engine` needs. Defaults suit the default model on a laptop CPU.

    `model` is a GGUF file, a Hugging Face directory, or None for the default model
    (SmolLM2-135M-Instruct, fetched by `ft pull`). `served_model_name`: the id the model is
    shown as, or several (the first is shown, every one accepted); None: the model's file name
    (`ft.model_names`). `num_pages` overrides the KV budget `kv_cache_memory` (bytes).
    `max_model_len` defaults to the model's context length.
    """

    model: str | None = None
    served_model_name: str | tuple[str, ...] | None = None
    dtype: str = "auto"
    quantize: str | None = None  # "int8": int8 weights for the linear layers (faster, approximate)
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    kv_cache_dtype: str = "auto"  # float16/bfloat16 hold twice the tokens of float32
    # "need": admit on the uncached prompt + one decode token, preempt by recompute when short.
    # "reserve": admit only when pages for the whole budget are free (the old policy, a baseline).
    admission: str = "need"
    max_model_len: int | None = None
    max_running_requests: int = 32
    max_queued_requests: int = 256
    # Seconds a request may wait for its first step before it is refused with 503 (None: no
    # bound); a load balancer then retries it on another replica instead of waiting here.
    max_queue_wait_s: float | None = None
    max_prefill_tokens: int = 1024
    enable_prefix_caching: bool = True
    tokenizer_workers: int = 1
    template_timeout_s: float = DEFAULT_TEMPLATE_TIMEOUT_S  # a render past it is a 400
    compute_threads: int | None = None
    device: str = "auto"
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (CUDA, one rank); False: eager
    # Ranks the model is split across (torch.distributed: NCCL on CUDA, gloo on the CPU).
    tensor_parallel_size: int = 1
    # Seconds work may wait with no step completing (a hung step, rank or scheduler) before the
    # watchdog fails the engine; every configuration (ft/engine/watchdog.py).
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    # Speculative decoding: "ngram" drafts from each request's own prompt and output (prompt
    # lookup) and verifies the drafts in the step; None: off. At most `speculative_tokens`
    # drafted per sequence and step, and only while a step decodes at most
    # `speculative_max_batch` sequences (larger batches are compute-bound already).
    # "draft": a smaller model with the same tokenizer (`speculative_model`, a GGUF file or
    # Hugging Face directory) drafts instead. Either way a measured cost model turns drafting
    # off for a step that would lose by it.
    speculative_method: str | None = None
    speculative_model: str | None = None
    speculative_tokens: int = 8
    speculative_max_batch: int = 4
    pooling: str = "auto"  # how embeddings pool the prompt's hidden states (see `resolve_pooling`)
    # The prompt cache's disk tier: full KV pages go to files in this directory (owned by one
    # server) and come back after evictions and restarts; None: RAM only. Its files never
    # exceed `prompt_cache_size` bytes; a prefix is read back when it holds at least
    # `prompt_cache_min_tokens` tokens past what RAM had.
    prompt_cache_dir: str | None = None
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE
    prompt_cache_min_tokens: int = DEFAULT_PROMPT_CACHE_MIN_TOKENS
    # A model with recurrent layers (LFM2's short convolutions, DeltaNet, Mamba): the slots for
    # snapshots of sequences' states at page boundaries, beyond one per running sequence; a
    # prefix-cache hit on such a model reuses KV only up to a snapshot (0: no prefix reuse).
    state_snapshots: int = DEFAULT_STATE_SNAPSHOTS

    def __post_init__(self) -> None:
        for name in self.served_names:
            if not 0 < len(name) <= MAX_SERVED_NAME_LEN or not name.isprintable() or name != name.strip():
                raise ValueError(
                    f"served_model_name must be 1..{MAX_SERVED_NAME_LEN} printable characters with no "
                    f"space around them, got {name!r}"
                )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, got {self.quantize!r}")
        if self.quantize is not None and self.dtype == "bfloat16":
            raise ValueError("quantize=int8 computes in float32; it cannot be combined with bfloat16")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "q8_0" and (
            self.dtype != "auto"
            or self.quantize is not None
            or self.tensor_parallel_size > 1
            or self.device.startswith("cuda")
        ):
            raise ValueError(Q8_0_KV_PATH)
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if not 1 <= self.page_size <= 1024:
            raise ValueError(f"page_size must be in 1..1024, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2, got {self.num_pages}")
        if self.kv_cache_memory < 1 << 20:
            raise ValueError(f"kv_cache_memory must be at least 1 MiB, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"max_model_len must be at least 16, got {self.max_model_len}")
        if not 1 <= self.max_running_requests <= 1024:
            raise ValueError(f"max_running_requests must be in 1..1024, got {self.max_running_requests}")
        if not 0 <= self.max_queued_requests <= 100_000:
            raise ValueError(f"max_queued_requests must be in 0..100000, got {self.max_queued_requests}")
        if self.max_prefill_tokens < 16:
            raise ValueError(f"max_prefill_tokens must be at least 16, got {self.max_prefill_tokens}")
        if not 1 <= self.tokenizer_workers <= 64:
            raise ValueError(f"tokenizer_workers must be in 1..64, got {self.tokenizer_workers}")
        if not 0.1 <= self.template_timeout_s <= 600.0:
            raise ValueError(f"template_timeout_s must be in 0.1..600, got {self.template_timeout_s}")
        if self.compute_threads is not None and not 1 <= self.compute_threads <= 256:
            raise ValueError(f"compute_threads must be in 1..256, got {self.compute_threads}")
        if not re.fullmatch(DEVICE_PATTERN, self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be in 1..64, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.quantize is not None:
            raise ValueError(
                "quantize=int8 runs in one process; it cannot be combined with tensor parallelism"
            )
        if self.max_queue_wait_s is not None and not 0.1 <= self.max_queue_wait_s <= 86400:
            raise ValueError(f"max_queue_wait_s must be in 0.1..86400, got {self.max_queue_wait_s}")
        if self.pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_CHOICES)}, got {self.pooling!r}")
        if not 1.0 <= self.step_timeout_s <= 3600.0:
            raise ValueError(f"step_timeout_s must be in 1..3600, got {self.step_timeout_s}")
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.speculative_method!r}"
            )
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError(
                "speculative_method draft needs a speculative_model (and a speculative_model "
                "needs speculative_method draft)"
            )
        if not 1 <= self.speculative_tokens <= 32:
            raise ValueError(f"speculative_tokens must be in 1..32, got {self.speculative_tokens}")
        if self.prompt_cache_dir is not None:
            if not self.prompt_cache_dir.strip():
                raise ValueError("prompt_cache_dir must be a directory path, got an empty string")
            if not self.enable_prefix_caching:
                raise ValueError("prompt_cache_dir needs prefix caching (--enable-prefix-caching)")
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "prompt_cache_dir runs in one process; it cannot be combined with tensor parallelism"
                )
        if self.prompt_cache_size < 1 << 20:
            raise ValueError(f"prompt_cache_size must be at least 1 MiB, got {self.prompt_cache_size}")
        if not 1 <= self.prompt_cache_min_tokens <= 1 << 20:
            raise ValueError(
                f"prompt_cache_min_tokens must be in 1..1048576, got {self.prompt_cache_min_tokens}"
            )
        if not 0 <= self.state_snapshots <= MAX_STATE_SNAPSHOTS:
            raise ValueError(
                f"state_snapshots must be in 0..{MAX_STATE_SNAPSHOTS}, got {self.state_snapshots}"
            )
        if not 1 <= self.speculative_max_batch <= 1024:
            raise ValueError(f"speculative_max_batch must be in 1..1024, got {self.speculative_max_batch}")

    @property
    def served_names(self) -> tuple[str, ...]:
        """`served_model_name` as a tuple (empty: none given)."""
        if self.served_model_name is None:
            return ()
        if isinstance(self.served_model_name, str):
            return (self.served_model_name,)
        return self.served_model_name


def resolve_pooling(configured: str, from_model: str | None, *, can_rank: bool = False) -> str:
    """The pooling embedding requests use: the configured one, else the model file's, else last.

    `can_rank`: the model has a classification head (a reranker); rank needs one, and auto picks
    it for a reranker whose file names no pooling.

    Raises:
        ValueError: rank is configured for a model without a classification head.

    NOTE: last-token pooling for a causal LM that does not say: with causal attention only the
    last token's hidden state has seen the whole input (a mean over-weights its beginning), it
    is what decoder embedders trained that way use (Qwen3-Embedding, e5-mistral, gte-Qwen2) and
    what vLLM defaults to for a generative model, and it keeps the prefix cache's hits.
    """
    if configured == "rank" and not can_rank:
        raise ValueError(
            "--pooling rank needs a reranker: a GGUF with a classification head (cls.output.weight) "
            "or a Hugging Face *ForSequenceClassification directory"
        )
    if configured != "auto":
        return configured
    return from_model or ("rank" if can_rank else "last")


# The defaults every command's options show and use: read from the record, written once.
ENGINE_DEFAULTS = EngineConfig()


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (`--max-tokens` of a command that generates:
    0, the prompt scored and nothing generated, is the embedded API's and `/v1/completions`')."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser | Any, *, several: bool = False) -> None:
    """Add the model options every command takes (`--model`, `--dtype`, `--quantize`,
    `--max-model-len`, `--device`, `--enforce-eager`, `--tensor-parallel-size`,
    `--compute-threads`, `--speculative-*`) to `parser` or an argument group of it; defaults
    from `EngineConfig`. `several`: `--model` may be given more than once (`ft serve`; a list,
    None when not given)."""
    d = ENGINE_DEFAULTS
    if several:
        parser.add_argument(
            "--model",
            metavar="PATH",
            action="append",
            default=d.model,
            help="GGUF file or Hugging Face directory, or NAME=PATH; give it more than once to serve "
            "several models (default: SmolLM2-135M-Instruct, fetched by ft pull)",
        )
    else:
        parser.add_argument(
            "--model",
            metavar="PATH",
            default=d.model,
            help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct, fetched by ft pull)",
        )
    parser.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="(default: %(default)s)")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=d.quantize,
        help="int8 weights for the linear layers: ~2-3x faster decode, approximate output (default: off)",
    )
    parser.add_argument(
        "--max-model-len",
        metavar="N",
        type=int,
        default=d.max_model_len,
        help="context length, prompt and output (default: the model's)",
    )
    parser.add_argument(
        "--device",
        metavar="{auto,cpu,cuda,cuda:N}",
        default=d.device,
        help="auto, cpu, cuda or cuda:N; auto is CUDA when torch sees a GPU (default: %(default)s)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=not d.cuda_graphs,
        help="on CUDA, run every step eagerly instead of replaying decode steps as CUDA graphs "
        "(default: off)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        metavar="N",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model across N ranks (processes) with torch.distributed (default: %(default)s)",
    )
    parser.add_argument(
        "--compute-threads",
        metavar="N",
        type=int,
        default=d.compute_threads,
        help="CPU threads a step computes with, fixed (default: measured, the faster count per batch size)",
    )
    parser.add_argument(
        "--speculative-method",
        choices=SPECULATIVE_METHODS,
        default=d.speculative_method,
        help="speculative decoding: ngram drafts from each request's prompt and output (prompt "
        "lookup), draft from --speculative-model; the output is unchanged (default: off)",
    )
    parser.add_argument(
        "--speculative-model",
        metavar="PATH",
        default=d.speculative_model,
        help="the draft model of --speculative-method draft: a smaller GGUF file or Hugging Face "
        "directory with the model's tokenizer (default: none)",
    )
    parser.add_argument(
        "--speculative-tokens",
        metavar="N",
        type=int,
        default=d.speculative_tokens,
        help="the most tokens drafted per request and step; each request adapts below it to what "
        "it accepts (default: %(default)s)",
    )
    parser.add_argument(
        "--speculative-max-batch",
        metavar="N",
        type=int,
        default=d.speculative_max_batch,
        help="draft only in steps decoding at most N requests; below it a measured cost model "
        "drafts only when it saves time (default: %(default)s)",
    )


def model_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields the model options set."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "max_model_len": args.max_model_len,
        "device": args.device,
        "tensor_parallel_size": args.tensor_parallel_size,
        "cuda_graphs": not args.enforce_eager,
        "compute_threads": args.compute_threads,
        "speculative_method": args.speculative_method,
        "speculative_model": args.speculative_model,
        "speculative_tokens": args.speculative_tokens,
        "speculative_max_batch": args.speculative_max_batch,
    }
