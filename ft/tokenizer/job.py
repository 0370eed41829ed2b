"""The job a tokenizer worker process runs: render the chat template, tokenize, reply in CBOR.

Kept free of torch and trio so worker processes start fast and stay small.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import cbor2
from tokenizers import Tokenizer

from ft.errors import InvalidRequest
from ft.grammar.spec import GrammarSpec
from ft.prompt import PromptSpec
from ft.tokenizer.bounds import TextBounds, cut_points, text_bounds, too_long
from ft.tokenizer.codec import TOO_LONG, decode_job, decode_slice_job, encode_result
from ft.tokenizer.spec import TokenizerSpec
from ft.tokenizer.template import TemplateTimeout, render_chat

# Stands in for the content of the message to continue; it renders last, so `rfind` finds it.
CONTINUE_MARKER = "\x00ft:continue-final-message\x00"

# Runs a tokenizer job (a function of CBOR bytes) somewhere and returns its CBOR answer: in a
# worker process (the engine's default), or in-process for tests.
Executor = Callable[[Callable[[bytes], bytes], bytes], Awaitable[bytes]]

# The memory a worker may map for data (RLIMIT_DATA): a worker maps ~0.2 GiB with the default
# model's tokenizer loaded, and peaks at ~0.9 GiB rendering and encoding a 4 MiB chat prompt.
WORKER_MEMORY_BYTES = 2 << 30
# The longest text a worker tokenizes, in UTF-8 bytes: ~1 Mi tokens of English, past any
# context window. Encoding costs up to ~160 bytes of memory per byte of text (measured on the
# default model's tokenizer: 4 Mi characters of CJK or emoji, 12 MiB and 16 MiB, peaked at
# 2.5 and 3.1 GiB), and the tokenizer aborts the process when an allocation fails: so a longer
# text is refused before it is encoded, and what is encoded fits the memory bound above.
MAX_TEXT_BYTES = 4 << 20
# Seconds between checks that the serving process is still this worker's parent.
PARENT_POLL_S = 1.0
EXIT_ORPHANED = 70  # a worker's exit status once its serving process is gone

# A conversation of every common shape, rendered once at load (`check_template_job`).
SAMPLE_CONVERSATIONS: tuple[list[dict[str, Any]], ...] = (
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is the weather in Paris?"},
    ],
    [  # for templates that refuse a system message (they call `raise_exception`)
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is the weather in Paris?"},
    ],
)
# A system message in the middle of a conversation (Anthropic's mid-conversation system turns):
# a template renders it in place when the marker comes out between the turns around it.
MID_SYSTEM_MARKER = "ft:mid-conversation-system"
MID_SYSTEM_CONVERSATION: list[dict[str, Any]] = [
    *SAMPLE_CONVERSATIONS[0][:3],
    {"role": "system", "content": MID_SYSTEM_MARKER},
    SAMPLE_CONVERSATIONS[0][3],
]
SAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

_loaded: dict[str, tuple[Tokenizer, TokenizerSpec]] = {}
_bounds: dict[str, TextBounds] = {}
_template_timeout_s: float | None = None  # set in a worker by `init_worker`; None: no deadline
_must_retire = False  # the worker ran out of memory: replace it after this job


def init_worker(template_timeout_s: float, memory_bytes: int) -> None:
    """A worker's start-up: its signals, its memory bound, its render deadline, its parent watch.

    SIGINT and SIGTERM are for the serving process: a Ctrl-C in a terminal and a SIGTERM sent
    to the process group reach the workers too, and they must keep tokenizing while the server
    drains; the server kills the busy ones when it stops. The worker exits by itself as soon
    as the serving process is gone (even SIGKILLed), so none outlives it.
    """
    global _template_timeout_s
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard == resource.RLIM_INFINITY or memory_bytes < hard:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, hard))
    _template_timeout_s = template_timeout_s
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    # NOTE: not prctl(PR_SET_PDEATHSIG): its "parent" is the thread that spawned the process,
    # and trio-parallel spawns workers from trio's worker threads, which exit when idle (10 s),
    # killing every worker they started. The sentinel is a pipe whose other end only the
    # parent holds: it reads as closed the moment the parent dies; the pid check is a fallback.
    parent = multiprocessing.parent_process()
    sentinels = [parent.sentinel] if parent is not None and parent.sentinel is not None else []
    while os.getppid() == parent_pid:
        if sentinels and multiprocessing.connection.wait(sentinels, timeout=PARENT_POLL_S):
            break
        if not sentinels:
            time.sleep(PARENT_POLL_S)
    os._exit(EXIT_ORPHANED)


def retire_worker() -> bool:
    """Called by trio-parallel after each job: whether this worker must be replaced (it ran out
    of memory, and a process past a `MemoryError` is not trusted with the next job)."""
    return _must_retire


@contextmanager
def _render_deadline() -> Iterator[None]:
    """Raise `TemplateTimeout` in the render once `_template_timeout_s` passes (in a worker).

    A timer signal interrupts the template's Python loops; what runs as one long C call is
    bounded by the sandbox (`ft.tokenizer.template`), and the caller kills the worker past its
    own, longer deadline whatever the job does.
    """
    timeout = _template_timeout_s
    if timeout is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TemplateTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _timeout_message() -> str:
    return f"the chat template took longer than {_template_timeout_s:g} s to render"


def _out_of_memory_message(what: str) -> str:
    global _must_retire
    _must_retire = True
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    bound = f" ({limit >> 20} MiB)" if limit != resource.RLIM_INFINITY else ""
    return f"{what} needs more memory than a tokenizer worker may use{bound}"


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


def load_bounds(spec_path: str) -> TextBounds:
    """The text bounds of a spec file's tokenizer, cached per process by file path."""
    hit = _bounds.get(spec_path)
    if hit is None:
        hit = _bounds[spec_path] = text_bounds(load_spec(spec_path)[1].tokenizer_json)
    return hit


