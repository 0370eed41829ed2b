"""CBOR at the process boundary: tokenizer jobs out to worker processes, results back.

Encoding is where a value the wire cannot carry (a lone surrogate, an integer past 64 bits)
shows up; it is translated here, once, into `InvalidRequest`, inside the request's scope.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import cbor2

from ft.errors import InvalidRequest
from ft.messages import Tokenize

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def _check_ints(value: Any, path: str) -> None:
    # NOTE: cbor2 would encode such integers as bignum tags, which the worker side would
    # accept; the engine represents nothing past 64 bits, so refuse them at the boundary.
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= UINT64_MAX:
            raise InvalidRequest(f"{path} holds an integer outside 64 bits", param=path)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_ints(v, f"{path}.{k}" if isinstance(k, str) else path)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_ints(v, path)


@dataclass(frozen=True, slots=True)
class TokenizeJob:
    """One tokenizer job as it crosses the process boundary; rebuilt whole on the worker side."""

    spec_path: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    chat_template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    fault: str | None = None  # test hook: "exit" or "raise" in the worker


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """A worker's answer: token ids, or the refusal's message and the field it names."""

    ids: list[int] | None = None
    error: str | None = None
    param: str | None = None


def _fields(record: TokenizeJob | TokenizeResult) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in fields(record)}


def encode_job(msg: Tokenize, spec_path: str, *, fault: str | None = None) -> bytes:
    """Encode a tokenize job. Raises `InvalidRequest` naming the field that cannot be sent."""
    payload: dict[str, Any] = {
        "messages": list(msg.messages) if msg.messages is not None else None,
        "tools": list(msg.tools) if msg.tools is not None else None,
        "chat_template_kwargs": msg.chat_template_kwargs,
        "prompt": msg.prompt,
    }
    for name, value in payload.items():
        _check_ints(value, name)
        try:
            cbor2.dumps(value)
        except (UnicodeEncodeError, cbor2.CBOREncodeError, ValueError, TypeError) as e:
            raise InvalidRequest(f"{name} cannot be encoded: {_reason(e)}", param=name) from e
    job = TokenizeJob(
        spec_path=spec_path,
        add_generation_prompt=msg.add_generation_prompt,
        continue_final_message=msg.continue_final_message,
        fault=fault,
        **payload,
    )
    return cbor2.dumps(_fields(job))


def _reason(e: Exception) -> str:
    if isinstance(e, UnicodeEncodeError) or isinstance(e.__cause__, UnicodeEncodeError):
        return "it contains a lone UTF-16 surrogate"
    return type(e).__name__


def decode_job(payload: bytes) -> TokenizeJob:
    """Decode a job on the worker side."""
    return TokenizeJob(**cbor2.loads(payload))


def encode_result(
    ids: list[int] | None = None, *, error: str | None = None, param: str | None = None
) -> bytes:
    """Encode a worker's answer: token ids, or an error message with the field it names."""
    return cbor2.dumps(_fields(TokenizeResult(ids, error, param)))


def decode_result(payload: bytes) -> list[int]:
    """Decode a worker's answer; raise `InvalidRequest` when the worker refused the job."""
    result = TokenizeResult(**cbor2.loads(payload))
    if result.error is not None:
        raise InvalidRequest(result.error, param=result.param)
    assert result.ids is not None
    return result.ids
