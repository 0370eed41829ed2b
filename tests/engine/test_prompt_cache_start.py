"""Starting an engine with `prompt_cache_dir`: a directory another server owns fails the start
before the model loads; a model whose pages cannot go to disk fails it and frees the lock."""

from __future__ import annotations

import pathlib

import pytest
import trio

from ft.config import EngineConfig
from ft.core.prompt_cache import PromptCache, cache_identity
from ft.engine.engine import open_engine
from ft.engine.fake import FakeRunner
from ft.engine.loading import ModelParts
from tests.support.engine import fake_hooks, fake_parts


async def test_a_directory_owned_by_another_server_fails_before_the_model_loads(
    tmp_path: pathlib.Path,
) -> None:
    loads: list[EngineConfig] = []
    parts = fake_parts(FakeRunner())

    def load(config: EngineConfig) -> ModelParts:
        loads.append(config)
        return parts(config)

    owner = PromptCache(tmp_path, 1 << 20, cache_identity("other"))
    try:
        with trio.fail_after(30):
            async with open_engine(
                EngineConfig(prompt_cache_dir=str(tmp_path)),
                hooks=fake_hooks(load_model=load),
                wait_ready=False,
            ) as engine:
                with pytest.raises(RuntimeError, match=f"prompt cache directory {tmp_path} is in use"):
                    await engine.wait_ready()
        assert loads == []
    finally:
        owner.close()


async def test_a_model_without_savable_pages_fails_the_start_and_frees_the_directory(
    tmp_path: pathlib.Path,
) -> None:
    with trio.fail_after(30):
        async with open_engine(
            EngineConfig(prompt_cache_dir=str(tmp_path)), hooks=fake_hooks(), wait_ready=False
        ) as engine:
            with pytest.raises(RuntimeError, match="cannot be saved to disk"):
                await engine.wait_ready()
    PromptCache(tmp_path, 1 << 20, cache_identity("next")).close()  # the lock was released
