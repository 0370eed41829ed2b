"""`ft chat` and `ft generate` in a pseudo-terminal (pexpect), on the real default model."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).parents[1]  # `python -m ft.cli` imports this checkout's `ft`
QUESTION = "What is the capital of France?"
PROMPT = "\r\n> "

pytestmark = pytest.mark.slow


def default_signals() -> None:
    """In the child before it runs: SIGINT and SIGTERM as a terminal's shell leaves them. An
    ignored signal stays ignored across exec, and one that the test process ignores (something
    earlier in the suite set it so) made `ft generate` deaf to Ctrl-C: it ran to its end, 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def spawn(*args: str) -> pexpect.spawn:
    """`ft ARGS...` in a pseudo-terminal, greedy and short."""
    return pexpect.spawn(
        sys.executable,
        ["-m", "ft.cli", *args, "--temperature", "0"],
        cwd=str(ROOT),
        encoding="utf-8",
        timeout=180,
        dimensions=(40, 400),
        preexec_fn=default_signals,
    )


@contextmanager
def open_chat(max_tokens: int) -> Iterator[pexpect.spawn]:
    """An `ft chat` session at its first prompt (the model loaded)."""
    child = spawn("chat", "--max-tokens", str(max_tokens))
    try:
        child.expect_exact("/reset clears the conversation")
        child.expect_exact("> ")
        yield child
    finally:
        child.close(force=True)


def exit_status(child: pexpect.spawn, guard_s: float = 60) -> int | None:
    """The status `child` exits with on its own once its output has ended (EOF read).

    NOTE: `close()` on a live child waits 0.1 s, then sends SIGHUP and SIGINT: a process still
    tearing down (threads, torch) on a loaded machine was killed by them and read as a failure.
    `guard_s` only guards against a child that never exits.
    """
    deadline = time.monotonic() + guard_s
    while child.isalive():
        assert time.monotonic() < deadline, f"the child still runs {guard_s} s after its output ended"
        time.sleep(0.05)
    child.close()
    status: int | None = child.exitstatus
    return status


def ask(child: pexpect.spawn, line: str, timeout: float = 120) -> str:
    """Send `line`; return the answer printed before the next prompt."""
    child.sendline(line)
    child.expect_exact(line + "\r\n")  # the terminal's echo
    child.expect_exact(PROMPT, timeout=timeout)
    return str(child.before).strip()


def test_generate_prints_the_completion_and_exits_zero() -> None:
    """`ft generate` prints the completion (greedy, as the README shows) and exits 0."""
    child = spawn("generate", "The capital of France is", "--max-tokens", "4")
    child.expect(pexpect.EOF)
    assert exit_status(child) == 0
    assert "Paris" in str(child.before)


def test_chat_names_the_model_by_the_id_the_server_serves() -> None:
    """`ft chat` opens with the model's id, the one `ft serve` shows and accepts, and takes
    `--compute-threads` as `ft serve` and `ft bench` do."""
    child = spawn("chat", "--max-tokens", "1", "--compute-threads", "1")
    try:
        child.expect_exact("SmolLM2-135M-Instruct.Q4_1 — /reset clears the conversation")
    finally:
        child.close(force=True)


def test_generate_streams_and_ctrl_c_stops_it() -> None:
    """Words arrive while `ft generate` still generates; Ctrl-C stops it (status 130)."""
    child = spawn("generate", "Once upon a time", "--max-tokens", "2000")
    child.expect(r"\w+\W+\w+\W+\w+\W+\w+")
    assert child.isalive()
    child.sendintr()
    child.expect(pexpect.EOF, timeout=60)
    assert exit_status(child) == 130
    assert "Traceback" not in str(child.before)


def test_chat_keeps_the_history_until_reset() -> None:
    """A question asked after another turn sees that turn; after /reset it is asked afresh,
    exactly as `ft generate --chat` answers it alone (greedy)."""
    alone = spawn("generate", QUESTION, "--chat", "--max-tokens", "24")
    alone.expect(pexpect.EOF)
    assert exit_status(alone) == 0
    alone_answer = str(alone.before).strip().splitlines()[-1].strip()
    with open_chat(24) as chat:
        ask(chat, "Hello! I like trains.")
        with_history = ask(chat, QUESTION)
        chat.sendline("/reset")
        chat.expect_exact("(conversation cleared)")
        chat.expect_exact(PROMPT)
        fresh = ask(chat, QUESTION)
        assert fresh == alone_answer
        assert with_history != fresh
        chat.sendline("")
        chat.expect(pexpect.EOF)
        assert exit_status(chat) == 0


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on() -> None:
    """Ctrl-C while an answer streams stops it at once and returns to the prompt; the next
    question is answered; Ctrl-C at the prompt quits with status 0."""
    with open_chat(2000) as chat:
        chat.sendline("Write a very long story about a dragon who learns to cook.")
        chat.expect_exact("cook.\r\n")
        chat.expect(r"\w+\W+\w+\W+\w+")  # the answer streams: words arrive before it is done
        chat.sendintr()
        chat.expect_exact("(stopped)", timeout=60)
        chat.expect_exact(PROMPT)
        assert ask(chat, QUESTION)
        chat.sendintr()
        chat.expect(pexpect.EOF)
        assert exit_status(chat) == 0
