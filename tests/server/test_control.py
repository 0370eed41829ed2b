"""Control plane, auth, CORS, admission (loading, overload, stopping) and prepare-stop."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from functools import partial

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.engine.fake import FakeRunner, run_inline, text_script
from ft.server import RunningServer, ServerSettings
from ft.server.app import EngineFailed, serve
from ft.server.edge.auth import is_loopback
from tests.support.engine import fake_hooks, fake_parts
from tests.support.server import TEST_SETTINGS, fake_server, parse_sse, running_server, wait_idle

USER = [{"role": "user", "content": "hi"}]
LONG = "lorem ipsum " * 100


async def test_health_models_stats_metrics(client: httpx.AsyncClient) -> None:
    """/health, /v1/models, /v1/stats and /metrics answer with their documented shapes."""
    assert (await client.get("/health")).json() == {"status": "ok", "state": "ready", "model": "fake"}
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake"
    assert models["data"][0]["object"] == "model"
    stats = (await client.get("/v1/stats")).json()
    assert set(stats) >= {"instance_id", "model", "uptime_s", "kv", "throughput", "requests"}
    assert stats["requests"]["active"] == 0
    metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'ft_requests_active{model="fake"} 0.0' in metrics.text
    assert "# TYPE ft_requests_total counter" in metrics.text


# The `/v1/stats` body as it was when `snapshot()` returned a dict: each block's keys in order.
STATS_KEYS = {
    "instance_id": None,
    "state": None,
    "model": ["id", "ctx", "plan"],
    "uptime_s": None,
    "kv": [
        "used_pages",
        "total_pages",
        "page_size",
        "cached_pages",
        "free_pages",
        "used_tokens",
        "usage",
        "dtype",
    ],
    "scheduler": [
        "admission",
        "preemptions",
        "recomputed_tokens",
        "prefix_hit_tokens",
        "prefix_query_tokens",
    ],
    "speculative": [
        "method",
        "max_tokens",
        "draft_tokens",
        "accepted_tokens",
        "verifications",
        "acceptance_rate",
        "mean_accepted_length",
    ],
    "throughput": ["decode_tps", "prefill_tps"],
    "requests": [
        "active",
        "waiting",
        "running",
        "sending",
        "preparing",
        "completed",
        "aborted",
        "rejected",
        "failed",
        "ttft_mean_ms",
        "p95_ms",
        "prompt_tokens_total",
        "completion_tokens_total",
    ],
    "process": ["rss_bytes"],
    "prompt_cache": ["ram", "disk"],
    "recurrent_state": ["slots", "in_use", "snapshots", "snapshot_hits", "snapshots_taken", "slot_bytes"],
}


def _keys(body: dict[str, object]) -> dict[str, list[str] | None]:
    return {k: list(v) if isinstance(v, dict) else None for k, v in body.items()}


async def test_stats_and_prepare_stop_bodies_keep_their_keys(client: httpx.AsyncClient) -> None:
    """The typed snapshot serializes to the same JSON keys, in order; prepare-stop adds one."""
    stats = (await client.get("/v1/stats")).json()
    assert _keys(stats) == STATS_KEYS
    assert stats["state"] == "ready" and stats["model"] == {"id": "fake", "ctx": 2048, "plan": None}
    assert all(isinstance(v, int | float) for v in stats["requests"].values())
    stopped = (await client.post("/v1/admin/prepare-stop", json={})).json()
    assert _keys(stopped) == STATS_KEYS | {"drain_complete": None} and stopped["drain_complete"] is True
    assert stopped["state"] == "stopping"  # taken as the drain ends, before the state says so


async def test_stats_and_metrics_report_preemption_and_the_pools_use(client: httpx.AsyncClient) -> None:
    stats = (await client.get("/v1/stats")).json()
    assert stats["scheduler"] == {
        "admission": "need",
        "preemptions": 0,
        "recomputed_tokens": 0,
        "prefix_hit_tokens": stats["scheduler"]["prefix_hit_tokens"],
        "prefix_query_tokens": stats["scheduler"]["prefix_query_tokens"],
    }
    kv = stats["kv"]
    assert kv["used_pages"] + kv["cached_pages"] + kv["free_pages"] == kv["total_pages"]
    assert kv["used_tokens"] == 0 and kv["usage"] == 0.0 and kv["dtype"] == "auto"
    metrics = (await client.get("/metrics")).text
    assert "# TYPE ft_preemptions_total counter" in metrics
    assert 'ft_recomputed_tokens_total{model="fake"} 0.0' in metrics
    assert 'ft_kv_usage_ratio{model="fake"} 0.0' in metrics


async def test_tokenize_and_detokenize(client: httpx.AsyncClient) -> None:
    """/v1/tokenize counts a prompt or rendered messages; /v1/detokenize inverts it."""
    r = await client.post("/v1/tokenize", json={"prompt": "ab"})
    assert r.json()["tokens"] == [100, 101] and r.json()["count"] == 2
    r = await client.post("/v1/tokenize", json={"messages": USER})
    assert r.json()["count"] > 2
    r = await client.post("/v1/detokenize", json={"tokens": [100, 101]})
    assert r.json() == {"prompt": "ab"}
    r = await client.post("/v1/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = await client.post("/v1/tokenize", json={})
    assert r.status_code == 400


async def test_api_key() -> None:
    """With --api-key, requests need the key (Bearer or x-api-key); /health and /metrics stay open."""
    settings = ServerSettings(port=0, api_key="sekrit", graceful_timeout_s=0.5)
    async with fake_server(settings=settings) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post(
            "/v1/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})).is_success
        assert (await c.get("/v1/models", headers={"x-api-key": "sekrit"})).is_success
        assert (await c.get("/health")).is_success and (await c.get("/metrics")).is_success


async def test_cors_only_when_configured(client: httpx.AsyncClient) -> None:
    """CORS headers appear only for configured origins."""
    r = await client.get("/v1/models", headers={"Origin": "http://a.example"})
    assert "access-control-allow-origin" not in r.headers
    settings = ServerSettings(port=0, cors_origins=("http://a.example",), graceful_timeout_s=0.5)
    async with fake_server(settings=settings) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await c.get("/v1/models", headers={"Origin": "http://a.example"})
        assert r.headers["access-control-allow-origin"] == "http://a.example"
        r = await c.options(
            "/v1/chat/completions",
            headers={"Origin": "http://a.example", "Access-Control-Request-Method": "POST"},
        )
        assert r.is_success and "POST" in r.headers["access-control-allow-methods"]
        r = await c.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


async def test_loading_answers_health_and_503() -> None:
    """While the model loads, /health says loading with progress and requests get 503."""
    release = threading.Event()
    runner = FakeRunner()
    load = fake_parts(runner)

    def slow_load(config: EngineConfig):  # type: ignore[no-untyped-def]
        release.wait(10)
        return load(config)

    hooks = fake_hooks(load_model=slow_load)
    cfg = EngineConfig(num_pages=64)
    async with (
        running_server(cfg, hooks=hooks, wait_ready=False) as s,
        httpx.AsyncClient(base_url=s.base_url) as c,
    ):
        health = (await c.get("/health")).json()
        assert health["status"] == "loading" and health["progress"] == 0.0
        assert (await c.get("/health/live")).status_code == 200
        assert (await c.get("/health/ready")).status_code == 503
        for stream in (False, True):
            r = await c.post("/v1/chat/completions", json={"messages": USER, "stream": stream})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "model_loading"
        assert (await c.post("/v1/tokenize", json={"prompt": "a"})).status_code == 503
        refusals = [
            await c.post("/v1/chat/completions", json={"messages": USER}),
            await c.post("/v1/completions", json={"prompt": [1, 2]}),
            await c.post("/v1/tokenize", json={"prompt": "a"}),
            await c.post("/v1/detokenize", json={"tokens": [1]}),
            await c.get("/v1/models"),
            await c.post("/v1/messages/count_tokens", json={"model": s.engine.model_id, "messages": USER}),
        ]
        assert all(r.status_code == 503 for r in refusals), [r.text for r in refusals]
        # One refusal, worded in one place (before: the routes' "...; retry shortly" and the engine's not).
        assert {r.json()["error"]["message"] for r in refusals} == {
            "the model is still loading; retry shortly"
        }
        release.set()
        await s.engine.wait_ready()
        assert (await c.get("/health")).json()["status"] == "ok"
        assert (await c.get("/health/ready")).json() == {"status": "ready", "state": "ready"}
        r = await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
        assert r.status_code == 200


async def test_engine_load_failure_is_reported_by_health() -> None:
    """A model that fails to load is reported by /health, and requests get 503."""

    def broken(config: EngineConfig):  # type: ignore[no-untyped-def]
        raise OSError("no weights here")

    hooks = fake_hooks(load_model=broken)
    async with running_server(EngineConfig(), hooks=hooks, wait_ready=False) as s:
        with trio.fail_after(30):
            while s.engine.state == "loading":
                await trio.sleep(0.01)
        async with httpx.AsyncClient(base_url=s.base_url) as c:
            health = (await c.get("/health")).json()
            assert health["status"] == "error" and "no weights here" in health["error"]
            assert (await c.get("/health/live")).status_code == 200
            ready = await c.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["state"] == "error"
            r = await c.post("/v1/chat/completions", json={"messages": USER})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"


async def test_full_queue_is_503_with_retry_after() -> None:
    """A full queue is a 503 overloaded_error with Retry-After, streamed or not."""
    runner = FakeRunner(script=text_script(LONG), step_s=0.05)
    async with (
        fake_server(runner, max_running_requests=1, max_queued_requests=1) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        async with trio.open_nursery() as nursery:

            async def hold(event: trio.Event) -> None:
                body = {"messages": USER, "stream": True, "max_tokens": 200}
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_raw():
                        await event.wait()
                        break

            done = trio.Event()
            nursery.start_soon(hold, done)
            nursery.start_soon(hold, done)
            with trio.fail_after(30):
                while (await c.get("/v1/stats")).json()["requests"]["active"] < 2:
                    await trio.sleep(0.02)
            for stream in (False, True):
                r = await c.post("/v1/chat/completions", json={"messages": USER, "stream": stream})
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "overloaded_error"
            done.set()
        await wait_idle(c)


async def test_a_request_queued_past_max_queue_wait_is_503_with_retry_after() -> None:
    """`max_queue_wait_s`: a request that waited that long for its first step is refused with a
    503 overloaded_error and Retry-After (in-stream for a stream); the running one goes on."""
    runner = FakeRunner(script=text_script(LONG), step_s=0.02)
    async with (
        fake_server(runner, max_running_requests=1, max_queue_wait_s=0.3) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
        trio.open_nursery() as nursery,
    ):
        held: list[httpx.Response] = []

        async def hold() -> None:
            held.append(await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 150}))

        nursery.start_soon(hold)
        with trio.fail_after(30):
            while (await c.get("/v1/stats")).json()["requests"]["running"] < 1:
                await trio.sleep(0.02)
        r = await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5})
        assert r.status_code == 503, r.text  # before: served once the first one finished
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "overloaded_error"
        body = {"messages": USER, "max_tokens": 5, "stream": True}
        streamed = parse_sse((await c.post("/v1/chat/completions", json=body)).text)
        assert streamed[-2]["error"]["type"] == "overloaded_error" and streamed[-1] == "[DONE]"
        with trio.fail_after(30):
            while not held:
                await trio.sleep(0.02)
        assert held[0].status_code == 200 and held[0].json()["choices"][0]["finish_reason"] == "length"
        await wait_idle(c)


async def test_prepare_stop_on_idle_server_is_fast_and_idempotent(
    client: httpx.AsyncClient,
) -> None:
    """prepare-stop on an idle server returns at once; a second call returns the same snapshot."""
    assert (await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})).is_success
    # at once, not after the drain's 60 s (the mock-clock test in tests/engine/test_request_scope
    # says "at once" exactly; half the drain here leaves a loaded machine room)
    with trio.fail_after(30):
        first = await client.post("/v1/admin/prepare-stop", json={"drain_timeout_s": 60})
    assert first.status_code == 200
    assert first.json()["drain_complete"] is True
    assert first.json()["requests"]["completed"] == 1
    second = await client.post("/v1/admin/prepare-stop", json={"drain_timeout_s": 1})
    assert second.json() == first.json()
    r = await client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 503


async def test_prepare_stop_aborts_what_does_not_drain() -> None:
    """prepare-stop aborts a stream that outlives the drain; it ends with an in-stream error."""
    runner = FakeRunner(script=text_script(LONG), step_s=0.02)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        body = {"messages": USER, "stream": True, "max_tokens": 1000}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            stop = await c.post("/v1/admin/prepare-stop", json={"drain_timeout_s": 0.1, "abort_timeout_s": 1})
            assert stop.status_code == 200
            assert stop.json()["requests"]["active"] == 0
            rest = [line async for line in lines if line.startswith("data: ")]
        assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"


async def test_prepare_stop_validates_its_body(client: httpx.AsyncClient) -> None:
    """prepare-stop's timeouts are bounded; out-of-range values are a 400 naming the field."""
    r = await client.post("/v1/admin/prepare-stop", json={"drain_timeout_s": 61})
    assert r.status_code == 400 and r.json()["error"]["param"] == "drain_timeout_s"
    r = await client.post("/v1/admin/prepare-stop", json={"abort_timeout_s": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "abort_timeout_s"


def test_only_loopback_callers_may_prepare_stop() -> None:
    """Only loopback addresses count as local callers."""
    assert is_loopback(("127.0.0.1", 5)) and is_loopback(("::1", 5))
    assert not is_loopback(("10.0.0.1", 5)) and not is_loopback(None)
    assert not is_loopback(("not an address", 5))


def test_settings_validate() -> None:
    """ServerSettings refuses impossible values."""
    import pytest

    with pytest.raises(ValueError):
        ServerSettings(port=70000)
    with pytest.raises(ValueError):
        ServerSettings(api_key="")
    assert TEST_SETTINGS.port == 0


async def test_prepare_stop_from_a_remote_address_is_403(server: RunningServer) -> None:
    """prepare-stop from a remote address is a 403 permission_error."""
    client = server.app.test_client()
    r = await client.post("/v1/admin/prepare-stop", json={}, scope_base={"client": ("10.1.2.3", 40000)})
    assert r.status_code == 403
    assert (await r.get_json())["error"]["type"] == "permission_error"
    assert server.engine.state == "ready"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_request_still_tokenizing_when_the_drain_begins_is_served(stream: bool) -> None:
    """A request admitted before the stop is in flight: it finishes during the drain (no 503,
    no 200 with an in-stream error), and the drain waits for it."""
    tokenizing = trio.Event()

    async def slow_tokenizer(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        tokenizing.set()
        await trio.sleep(0.3)
        return await run_inline(job, payload)

    hooks = fake_hooks(FakeRunner(script=text_script("hello world")), executor=slow_tokenizer)
    async with (
        running_server(EngineConfig(num_pages=256), hooks=hooks) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        replies: list[httpx.Response] = []

        async def post() -> None:
            body = {"messages": USER, "max_tokens": 5, "stream": stream}
            replies.append(await c.post("/v1/chat/completions", json=body))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post)
                await tokenizing.wait()
                s.engine.begin_stop(drain_timeout_s=5)
                assert (await c.get("/health/ready")).status_code == 503
            snapshot = await s.engine.wait_stopped()
    (r,) = replies
    assert r.status_code == 200, r.text
    if stream:
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), r.text
    else:
        assert r.json()["usage"]["completion_tokens"] == 5
    assert snapshot.requests.aborted == 0


async def test_a_client_that_leaves_before_its_stream_starts_does_not_hold_the_drain() -> None:
    """The admission a request holds is released however its HTTP request ends."""
    tokenizing = trio.Event()

    async def slow_tokenizer(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        tokenizing.set()
        await trio.sleep(0.3)
        return await run_inline(job, payload)

    hooks = fake_hooks(FakeRunner(script=text_script(LONG)), executor=slow_tokenizer)
    async with (
        running_server(EngineConfig(num_pages=256), hooks=hooks) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        with trio.move_on_after(30) as gone:
            async with trio.open_nursery() as nursery:
                body = {"messages": USER, "max_tokens": 500, "stream": True}
                nursery.start_soon(partial(c.post, "/v1/chat/completions", json=body))
                await tokenizing.wait()
                nursery.cancel_scope.cancel()  # the client hangs up while its prompt tokenizes
        assert not gone.cancelled_caught
        await wait_idle(c)
        with trio.fail_after(15):  # half the drain timeout: nothing holds it
            await s.engine.prepare_stop(drain_timeout_s=30)


async def test_ft_serve_exits_when_the_model_does_not_load() -> None:
    """`serve` (what `ft serve` runs) raises `EngineFailed` when loading fails, so the process
    exits 1 and a supervisor restarts it, rather than idling in the error state; with nothing
    loaded, nothing is frozen."""

    def broken(config: EngineConfig):  # type: ignore[no-untyped-def]
        raise OSError("no weights here")

    frozen = gc.get_freeze_count()
    try:
        with trio.fail_after(30), pytest.raises(EngineFailed, match="no weights here"):
            await serve(EngineConfig(), TEST_SETTINGS, hooks=fake_hooks(load_model=broken), freeze_heap=True)
        assert gc.get_freeze_count() == frozen
    finally:
        if frozen == 0:
            gc.unfreeze()


@pytest.mark.parametrize("freeze_heap", [True, False])
async def test_ft_serve_freezes_its_startup_heap_once_the_model_has_loaded(freeze_heap: bool) -> None:
    """`ft serve` (`serve(freeze_heap=True)`) moves the objects alive once the model has loaded
    into the collector's permanent generation: a full collection while serving then skips
    torch, the model and the app (0.1 s here with the GIL held, a stall of every stream). Not
    before: the load's heap is part of it. An embedding program's heap is its own: untouched."""
    release = threading.Event()
    loader = fake_parts(FakeRunner(), 2048)

    def slow_load(config: EngineConfig):  # type: ignore[no-untyped-def]
        release.wait(10)
        return loader(config)

    frozen = gc.get_freeze_count()
    hooks = fake_hooks(load_model=slow_load)
    try:
        async with trio.open_nursery() as nursery:
            try:
                server: RunningServer = await nursery.start(
                    partial(serve, EngineConfig(), TEST_SETTINGS, hooks=hooks, freeze_heap=freeze_heap)
                )
                await trio.sleep(0.1)
                assert gc.get_freeze_count() == frozen  # still loading
            finally:
                release.set()  # the loader's thread cannot be abandoned
            assert server.engine is not None
            with trio.fail_after(30):
                await server.engine.wait_ready()
                while freeze_heap and gc.get_freeze_count() == frozen:
                    await trio.sleep(0.01)
                await trio.sleep(0.05)
            assert (gc.get_freeze_count() > frozen) == freeze_heap
            nursery.cancel_scope.cancel()
    finally:
        if frozen == 0:
            gc.unfreeze()  # this test process goes on collecting as before
