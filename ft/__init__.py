"""ft: an LLM inference engine and HTTP server on trio that does not leak request state.

The public API is imported lazily so that tokenizer worker processes, which import
`ft.tokenizer.job`, do not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ft.config import EngineConfig
    from ft.engine.engine import Engine, open_engine
    from ft.engine.loading import EngineHooks
    from ft.engine.stream import Choice, RequestStream
    from ft.errors import (
        ContextLengthExceeded,
        EngineStopping,
        FtError,
        InvalidRequest,
        Overloaded,
        RequestAborted,
        RequestFailed,
    )
    from ft.messages import Delta
    from ft.params import SamplingParams
    from ft.prompt import PromptSpec

_EXPORTS = {
    "EngineConfig": "ft.config",
    "Engine": "ft.engine.engine",
    "EngineHooks": "ft.engine.loading",
    "open_engine": "ft.engine.engine",
    "Choice": "ft.engine.stream",
    "RequestStream": "ft.engine.stream",
    "Delta": "ft.messages",
    "SamplingParams": "ft.params",
    "PromptSpec": "ft.prompt",
    "FtError": "ft.errors",
    "InvalidRequest": "ft.errors",
    "ContextLengthExceeded": "ft.errors",
    "Overloaded": "ft.errors",
    "EngineStopping": "ft.errors",
    "RequestFailed": "ft.errors",
    "RequestAborted": "ft.errors",
}

__all__ = [
    "Choice",
    "ContextLengthExceeded",
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineHooks",
    "EngineStopping",
    "FtError",
    "InvalidRequest",
    "Overloaded",
    "PromptSpec",
    "RequestAborted",
    "RequestFailed",
    "RequestStream",
    "SamplingParams",
    "open_engine",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ft' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
