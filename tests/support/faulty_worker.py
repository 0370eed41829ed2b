"""Test doubles of the worker jobs (`EngineHooks.tokenize_job`, `EngineHooks.grammar_job`).

They run where the real jobs run (a worker process, or in-process with `run_inline`), so they
live at module level (a spawned worker imports them by name) and import nothing heavy. The
tokenizer double misbehaves for a text prompt that starts with a fault's marker and runs the
real job for any other prompt.
"""

from __future__ import annotations

import os
import signal
import time

from ft.tokenizer.codec import decode_job
from ft.tokenizer.job import tokenize_job

EXIT = "!exit"  # the worker process dies mid-job
RAISE = "!raise"  # the job raises (a bug in it)
HANG = "!hang"  # the job never ends, whatever its render deadline says
EXIT_STATUS = 17


def faulty_tokenize_job(payload: bytes) -> bytes:
    """`tokenize_job`, but for a text prompt starting with `EXIT`, `RAISE` or `HANG`."""
    text = decode_job(payload).prompt.text or ""
    if text.startswith(EXIT):
        os._exit(EXIT_STATUS)
    if text.startswith(RAISE):
        raise RuntimeError("injected tokenizer fault")
    if text.startswith(HANG):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            time.sleep(1.0)
    return tokenize_job(payload)


def crashing_grammar_job(payload: bytes) -> bytes:
    """A grammar compiler that crashes its process, whatever the grammar."""
    os._exit(EXIT_STATUS)
