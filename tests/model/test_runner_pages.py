"""TorchRunner's pages in and out (the prompt cache's disk tier): byte for byte, in any KV dtype,
into other pages of another runner, which then continues as the first would have."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ft.core.batch import PageLoad, PageSave, SeqWork
from ft.core.prompt_cache import PageIO, PromptCache, cache_identity
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.support.tiny_model import save_hf_dir, tiny_config

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30)  # 4 full pages of 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("tiny")
    save_hf_dir(directory, tiny_config())
    return directory


def runner(model_dir: pathlib.Path, kv_dtype: torch.dtype) -> TorchRunner:
    loaded = load_model(model_dir, torch.float32)
    return build_runner(loaded, num_pages=16, page_size=4, dtype=torch.float32, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pages_saved_from_one_runner_load_into_another_and_it_continues_the_same(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, kv_dtype: torch.dtype
) -> None:
    first = runner(model_dir, kv_dtype)
    assert isinstance(first, PageIO)
    pages = (3, 7, 1, 9, 4)
    whole = first.forward([SeqWork(0, PROMPT, 0, pages, True, GREEDY, 0)])
    assert whole is not None
    cache = PromptCache(tmp_path, 1 << 20, cache_identity("tiny"))
    try:
        keys = (11, 12, 13, 14)
        assert cache.save_pages(first, [PageSave(p, k) for p, k in zip(pages, keys, strict=False)]) == 4
        cache.close()
        cache = PromptCache(tmp_path, 1 << 20, cache_identity("tiny"))
        second = runner(model_dir, kv_dtype)
        other = (0, 2, 5, 6, 8)
        assert cache.load_pages(second, [PageLoad(0, other[:4], keys)]) == ((0, 4),)
        for a, b in zip(pages[:4], other[:4], strict=True):
            assert [bytes(x) for x in first.page_payload(a)] == [bytes(x) for x in second.page_payload(b)]
        rest = second.forward([SeqWork(0, PROMPT[16:], 16, other, True, GREEDY, 0)])
        assert rest is not None
        torch.testing.assert_close(rest, whole, atol=1e-4, rtol=1e-4)
        assert int(rest[0].argmax()) == int(whole[0].argmax())
    finally:
        cache.close()


def test_a_payload_of_the_wrong_size_is_refused(model_dir: pathlib.Path) -> None:
    r = runner(model_dir, torch.float32)
    with pytest.raises(ValueError, match="payload"):
        r.load_page(0, memoryview(bytearray(r.page_payload_bytes - 1)))
    assert r.page_payload_bytes == sum(memoryview(x).nbytes for x in r.page_payload(0))
