"""CBOR at the process boundary: tokenizer jobs out to worker processes, results back.

Encoding is where a value the wire cannot carry (a lone surrogate, an integer past 64 bits)
shows up; it is translated here, once, into `InvalidRequest`, inside the request's scope.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain, islice
from typing import Any

import cbor2

from ft.errors import ContextLengthExceeded, InvalidRequest
from ft.prompt import PromptSpec

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
# A job with at most this many values and characters is encoded on the event loop (well under
# a millisecond); a larger one in a thread (see `is_small_job`).
INLINE_JOB_VALUES = 4096
INLINE_JOB_CHARS = 256 * 1024
TOO_LONG = "context_length_exceeded"  # a refusal's code that decodes as `ContextLengthExceeded`


def is_small_job(prompt: PromptSpec) -> bool:
    """Whether `prompt` is cheap enough to encode on the event loop.

    A walk that stops at `INLINE_JOB_VALUES` values or `INLINE_JOB_CHARS` characters, so it is
    bounded whatever the client sent.
    """
    values = chars = 0
    stack: list[Any] = list(_wire_fields(prompt).values())
    while stack:
        item = stack.pop()
        values += 1
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            stack.extend(islice(chain.from_iterable(item.items()), 2 * INLINE_JOB_VALUES + 2))
        elif isinstance(item, (list, tuple)):
            stack.extend(item[: INLINE_JOB_VALUES + 1])
        if values > INLINE_JOB_VALUES or chars > INLINE_JOB_CHARS:
            return False
    return True


def _check_ints(value: Any, path: str) -> None:
    """Raise `InvalidRequest` for an integer past 64 bits in `value`, naming `path` (and the
    keys on the way to it).

    Iterative, and linear in the value's size with no allocation per list element: this runs for
    every prompt, whose messages and kwargs the client sizes.
    """
    # NOTE: cbor2 would encode such integers as bignum tags, which the worker side would
    # accept; the engine represents nothing past 64 bits, so refuse them at the boundary.
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if isinstance(v, (dict, list, tuple)):
                    stack.append((v, _key_path(where, k)))
                elif _is_wide_int(v):
                    raise _wide_int(_key_path(where, k))
        elif isinstance(item, (list, tuple)):
            for v in item:
                if type(v) is int:
                    if not INT64_MIN <= v <= UINT64_MAX:
                        raise _wide_int(where)
                elif isinstance(v, (dict, list, tuple)):
                    stack.append((v, where))
                elif _is_wide_int(v):
                    raise _wide_int(where)
        elif _is_wide_int(item):
            raise _wide_int(where)


def _key_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) else path


def _is_wide_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= UINT64_MAX


def _wide_int(path: str) -> InvalidRequest:
    return InvalidRequest(f"{path} holds an integer outside 64 bits", param=path)


@dataclass(frozen=True, slots=True)
class TokenizeJob:
    """One tokenizer job as it crosses the process boundary; rebuilt whole on the worker side.

    `max_tokens`: a text that must have more tokens than this (by its bytes,
    `ft.tokenizer.bounds`) is refused before it is tokenized; None: no bound.
    """

    spec_path: str
    prompt: PromptSpec
    max_tokens: int | None = None


# A prompt's fields go by name (a new one travels with no edit here), but for its token ids (the
# tokenizer actor answers a prompt of ids itself, without a job) and its prefix-cache partition
# (the scheduler's, not the template's: a worker never sees who sent a prompt).
_LOCAL_FIELDS = frozenset({"token_ids", "cache_salt", "tenant"})
# The request field a refusal names for a record field, where the two differ.
_PARAMS = {"text": "prompt"}


def _wire_fields(prompt: PromptSpec) -> dict[str, Any]:
    return {f.name: getattr(prompt, f.name) for f in fields(prompt) if f.name not in _LOCAL_FIELDS}


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """A worker's answer: token ids, or the refusal's message, the field it names and its code.

    A long text comes back with the ids of its first slice only, the `rest` of its text and
    the offsets in `rest` where it may be cut (`ft.tokenizer.bounds.cut_points`): the caller
    tokenizes the rest a slice at a time (`encode_slice_job`). `num_chars`: the characters this
    job tokenized. `retired`: the worker is replaced after this job (it ran out of memory).
    """

    ids: list[int] | None = None
    error: str | None = None
    param: str | None = None
    code: str | None = None
    rest: str | None = None
    cuts: list[int] | None = None
    num_chars: int = 0
    retired: bool = False

    def checked_ids(self) -> list[int]:
        """The ids. Raises `InvalidRequest` (`ContextLengthExceeded` for its code) when the
        worker refused the job."""
        if self.error is not None:
            if self.code == TOO_LONG:
                raise ContextLengthExceeded(self.error, param=self.param)
            raise InvalidRequest(self.error, param=self.param)
        assert self.ids is not None
        return self.ids


def _fields(record: TokenizeResult) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in fields(record)}


_ENCODE_ERRORS = (UnicodeEncodeError, cbor2.CBOREncodeError, ValueError, TypeError)


def encode_job(prompt: PromptSpec, spec_path: str, max_tokens: int | None = None) -> bytes:
    """Encode a tokenize job. Raises `InvalidRequest` naming the field that cannot be sent.

    Linear in the job's size (a 0.9 MB list of integers takes tens of milliseconds): callers
    run it off the event loop.
    """
    payload = _wire_fields(prompt)
    for name, value in payload.items():
        _check_ints(value, _PARAMS.get(name, name))
    try:
        return cbor2.dumps({"spec_path": spec_path, "prompt": payload, "max_tokens": max_tokens})
    except _ENCODE_ERRORS as e:
        field = _unencodable_field(payload)
        raise InvalidRequest(f"{field or 'the request'} cannot be encoded: {_reason(e)}", param=field) from e


def _unencodable_field(payload: dict[str, Any]) -> str | None:
    # Only a job that cannot be sent is encoded again, field by field, to name the culprit.
    for name, value in payload.items():
        try:
            cbor2.dumps(value)
        except _ENCODE_ERRORS:
            return _PARAMS.get(name, name)
    return None


def _reason(e: Exception) -> str:
    if isinstance(e, UnicodeEncodeError) or isinstance(e.__cause__, UnicodeEncodeError):
        return "it contains a lone UTF-16 surrogate"
    return type(e).__name__


def decode_job(payload: bytes) -> TokenizeJob:
    """Decode a job on the worker side: its prompt rebuilt as the `PromptSpec` it was."""
    job = cbor2.loads(payload)
    return TokenizeJob(job["spec_path"], PromptSpec(**job["prompt"]), job.get("max_tokens"))


def encode_slice_job(spec_path: str, text: str) -> bytes:
    """Encode the job of tokenizing one slice of a long text (`TokenizeResult.rest`)."""
    return cbor2.dumps({"spec_path": spec_path, "text": text})


def decode_slice_job(payload: bytes) -> tuple[str, str]:
    """The spec path and the text of a slice job."""
    job = cbor2.loads(payload)
    return str(job["spec_path"]), str(job["text"])


def encode_result(
    ids: list[int] | None = None,
    *,
    error: str | None = None,
    param: str | None = None,
    code: str | None = None,
    rest: str | None = None,
    cuts: list[int] | None = None,
    num_chars: int = 0,
    retired: bool = False,
) -> bytes:
    """Encode a worker's answer (`TokenizeResult`'s fields)."""
    return cbor2.dumps(_fields(TokenizeResult(ids, error, param, code, rest, cuts, num_chars, retired)))


def decode_result(payload: bytes) -> TokenizeResult:
    """Decode a worker's answer (`TokenizeResult.checked_ids` raises its refusal)."""
    return TokenizeResult(**cbor2.loads(payload))
