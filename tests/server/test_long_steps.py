"""Long steps on the real default model, over HTTP: a step longer than `--step-timeout` that
makes progress is a slow step, not a hung one (the request is answered, the server keeps
serving); a prompt scored for its logprobs is fed in chunks whose cost, scoring included, fits
the prefill budget."""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.loading import EngineHooks
from ft.model import kernels
from ft.model.quantized_llama import QuantizedLlama
from tests.support.server import running_server

STEP_TIMEOUT_S = 1.0
NATIVE_CALL_S = 0.06  # each native call of the step held this long: 30 layers make 1.8 s


async def test_a_step_past_the_timeout_whose_layers_progress_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every native call of the default model's forward is held 60 ms after it returns, so a
    step of its 30 layers lasts at least 1.8 s, past the 1 s step timeout, while each layer
    still ends (and beats) every ~60 ms. A completion with echo and logprobs is a 200 and the
    server stays ready for the next request (before: the watchdog took the first step for a
    hung one, answered 500 and failed the engine)."""
    forwards_s: list[float] = []
    real_check, real_forward = kernels.check, QuantizedLlama.forward

    def slow_check(lib: object, code: int) -> None:
        real_check(lib, code)  # type: ignore[arg-type]
        time.sleep(NATIVE_CALL_S)

    def timed_forward(self: QuantizedLlama, *args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return real_forward(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            forwards_s.append(time.perf_counter() - started)

    body = {"prompt": "The quick brown fox", "max_tokens": 2, "echo": True, "logprobs": 1}
    async with (
        running_server(EngineConfig(num_pages=64, step_timeout_s=STEP_TIMEOUT_S)) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as client,
    ):
        monkeypatch.setattr(kernels, "check", slow_check)
        monkeypatch.setattr(QuantizedLlama, "forward", timed_forward)
        with trio.fail_after(120):
            r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) >= 4 + 2 and logprobs["token_logprobs"][0] is None
        assert forwards_s and min(forwards_s) > STEP_TIMEOUT_S  # by construction, not by speed
        monkeypatch.undo()
        assert (await client.get("/health/ready")).status_code == 200
        again = await client.post("/v1/completions", json=body | {"echo": False})
        assert again.status_code == 200 and again.json()["choices"][0]["text"]


async def test_a_scored_prompt_is_fed_in_chunks_whose_cost_fits_the_prefill_budget() -> None:
    """Echo with logprobs scores every prompt position, each through the 49k-row lm_head (0.27
    of a token through the 30 layers, in multiply-adds): with a 64-token budget the scored
    chunks are 50 tokens, not 64, and a plain prompt's are still 64."""
    works: list[SeqWork] = []
    cfg = EngineConfig(num_pages=64, max_prefill_tokens=64)
    async with (
        running_server(cfg, hooks=EngineHooks(before_step=works.extend)) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=120) as client,
    ):
        for prompt, echo in (("one two three " * 50, True), ("four five six " * 50, False)):
            body = {"prompt": prompt, "max_tokens": 1, "echo": echo, "logprobs": 1}
            with trio.fail_after(120):
                r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    scored = [w for w in works if w.score_ids]
    plain = [w for w in works if not w.score_ids and len(w.token_ids) > 1]
    assert len(scored) >= 3 and all(len(w.score_ids) == len(w.token_ids) for w in scored[:-1])
    assert [len(w.token_ids) for w in scored[:-1]] == [50] * (len(scored) - 1)  # before: 64
    assert all(len(w.token_ids) + 0.27 * len(w.score_ids) <= 64 for w in scored)
    assert len(plain) >= 3 and [len(w.token_ids) for w in plain[:-1]] == [64] * (len(plain) - 1)