def render_prompt(prompt: PromptSpec, spec: TokenizerSpec) -> tuple[str, bool]:
    """The text to tokenize, and whether a BOS token must be prepended to it."""
    if prompt.messages is None:
        assert prompt.text is not None
        return prompt.text, spec.add_bos_token and prompt.add_bos
    messages = list(prompt.messages)
    if prompt.continue_final_message:
        # Render the last message closed around a marker, then cut at the marker: what the
        # template put before the message's content stays, its end-of-turn goes.
        messages[-1] = messages[-1] | {"content": CONTINUE_MARKER}
    text = render_chat(
        spec.chat_template,
        messages,
        tools=list(prompt.tools) if prompt.tools is not None else None,
        add_generation_prompt=prompt.add_generation_prompt,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        extra=dict(prompt.chat_template_kwargs),
    )
    if prompt.continue_final_message:
        cut = text.rfind(CONTINUE_MARKER)
        if cut < 0:
            raise InvalidRequest(
                "the chat template does not render the final message's content, so it cannot be continued",
                param="messages",
            )
        text = text[:cut] + str(prompt.messages[-1].get("content") or "")
    return text, False


def tokenize_job(payload: bytes) -> bytes:
    """Worker entry point: CBOR job in, CBOR token ids (or a refusal) out.

    A text that must have more than the job's `max_tokens` tokens by its bytes is refused
    before it is tokenized; a long one is tokenized up to its first cut only, and its rest
    returned to be tokenized a slice at a time (`ft.tokenizer.bounds`, `tokenize_slice_job`).
    """
    job = decode_job(payload)
    tokenizer, spec = load_spec(job.spec_path)
    bounds = load_bounds(job.spec_path)
    prompt = job.prompt
    param = prompt.param
    try:
        with _render_deadline():
            text, add_bos = render_prompt(prompt, spec)
        # (`surrogatepass`: a lone surrogate, which JSON may carry, is counted here, not refused.)
        encoded = text.encode("utf-8", "surrogatepass") if len(text) <= MAX_TEXT_BYTES else None
        if encoded is None or len(encoded) > MAX_TEXT_BYTES:
            what = "the chat template rendered" if prompt.is_chat else "the prompt is"
            raise InvalidRequest(f"{what} more than {MAX_TEXT_BYTES} bytes of text", param=param)
        if job.max_tokens is not None and (at_least := bounds.min_tokens(encoded)) > job.max_tokens:
            how = f"{len(encoded)} bytes of text, at most {bounds.max_token_bytes} bytes a token"
            return encode_result(error=too_long(at_least, job.max_tokens, how), param=param, code=TOO_LONG)
        del encoded
        cuts = cut_points(text, tokenizer, bounds)
        first = text[: cuts[0]] if cuts else text
        ids: list[int] = tokenizer.encode(first, add_special_tokens=False).ids
    except InvalidRequest as e:
        return encode_result(error=e.message, param=e.param)
    except TemplateTimeout:
        return encode_result(error=_timeout_message(), param=param)
    except MemoryError:
        what = "rendering the chat template" if prompt.is_chat else "the prompt"
        return encode_result(error=_out_of_memory_message(what), param=param, retired=True)
    if add_bos and spec.bos_token is not None:
        bos = tokenizer.token_to_id(spec.bos_token)
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
    if not cuts:
        return encode_result(ids, num_chars=len(text))
    rest = [cut - cuts[0] for cut in cuts[1:]]
    return encode_result(ids, rest=text[cuts[0] :], cuts=rest, num_chars=len(first))


