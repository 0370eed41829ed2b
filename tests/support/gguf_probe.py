"""Load a GGUF as `ft` does and generate a few greedy tokens, in a process of its own.

`python -m tests.support.gguf_probe` reads one request per line on stdin (`PATH DTYPE STEPS`) and
answers each with one JSON line: `{"outcome": "loaded", "tokens": [...]}`, `{"outcome":
"refused", "error": ..., "message": ...}` for a `ValueError` (the loader's named errors), or
`{"outcome": "raised", ...}` for any other exception. A signal, a hang or a blown memory limit
ends the process, which `Prober` (the parent's side) reports as such: the tests turn every one of
those, and "raised", into a failure.
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
import time
import traceback
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).parents[2]
PROMPT = "Hello there"
# Address space for one probe process: torch and a load of the default model fit well within it;
# a file that makes the loader allocate without bound hits it and fails the case instead of
# the machine.
MEMORY_LIMIT = 6 << 30


def probe(path: str, dtype: str, steps: int) -> dict[str, object]:
    """Load `path` with `dtype` ("auto": packed weights when the file is quantized) and
    generate `steps` greedy tokens after `PROMPT`."""
    from ft.config import EngineConfig
    from ft.core.batch import SeqWork
    from ft.engine.loading import load_torch_model
    from ft.params import SamplingParams
    from ft.tokenizer.spec import build_tokenizer

    try:
        parts = load_torch_model(EngineConfig(model=path, dtype=dtype, compute_threads=1))
    except ValueError as e:
        return {"outcome": "refused", "error": type(e).__name__, "message": str(e)}
    runner = parts.make_runner(8, 16)
    ids = build_tokenizer(parts.tokenizer.tokenizer_json).encode(PROMPT).ids or [0]
    params = SamplingParams(temperature=0.0, max_tokens=steps)
    tokens: list[int] = []
    feed, start = list(ids), 0
    pages = tuple(range(8))
    for _ in range(steps):
        work = SeqWork(0, tuple(feed), start, pages, True, params, len(tokens))
        (sampled,) = runner.step([work])
        tokens.append(sampled.token_id)
        start += len(feed)
        feed = [sampled.token_id]
    return {"outcome": "loaded", "tokens": tokens, "vocab_size": parts.vocab_size}


def _serve() -> None:
    for line in sys.stdin:
        path, dtype, steps = line.split()
        try:
            answer = probe(path, dtype, int(steps))
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


class Prober:
    """A probe process kept across cases (torch imports once); restarted after it dies.

    `sanitized`: the kernels are built with ASan/UBSan (`FT_KERNELS_SANITIZE=1`) and the ASan
    runtime is preloaded; then no address-space limit (ASan reserves terabytes of shadow).
    """

    def __init__(self, *, sanitized: bool = False, env: dict[str, str] | None = None) -> None:
        self.sanitized = sanitized
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr_path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"ft-probe-{os.getpid()}.err"

    def _start(self) -> subprocess.Popen[bytes]:
        env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | self.env
        self.stderr = self.stderr_path.open("wb")
        return subprocess.Popen(
            [sys.executable, "-m", "tests.support.gguf_probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            cwd=ROOT,
            env=env,
            preexec_fn=None if self.sanitized else _limit_memory,
        )

    def run(self, path: pathlib.Path, dtype: str = "auto", steps: int = 3, timeout_s: float = 60) -> Outcome:
        """Probe `path`; a process that dies or outlives `timeout_s` is reported, then replaced."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{path} {dtype} {steps}\n".encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self.close()
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
        )

    def close(self) -> None:
        """Kill the probe process (synchronous)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _serve()
