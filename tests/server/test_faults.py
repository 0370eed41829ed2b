"""Injected faults over real HTTP: a failing model step fails its request alone."""

from __future__ import annotations

import json

import httpx
import trio

from ft.core.batch import SeqWork
from ft.engine.fake import FakeRunner, text_script
from tests.support.server import fake_server, wait_idle

FAULT_SEED = 666


def poisoned(works: list[SeqWork]) -> None:
    """Raise when a sequence with the fault seed is in the batch (a test hook, not a code edit)."""
    if any(w.params.seed == FAULT_SEED for w in works):
        raise RuntimeError("injected model fault")


def chat(seed: int | None = None, stream: bool = False) -> dict[str, object]:
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 30,
        "stream": stream,
    }
    if seed is not None:
        body["seed"] = seed
    return body


async def test_step_fault_is_a_json_500_for_that_request_and_neighbours_finish() -> None:
    """A model fault is a JSON 500 for the request that caused it; concurrent requests still succeed."""
    runner = FakeRunner(text_script("steady output " * 5), step_s=0.01)
    async with fake_server(runner, before_step=poisoned, max_running_requests=4) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            results: dict[str, httpx.Response] = {}

            async def post(name: str, seed: int | None) -> None:
                results[name] = await client.post("/v1/chat/completions", json=chat(seed))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "bad", FAULT_SEED)
                for i in range(3):
                    nursery.start_soon(post, f"good{i}", i)
            bad = results["bad"]
            assert bad.status_code == 500
            assert bad.headers["content-type"].startswith("application/json")
            assert bad.json()["error"]["type"] == "server_error"
            for i in range(3):
                good = results[f"good{i}"]
                assert good.status_code == 200
                assert good.json()["choices"][0]["message"]["content"].startswith("steady")
            await wait_idle(client)


async def test_step_fault_mid_stream_is_an_in_stream_error_then_done() -> None:
    """A fault after the headers ends the stream with an error frame, then `[DONE]`."""
    async with fake_server(before_step=poisoned) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            r = await client.post("/v1/chat/completions", json=chat(FAULT_SEED, stream=True))
            assert r.status_code == 200
            frames = [f for f in r.text.split("\n\n") if f.startswith("data: ")]
            assert frames[-1] == "data: [DONE]"
            error = json.loads(frames[-2][6:])["error"]
            assert error["type"] == "server_error" and "injected" in error["message"]
            await wait_idle(client)


async def test_one_slot_server_keeps_serving_after_a_fault() -> None:
    """With one running slot, faults free it each time, and stats count them as failed."""
    async with fake_server(before_step=poisoned, max_running_requests=1) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            for _ in range(3):
                bad = await client.post("/v1/chat/completions", json=chat(FAULT_SEED))
                assert bad.status_code == 500
                good = await client.post("/v1/chat/completions", json=chat(1))
                assert good.status_code == 200
            stats = await wait_idle(client)
            assert stats["requests"]["failed"] == 3 and stats["requests"]["completed"] == 3


async def test_repro_tool_passes_all_ten_unpackable_shapes() -> None:
    """`tools/repro_unpackable_fields.py` finds no problem in any of its ten body shapes."""
    import repro_unpackable_fields as repro

    async with fake_server() as server:
        verdicts = await trio.to_thread.run_sync(
            lambda: [repro.judge(server.base_url, None, shape) for shape in repro.SHAPES]
        )
    assert len(verdicts) == 10
    assert all(problems == [] for problems in verdicts), verdicts
