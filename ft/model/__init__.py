"""Torch model layer: loaders (GGUF, Hugging Face), the Llama-family decoder, runner, sampler, templates."""

from __future__ import annotations

from ft.model.dtypes import pick_dtype, resolve_dtype
from ft.model.llama import LlamaConfig
from ft.model.loader import LoadedModel, load_model
from ft.model.pull import ModelNotFound, default_model_path, pull_default_model
from ft.model.template import render_chat
from ft.model.tokenizer import TokenizerSpec, build_tokenizer
from ft.model.torch_runner import TorchRunner

__all__ = [
    "LlamaConfig",
    "LoadedModel",
    "ModelNotFound",
    "TokenizerSpec",
    "TorchRunner",
    "build_tokenizer",
    "default_model_path",
    "load_model",
    "pick_dtype",
    "pull_default_model",
    "render_chat",
    "resolve_dtype",
]
