"""Load a GGUF as `ft` does and generate a few greedy tokens, in a process of its own.

`python -m tests.support.gguf_probe` reads one request per line on stdin and answers each with
one JSON line. `load PATH DTYPE STEPS [KV]`: `{"outcome": "loaded", "tokens": [...]}`, `{"outcome":
"refused", "error": ..., "message": ...}` for a `ValueError` (the loader's named errors), or
`{"outcome": "raised", ...}` for any other exception. `lies PATH`: the packed model of `PATH`
driven through the kernels with sizes that disagree (`native_lies`): "refused" when every call
raised `KernelError`. `overflow`: a kernel call with a buffer smaller than its sizes say (the
kernels cannot see buffers), to show that a sanitized process dies of it. A signal, a hang or a
blown memory limit ends the process, which `Prober` (the parent's side) reports as such: the
tests turn every one of those, and "raised", into a failure.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).parents[2]
PROMPT = "Hello there"
# Address space for one probe process: torch and a load of the default model fit well within it;
# a file that makes the loader allocate without bound hits it and fails the case instead of
# the machine.
MEMORY_LIMIT = 6 << 30


def probe(path: str, dtype: str, steps: int, kv_cache_dtype: str = "auto") -> dict[str, object]:
    """Load `path` with `dtype` ("auto": packed weights when the file is quantized) and KV cache
    `kv_cache_dtype`, and generate `steps` greedy tokens after `PROMPT`."""
    from ft.config import EngineConfig
    from ft.core.batch import SeqWork
    from ft.engine.loading import load_torch_model
    from ft.params import SamplingParams
    from ft.tokenizer.spec import build_tokenizer

    try:
        config = EngineConfig(model=path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, compute_threads=1)
        parts = load_torch_model(config)
    except ValueError as e:
        return {"outcome": "refused", "error": type(e).__name__, "message": str(e)}
    runner = parts.make_runner(8, 16)
    # Within the file's context (an edit may make it a token or two), as the engine would keep it.
    context = max(1, runner.config.max_position_embeddings)
    ids = (build_tokenizer(parts.tokenizer.tokenizer_json).encode(PROMPT).ids or [0])[:context]
    params = SamplingParams(temperature=0.0, max_tokens=steps)
    tokens: list[int] = []
    feed, start = list(ids), 0
    pages = tuple(range(8))
    room = context - len(ids) + 1  # tokens the context leaves to generate (the last fed at its end)
    for _ in range(min(steps, room)):
        work = SeqWork(0, tuple(feed), start, pages, True, params, len(tokens))
        (sampled,) = runner.step([work])
        tokens.append(sampled.token_id)
        start += len(feed)
        feed = [sampled.token_id]
    return {"outcome": "loaded", "tokens": tokens, "vocab_size": parts.vocab_size, "room": room}


def native_lies(path: str) -> dict[str, object]:
    """Drive the packed kernels with sizes that disagree with the weights and buffers (a loader
    check bypassed); each call must raise `KernelError` before touching memory."""
    import dataclasses

    import torch

    from ft.model import kernels
    from ft.model.loader import load_model
    from ft.model.quant import QuantTensor
    from ft.model.quantized_llama import QuantizedLlama, StepIndex

    loaded = load_model(path, torch.float32, quantized=True)
    c = loaded.config
    k_cache = torch.zeros(c.num_layers, 64, c.num_kv_heads, c.head_dim)
    v_cache = torch.zeros_like(k_cache)
    good = StepIndex(
        slot_of=torch.tensor([0, 1]), seq=torch.tensor([0, 0]), positions=torch.tensor([0, 1]),
        block_tables=torch.tensor([[0]], dtype=torch.int32),
    )  # fmt: skip
    ids = torch.tensor([1, 2])
    lies: dict[str, object] = {
        "kv heads": (dataclasses.replace(c, num_kv_heads=1), good),
        "heads": (dataclasses.replace(c, num_heads=c.num_heads * 2, num_kv_heads=c.num_kv_heads * 2), good),
        "ffn": (dataclasses.replace(c, intermediate_size=c.intermediate_size * 256), good),
        "head dim": (dataclasses.replace(c, head_dim=c.head_dim // 2), good),
        "slot": (c, dataclasses.replace(good, slot_of=torch.tensor([0, 10**6]))),
        "page": (c, dataclasses.replace(good, block_tables=torch.tensor([[999]], dtype=torch.int32))),
        "sequence": (c, dataclasses.replace(good, seq=torch.tensor([0, 5]))),
        "position": (c, dataclasses.replace(good, positions=torch.tensor([0, 10**9]))),
    }
    messages: dict[str, str] = {}
    for name, (config, index) in lies.items():  # type: ignore[misc]
        try:
            QuantizedLlama(config, loaded.state_dict).forward(ids, index, k_cache, v_cache, 16)
        except kernels.KernelError as e:
            messages[name] = str(e)
    # q8_0 KV: a step over whole blocks runs; slots one byte short of their blocks are refused.
    blocks = torch.zeros(c.num_layers, 64, c.num_kv_heads, c.head_dim // 32 * 34, dtype=torch.uint8)
    QuantizedLlama(c, loaded.state_dict).forward(ids, good, blocks, blocks.clone(), 16)
    try:
        short = blocks[..., :-1].contiguous()
        QuantizedLlama(c, loaded.state_dict).forward(ids, good, short, short.clone(), 16)
    except kernels.KernelError as e:
        messages["q8_0 slots"] = str(e)
    embed = loaded.state_dict["model.embed_tokens.weight"]
    assert isinstance(embed, QuantTensor)
    try:
        kernels.dequantize_rows(embed, torch.tensor([embed.rows]))
    except kernels.KernelError as e:
        messages["row id"] = str(e)
    wide = dataclasses.replace(embed, cols=embed.cols * 2)
    x = kernels.QuantizedActivations(torch.ones(1, wide.cols))
    try:
        kernels.gemm_into(torch.empty(1, embed.rows), wide, x)
    except kernels.KernelError as e:
        messages["row bytes"] = str(e)
    missing = sorted({*lies, "q8_0 slots", "row id", "row bytes"} - messages.keys())
    if missing:
        return {"outcome": "raised", "error": "NoKernelError", "message": f"accepted: {missing}"}
    return {"outcome": "refused", "error": "KernelError", "message": json.dumps(messages)}


def formats() -> dict[str, object]:
    """Every type the kernels multiply, products and row lookups over buffers of exactly their
    sizes (random bytes, finite scales), by rows and repacked into column groups: tiles of 1 to 9
    and 17 rows, K of one super-block and more, so that a sanitizer sees any read past a row, a
    block or a group."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    from ft.model import kernels
    from ft.model.quant import KERNEL_TYPES, QuantTensor

    rng = np.random.default_rng(0)
    done = []
    for qtype, name in KERNEL_TYPES.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        for k in (256, 768, 2304):
            # 5 rows (the row kernels), and 32 repacked into the column kernels' groups where
            # this build has them for the type (whole groups of 16 or 8)
            for rows in (5, 32):
                raw = rng.integers(0, 256, size=(rows, k // block * size), dtype=np.uint8)
                if qtype not in (1, 30):  # scales: finite small halves wherever an fp16 field may sit
                    raw.view(np.uint16)[...] &= 0x3BFF
                w = kernels.repacked(QuantTensor(torch.from_numpy(raw), qtype, k))
                if rows == 32 and not w.columns:
                    continue
                for m in (*range(1, 10), 17):
                    x = kernels.QuantizedActivations(torch.randn(m, k))
                    out = torch.empty(m, w.rows)
                    kernels.gemm_into(out, w, x)
                kernels.dequantize_rows(w, torch.tensor([0, 4, 2, rows - 1]))
        done.append(name)
    return {"outcome": "loaded", "message": " ".join(done)}


def nonfinite() -> dict[str, object]:
    """Activations holding NaN, +Inf and -Inf (a file's huge finite scales can overflow the
    hidden states) quantized and multiplied: defined integer blocks, no float cast out of range."""
    import math

    import torch

    from ft.model import kernels
    from ft.model.quant import to_q8_0

    x = torch.randn(3, 96)
    x[0, 5], x[1, 40], x[2, 70], x[2, 71] = math.nan, math.inf, -math.inf, math.nan
    acts = kernels.QuantizedActivations(x)
    w = to_q8_0(torch.randn(4, 96).numpy())
    out = torch.empty(3, 4)
    kernels.gemm_into(out, w, acts)
    return {"outcome": "loaded", "message": f"{acts.qs.abs().max().item()}"}


def overflow() -> dict[str, object]:
    """An rms norm told of two rows over a buffer of one: only a sanitizer can see it."""
    import torch

    from ft.model import kernels

    x, weight = torch.ones(1, 64), torch.ones(64)
    out = torch.empty(2, 64)
    lib = kernels.library()
    kernels.check(lib, lib.ft_rms_norm(x.data_ptr(), 2, 64, 64, weight.data_ptr(), 64, 1e-5, out.data_ptr()))
    return {"outcome": "loaded", "message": "no sanitizer report"}


def _serve() -> None:
    for line in sys.stdin:
        command, *args = line.split()
        try:
            if command == "lies":
                answer = native_lies(args[0])
            elif command == "formats":
                answer = formats()
            elif command == "nonfinite":
                answer = nonfinite()
            elif command == "overflow":
                answer = overflow()
            else:
                answer = probe(args[0], args[1], int(args[2]), *args[3:])
        except Exception as e:  # reported to the test, which fails on it
            answer = {"outcome": "raised", "error": type(e).__name__, "message": traceback.format_exc()}
        print(json.dumps(answer), flush=True)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one probe ended: `kind` is loaded, refused, raised, signal, exit or timeout."""

    kind: str
    detail: str
    tokens: tuple[int, ...] = ()
    vocab_size: int = 0
    room: int = 0  # tokens the file's context left to generate after the prompt


def assert_clean(outcome: Outcome) -> None:
    """A named error, or a load whose generation produced in-vocabulary tokens."""
    assert outcome.kind in ("loaded", "refused"), f"{outcome.kind}: {outcome.detail}"
    if outcome.kind == "loaded":
        # the 3 asked, fewer only when the file's context ends first
        assert len(outcome.tokens) == min(3, outcome.room)
        assert all(0 <= t < outcome.vocab_size for t in outcome.tokens)


def assert_refused(outcome: Outcome, *names: str) -> None:
    """A named error (`ModelFileError`) that mentions every one of `names`."""
    assert outcome.kind == "refused", f"{outcome.kind}: {outcome.detail}"
    for name in names:
        assert name in outcome.detail, outcome.detail


class Prober:
    """A probe process kept across cases (torch imports once); restarted after it dies.

    `sanitized`: the kernels are built with ASan/UBSan (`FT_KERNELS_SANITIZE=1`) and the ASan
    runtime is preloaded; then no address-space limit (ASan reserves terabytes of shadow).
    """

    def __init__(self, *, sanitized: bool = False, env: dict[str, str] | None = None) -> None:
        self.sanitized = sanitized
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        fd, name = tempfile.mkstemp(prefix="ft-probe-", suffix=".err")
        os.close(fd)
        self.stderr_path = pathlib.Path(name)  # the probe's stderr, read when it dies

    def _start(self) -> subprocess.Popen[bytes]:
        env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | self.env
        with self.stderr_path.open("wb") as stderr:
            return subprocess.Popen(
                [sys.executable, "-m", "tests.support.gguf_probe"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=ROOT,
                env=env,
                preexec_fn=None if self.sanitized else _limit_memory,
            )

    def run(
        self, path: pathlib.Path, dtype: str = "auto", steps: int = 3, timeout_s: float = 60, kv: str = "auto"
    ) -> Outcome:
        """Load `path` and generate `steps` tokens over a KV cache of `kv` (see `probe`)."""
        return self.ask(f"load {path} {dtype} {steps} {kv}", timeout_s)

    def ask(self, request: str, timeout_s: float = 60) -> Outcome:
        """Send one request line; a process that dies or outlives `timeout_s` is reported, then
        replaced."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{request}\n".encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self._stop()
                return Outcome("timeout", f"no answer within {timeout_s} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                code = self.proc.wait()
                self.proc = None
                err = self.stderr_path.read_bytes().decode(errors="replace")[-4000:]
                if code < 0:
                    return Outcome("signal", f"{signal.Signals(-code).name}\n{err}")
                return Outcome("exit", f"exit {code}\n{err}")
            line += chunk
        answer = json.loads(line)
        return Outcome(
            answer["outcome"],
            answer.get("message", ""),
            tuple(answer.get("tokens", ())),
            int(answer.get("vocab_size", 0)),
            int(answer.get("room", 0)),
        )

    def close(self) -> None:
        """Kill the probe process (synchronous)."""
        self._stop()
        self.stderr_path.unlink(missing_ok=True)

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _serve()
