"""The job a tokenizer worker process runs: render the chat template, tokenize, reply in CBOR.

Kept free of torch and trio so worker processes start fast and stay small.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable

import cbor2
from tokenizers import Tokenizer

from ft.errors import InvalidRequest
from ft.grammar.spec import GrammarSpec
from ft.tokenizer.codec import TokenizeJob, decode_job, encode_result
from ft.tokenizer.spec import TokenizerSpec
from ft.tokenizer.template import render_chat

# Stands in for the content of the message to continue; it renders last, so `rfind` finds it.
CONTINUE_MARKER = "\x00ft:continue-final-message\x00"

# Runs a tokenizer job (a function of CBOR bytes) somewhere and returns its CBOR answer: in a
# worker process (the engine's default), or in-process for tests.
Executor = Callable[[Callable[[bytes], bytes], bytes], Awaitable[bytes]]

_loaded: dict[str, tuple[Tokenizer, TokenizerSpec]] = {}


def ignore_stop_signals() -> None:
    """A worker's start-up: ignore SIGINT and SIGTERM, which are for the serving process.

    A Ctrl-C in a terminal and a SIGTERM sent to the process group reach the workers too; they
    must keep tokenizing while the server drains, and they exit when the server closes them.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def load_spec(spec_path: str) -> tuple[Tokenizer, TokenizerSpec]:
    """The tokenizer and its spec, cached per process by file path."""
    hit = _loaded.get(spec_path)
    if hit is None:
        with open(spec_path, "rb") as f:
            fields = cbor2.load(f)
        spec = TokenizerSpec(**fields | {"eos_token_ids": tuple(fields["eos_token_ids"])})
        hit = (Tokenizer.from_str(spec.tokenizer_json), spec)
        _loaded[spec_path] = hit
    return hit


def render_prompt(job: TokenizeJob, spec: TokenizerSpec) -> tuple[str, bool]:
    """The text to tokenize, and whether a BOS token must be prepended to it."""
    if job.messages is None:
        assert job.prompt is not None
        return job.prompt, spec.add_bos_token
    messages = job.messages
    if job.continue_final_message:
        # Render the last message closed around a marker, then cut at the marker: what the
        # template put before the message's content stays, its end-of-turn goes.
        messages = [*messages[:-1], messages[-1] | {"content": CONTINUE_MARKER}]
    text = render_chat(
        spec.chat_template,
        messages,
        tools=job.tools,
        add_generation_prompt=job.add_generation_prompt,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        extra=job.chat_template_kwargs,
    )
    if job.continue_final_message:
        cut = text.rfind(CONTINUE_MARKER)
        if cut < 0:
            raise InvalidRequest(
                "the chat template does not render the final message's content, so it cannot be continued",
                param="messages",
            )
        text = text[:cut] + (job.messages[-1].get("content") or "")
    return text, False


def tokenize_job(payload: bytes) -> bytes:
    """Worker entry point: CBOR job in, CBOR token ids (or a refusal) out."""
    job = decode_job(payload)
    if job.fault == "exit":  # test hook: the worker process dies mid-job
        os._exit(17)
    if job.fault == "raise":  # test hook: the job crashes
        raise RuntimeError("injected tokenizer fault")
    tokenizer, spec = load_spec(job.spec_path)
    try:
        text, add_bos = render_prompt(job, spec)
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    except InvalidRequest as e:
        return encode_result(error=e.message, param=e.param)
    if add_bos and spec.bos_token is not None:
        bos = tokenizer.token_to_id(spec.bos_token)
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
    return encode_result(ids)


def check_grammar_job(payload: bytes) -> bytes:
    """Worker entry point: compile a grammar spec, compute its first mask and walk it
    (`ft.grammar.compiled.walk`), with the tokenizer of the spec file tokenize jobs read.

    CBOR in: `spec_path`, `vocab_size`, `kind`, `source`. CBOR out: `grammar` (llguidance's
    text of it) or `error`. The caller kills the worker past its deadline.
    """
    # Imported here: llguidance and numpy load only in a worker that compiles a grammar.
    from ft.grammar.compiled import compile_matcher, grammar_text, grammar_tokenizer, token_lengths, walk

    job = cbor2.loads(payload)
    if job.get("fault") == "exit":  # test hook: the compiler crashes the process
        os._exit(17)
    _, spec = load_spec(job["spec_path"])
    vocab_size = job["vocab_size"]
    try:
        text = grammar_text(GrammarSpec(job["kind"], job["source"]))
        tokenizer = grammar_tokenizer(spec.tokenizer_json, vocab_size, spec.eos_token_ids)
        lengths = token_lengths(tokenizer, vocab_size)
        walk(compile_matcher(text, tokenizer, vocab_size), vocab_size, spec.eos_token_ids, lengths)
    except ValueError as e:
        return cbor2.dumps({"error": str(e)})
    return cbor2.dumps({"grammar": text})


def warm_grammar_job(payload: bytes) -> bytes:
    """Worker entry point: load what `check_grammar_job` needs (the tokenizer, llguidance's
    view of it, its token lengths), so that the check's deadline does not pay for it.

    CBOR in: `spec_path`, `vocab_size`. CBOR out: an empty map.
    """
    from ft.grammar.compiled import grammar_tokenizer, token_lengths

    job = cbor2.loads(payload)
    _, spec = load_spec(job["spec_path"])
    vocab_size = job["vocab_size"]
    token_lengths(grammar_tokenizer(spec.tokenizer_json, vocab_size, spec.eos_token_ids), vocab_size)
    return cbor2.dumps({})


def grammar_payload(grammar: GrammarSpec, spec_path: str, vocab_size: int, fault: str | None = None) -> bytes:
    """The CBOR job `check_grammar_job` reads."""
    job = {"spec_path": spec_path, "vocab_size": vocab_size, "kind": grammar.kind, "source": grammar.source}
    return cbor2.dumps(job | ({"fault": fault} if fault else {}))