def tokenize_slice_job(payload: bytes) -> bytes:
    """Worker entry point: tokenize one slice of a long text (cut where `cut_points` allows)."""
    spec_path, text = decode_slice_job(payload)
    tokenizer, _ = load_spec(spec_path)
    try:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    except MemoryError:
        return encode_result(error=_out_of_memory_message("the prompt"), param="prompt", retired=True)
    return encode_result(ids, num_chars=len(text))


def warm_tokenizer_job(payload: bytes) -> bytes:
    """Worker entry point: load the tokenizer and its bounds (a new worker's start, paid by the
    job whose crash or deadline it replaces). CBOR in: `spec_path`; out: an empty map."""
    spec_path = cbor2.loads(payload)["spec_path"]
    load_spec(spec_path)
    load_bounds(spec_path)
    return cbor2.dumps({})


def check_template_job(payload: bytes) -> bytes:
    """Worker entry point: render the chat template of a spec file on sample conversations.

    CBOR in: `spec_path`. CBOR out: `{"mid_system": bool}` when a sample rendered (whether the
    template renders a system message mid-conversation in place), else `error` (why the
    template cannot serve a chat). A template may refuse one shape of conversation with
    `raise_exception` (many refuse a system message); one that renders none, runs past its
    deadline or its memory bound, or does not compile cannot serve any.
    """
    _, spec = load_spec(cbor2.loads(payload)["spec_path"])
    source = spec.chat_template
    tools = SAMPLE_TOOLS if source is not None and "tools" in source else None
    refusals: list[str] = []
    for messages in SAMPLE_CONVERSATIONS:
        try:
            with _render_deadline():
                render_chat(source, messages, tools=tools, bos_token=spec.bos_token, eos_token=spec.eos_token)
            return cbor2.dumps({"mid_system": renders_mid_system(spec)})
        except InvalidRequest as e:
            refusals.append(e.message)
        except TemplateTimeout:
            return cbor2.dumps({"error": f"{_timeout_message()} a sample conversation"})
        except MemoryError:
            return cbor2.dumps({"error": _out_of_memory_message("rendering a sample conversation")})
    return cbor2.dumps({"error": f"it renders no sample conversation ({refusals[0]})"})


def renders_mid_system(spec: TokenizerSpec) -> bool:
    """Whether `spec`'s template renders a system message between two turns, in place.

    False when it refuses one (`raise_exception`: roles must alternate, system first), drops
    it, moves it, or fails on it in any way: the caller then folds such messages into the
    user's turns, which every template renders.
    """
    try:
        with _render_deadline():
            text = render_chat(
                spec.chat_template,
                MID_SYSTEM_CONVERSATION,
                bos_token=spec.bos_token,
                eos_token=spec.eos_token,
            )
    except (InvalidRequest, TemplateTimeout, MemoryError):
        return False
    before = text.find(str(MID_SYSTEM_CONVERSATION[2]["content"]))
    after = text.rfind(str(MID_SYSTEM_CONVERSATION[4]["content"]))
    return -1 < before < text.find(MID_SYSTEM_MARKER) < after


def check_grammar_job(payload: bytes) -> bytes:
    """Worker entry point: compile a grammar spec, compute its first mask and walk it
    (`ft.grammar.compiled.walk`), with the tokenizer of the spec file tokenize jobs read.

    CBOR in: `spec_path`, `vocab_size`, `kind`, `source`. CBOR out: `grammar` (llguidance's
    text of it) or `error`. The caller kills the worker past its deadline.
    """
    # Imported here: llguidance and numpy load only in a worker that compiles a grammar.
    from ft.grammar.compiled import compile_matcher, grammar_text, grammar_tokenizer, token_lengths, walk

    job = cbor2.loads(payload)
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


def grammar_payload(grammar: GrammarSpec, spec_path: str, vocab_size: int) -> bytes:
    """The CBOR job `check_grammar_job` reads."""
    job = {"spec_path": spec_path, "vocab_size": vocab_size, "kind": grammar.kind, "source": grammar.source}
    return cbor2.dumps(job)
