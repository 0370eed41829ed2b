"""Several models in one server (router mode, `ft.server.models`), over real HTTP with real
tiny models: a random-weight Llama GGUF and a random-weight Qwen3 GGUF (built by transformers),
loaded and unloaded by one process.

The load can be held at a gate (`Gate`: the real load waits for it in its thread) and steps can
be paced (`Pace`), so a test sees a model mid-load or a stream mid-generation without timing
anything; every wait is a poll against a deadline.
"""

from __future__ import annotations

import gc
import json
import pathlib
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.loading import EngineHooks, ModelParts, load_torch_model
from ft.server.app import RunningServer, open_server
from ft.server.models import RouterSettings, ServedModel
from tests.support.gguf_files import write_tiny_gguf
from tests.support.server import TEST_SETTINGS, parse_sse

pytest.importorskip("transformers")

LLAMA, QWEN, BROKEN = "tiny-llama", "tiny-qwen3", "broken"
USER = [{"role": "user", "content": "Hello there"}]
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Two different real tiny GGUFs, and one whose tensors were cut off."""
    from tests.support.tiny_qwen3 import qwen3_model, write_qwen3_gguf

    root = tmp_path_factory.mktemp("models")
    write_tiny_gguf(root / f"{LLAMA}.gguf", seed=0)
    write_qwen3_gguf(root / f"{QWEN}.gguf", qwen3_model(seed=1))
    whole = (root / f"{LLAMA}.gguf").read_bytes()
    (root / f"{BROKEN}.gguf").write_bytes(whole[: len(whole) // 2])
    return root


class Gate:
    """Holds every model's real load in its thread until opened (open by default)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.event.set()
        self.num_waiting = 0

    def load(self, config: EngineConfig) -> ModelParts:
        self.num_waiting += 1
        try:
            self.event.wait(DEADLINE_S)
        finally:
            self.num_waiting -= 1
        return load_torch_model(config)


@dataclass
class Pace:
    """Sleeps before each step (in the runner's thread) while `step_s` is set."""

    step_s: float = 0.0
    steps: list[int] = field(default_factory=list)

    def before_step(self, works: list[SeqWork]) -> None:
        self.steps.append(len(works))
        if self.step_s:
            time.sleep(self.step_s)


@dataclass
class Router:
    """A running router-mode server, its client and its test doubles' controls."""

    server: RunningServer
    client: httpx.AsyncClient
    gate: Gate
    pace: Pace

    async def status(self, name: str) -> str:
        r = await self.client.get("/v1/models")
        assert r.status_code == 200
        (entry,) = [m for m in r.json()["data"] if m["id"] == name]
        return str(entry["status"]["value"])

    async def wait_status(self, name: str, *wanted: str) -> str:
        with trio.fail_after(DEADLINE_S):
            while (status := await self.status(name)) not in wanted:
                await trio.sleep(0.05)
        return status

    async def chat(self, model: str | None, **fields: Any) -> httpx.Response:
        body: dict[str, Any] = {"messages": USER, "max_tokens": 4, "temperature": 0} | fields
        if model is not None:
            body["model"] = model
        return await self.client.post("/v1/chat/completions", json=body)


@asynccontextmanager
async def router_server(
    model_dir: pathlib.Path, names: tuple[str, ...] = (LLAMA, QWEN), **options: Any
) -> AsyncIterator[Router]:
    """A server routing `names` (files in `model_dir`); `options` are `RouterSettings` fields,
    `settings=` the server's and `config=` the models' `EngineConfig`."""
    settings = options.pop("settings", TEST_SETTINGS)
    config = options.pop("config", EngineConfig(num_pages=64, tokenizer_workers=1))
    routing = RouterSettings(
        models=tuple(ServedModel(n, str(model_dir / f"{n}.gguf")) for n in names),
        **{"unload_timeout_s": 0.5, "busy_timeout_s": 0.5} | options,
    )
    gate, pace = Gate(), Pace()
    hooks = EngineHooks(load_model=gate.load, before_step=pace.before_step)
    async with open_server(config, settings, hooks=hooks, router=routing) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as client:
            yield Router(server, client, gate, pace)
        gate.event.set()


async def test_models_are_listed_with_their_states_and_load_on_demand(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir) as r:
        listed = (await r.client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["object"], m["status"]["value"]) for m in listed] == [
            (LLAMA, "model", "unloaded"),
            (QWEN, "model", "unloaded"),
        ]
        assert listed[0]["context_length"] is None  # known once loaded

        answer = await r.chat(QWEN)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == QWEN
        listed = {m["id"]: m for m in (await r.client.get("/v1/models")).json()["data"]}
        assert listed[QWEN]["status"] == {"value": "loaded"} and listed[QWEN]["context_length"] == 512
        assert listed[LLAMA]["status"] == {"value": "unloaded"}

        # No `model`: the first model; each model answers with its own tokenizer and weights.
        default = await r.chat(None)
        assert default.status_code == 200 and default.json()["model"] == LLAMA
        ids = {
            name: (await r.client.post("/v1/tokenize", json={"model": name, "prompt": "Hello"})).json()
            for name in (LLAMA, QWEN)
        }
        assert all(v["count"] > 0 for v in ids.values())
        assert await r.status(LLAMA) == "loaded" and await r.status(QWEN) == "loaded"


async def test_a_stream_speaks_before_its_model_has_loaded(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir) as r:
        r.gate.event.clear()
        body = {"model": QWEN, "messages": USER, "max_tokens": 4, "temperature": 0, "stream": True}
        async with r.client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = response.aiter_text()
            first = await chunks.__anext__()
            assert first.startswith(": connected")
            assert await r.status(QWEN) == "loading"  # the load is held at the gate
            with trio.fail_after(DEADLINE_S):
                while not r.gate.num_waiting:
                    await trio.sleep(0.01)
            heartbeat = await chunks.__anext__()
            assert heartbeat.startswith(": heartbeat")  # still loading: the stream keeps talking
            r.gate.event.set()
            rest = first + heartbeat + "".join([c async for c in chunks])
        events = parse_sse(rest)
        assert events[-1] == "[DONE]"
        assert all(e["model"] == QWEN for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert await r.status(QWEN) == "loaded"


async def test_a_model_not_served_is_a_404_in_each_api_shape(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir) as r:
        for stream in (False, True):
            chat = await r.chat("no-such-model", stream=stream)
            assert chat.status_code == 404
            assert chat.json()["error"]["code"] == "model_not_found"
            assert chat.json()["error"]["param"] == "model"
        messages = await r.client.post(
            "/v1/messages",
            json={"model": "no-such-model", "max_tokens": 4, "messages": USER, "stream": True},
        )
        assert messages.status_code == 404
        assert messages.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": messages.json()["error"]["message"]},
        }
        assert "no-such-model" in messages.json()["error"]["message"]
        for path, body in (
            ("/v1/embeddings", {"model": "nope", "input": "hi"}),
            ("/v1/completions", {"model": "nope", "prompt": "hi"}),
            ("/v1/responses", {"model": "nope", "input": "hi"}),
            ("/v1/tokenize", {"model": "nope", "prompt": "hi"}),
        ):
            got = await r.client.post(path, json=body)
            assert got.status_code == 404 and got.json()["error"]["code"] == "model_not_found", path
        assert (await r.client.get("/v1/models/nope")).status_code == 404
        # Nothing was loaded for them.
        assert await r.status(LLAMA) == "unloaded" and await r.status(QWEN) == "unloaded"


async def test_models_max_one_swaps_the_least_recently_used_model(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir, max_loaded=1) as r:
        assert (await r.chat(LLAMA)).status_code == 200
        assert await r.status(LLAMA) == "loaded"
        assert (await r.chat(QWEN)).status_code == 200
        assert await r.status(QWEN) == "loaded" and await r.status(LLAMA) == "unloaded"
        assert (await r.chat(LLAMA)).status_code == 200
        assert await r.status(LLAMA) == "loaded" and await r.status(QWEN) == "unloaded"


async def test_a_memory_budget_for_one_model_swaps_them(model_dir: pathlib.Path) -> None:
    # Each model costs its weights (a few MiB) + its KV pool (256 MiB, as its engine sizes it).
    config = EngineConfig(kv_cache_memory=256 << 20, tokenizer_workers=1)
    async with router_server(model_dir, memory_bytes=400 << 20, config=config) as r:
        assert (await r.chat(LLAMA)).status_code == 200
        assert (await r.chat(QWEN)).status_code == 200
        assert await r.status(LLAMA) == "unloaded" and await r.status(QWEN) == "loaded"
        stats = {m["id"]: m for m in (await r.client.get("/v1/stats")).json()["models"]}
        assert 256 << 20 <= stats[QWEN]["cost_bytes"] <= 400 << 20


async def test_a_busy_model_is_not_evicted(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir, max_loaded=1) as r:
        assert (await r.chat(LLAMA)).status_code == 200
        r.pace.step_s = 0.05
        body = {"model": LLAMA, "messages": USER, "max_tokens": 40, "ignore_eos": True, "stream": True}
        async with r.client.stream("POST", "/v1/chat/completions", json=body) as stream:
            chunks = stream.aiter_text()
            text = await chunks.__anext__()
            while '"content"' not in text:
                text += await chunks.__anext__()
            refused = await r.chat(QWEN)  # LLAMA streams: no room for QWEN within busy_timeout_s
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "models_busy"
            assert refused.headers["Retry-After"]
            # A stream waits for room between its heartbeats, as long as a request does, no longer.
            with trio.fail_after(DEADLINE_S / 2):
                waited = await r.chat(QWEN, stream=True)
            assert waited.status_code == 200 and waited.text.startswith(": connected")
            assert ": heartbeat" in waited.text
            busy = parse_sse(waited.text)
            assert busy[0]["error"]["code"] == "models_busy" and busy[-1] == "[DONE]"
            assert await r.status(LLAMA) == "loaded" and await r.status(QWEN) == "unloaded"
            r.pace.step_s = 0.0
            text += "".join([c async for c in chunks])
        events = parse_sse(text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert (await r.chat(QWEN)).status_code == 200  # idle now: evicted for QWEN
        assert await r.status(LLAMA) == "unloaded"


async def test_an_idle_model_sleeps_and_probes_do_not_wake_it(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir, sleep_idle_s=0.5) as r:
        assert (await r.chat(LLAMA)).status_code == 200
        assert await r.status(LLAMA) in ("loaded", "unloading", "unloaded")
        # Probes all along: they neither keep it awake nor wake it once it sleeps.
        with trio.fail_after(DEADLINE_S):
            while await r.status(LLAMA) != "unloaded":
                for path in ("/health", "/health/ready", "/metrics", "/v1/stats", f"/v1/models/{LLAMA}"):
                    assert (await r.client.get(path)).status_code == 200, path
                await trio.sleep(0.05)
        for path in ("/health", "/health/ready", "/metrics", "/v1/stats", "/v1/models"):
            assert (await r.client.get(path)).status_code == 200
        assert await r.status(LLAMA) == "unloaded"
        assert (await r.chat(LLAMA)).status_code == 200  # a request wakes it


async def test_admin_routes_load_and_unload_idempotently(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir) as r:
        for _ in range(2):
            loaded = await r.client.post("/v1/models/load", json={"model": QWEN})
            assert loaded.status_code == 200, loaded.text
            assert loaded.json()["model"]["status"]["value"] == "loaded"
        for _ in range(2):
            unloaded = await r.client.post("/v1/models/unload", json={"model": QWEN})
            assert unloaded.status_code == 200
            assert unloaded.json()["model"]["status"]["value"] == "unloaded"
        assert (
            await r.client.post("/models/load", json={"model": LLAMA})
        ).status_code == 200  # llama-server's path
        missing = await r.client.post("/v1/models/load", json={"model": "nope"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        bad = await r.client.post("/v1/models/unload", json={"model": 3})
        assert bad.status_code == 400
        foreign = await r.client.post(
            "/v1/models/unload", json={"model": LLAMA}, headers={"Origin": "https://evil.example"}
        )
        assert foreign.status_code == 403
        proxied = await r.client.post(
            "/v1/models/unload", json={"model": LLAMA}, headers={"X-Forwarded-For": "1.2.3.4"}
        )
        assert proxied.status_code == 403
        assert await r.status(LLAMA) == "loaded"


async def test_admin_routes_need_the_admin_key_when_one_is_set(model_dir: pathlib.Path) -> None:
    settings = replace(TEST_SETTINGS, api_key="user-key", admin_key="admin-key")
    async with router_server(model_dir, settings=settings) as r:
        user = {"Authorization": "Bearer user-key"}
        refused = await r.client.post("/v1/models/load", json={"model": LLAMA}, headers=user)
        assert refused.status_code == 401
        admin = {"Authorization": "Bearer admin-key"}
        assert (
            await r.client.post("/v1/models/load", json={"model": LLAMA}, headers=admin)
        ).status_code == 200
        assert (await r.client.get("/v1/models", headers=user)).json()["data"][0]["status"][
            "value"
        ] == "loaded"


async def test_each_api_key_has_its_own_prefix_cache_in_router_mode(model_dir: pathlib.Path) -> None:
    """Several keys: each model's prefix cache is partitioned per key, on the path that loads
    the model behind a stream too; the same key still reuses its prefix."""
    secret = [{"role": "user", "content": "Remember it and tell no one: the vault's PIN is 4821. " * 6}]
    settings = replace(TEST_SETTINGS, api_keys=("key-a", "key-b"))

    async def cached(r: Router, key: str, *, stream: bool = False) -> int:
        body: dict[str, Any] = {"model": QWEN, "messages": secret, "max_tokens": 1, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Authorization": f"Bearer {key}"}
        response = await r.client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        if stream:
            (last,) = [e for e in parse_sse(response.text) if isinstance(e, dict) and e.get("usage")]
            return int(last["usage"]["prompt_tokens_details"]["cached_tokens"])
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with router_server(model_dir, settings=settings) as r:
        assert await cached(r, "key-a", stream=True) == 0  # unloaded: loads behind the stream
        assert await cached(r, "key-b") == 0  # the very prompt key-a sent: nothing of it shows
        assert await cached(r, "key-b", stream=True) > 0  # its own pages, from its last request
        assert await cached(r, "key-a") > 0


async def test_a_corrupt_model_fails_only_its_own_requests(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir, names=(BROKEN, LLAMA)) as r:
        failed = await r.chat(BROKEN)
        assert failed.status_code == 503
        assert failed.json()["error"]["code"] == "model_load_failed"
        assert "failed to load" in failed.json()["error"]["message"]
        stream = await r.chat(BROKEN, stream=True)  # failed already: refused before any stream
        assert stream.status_code == 503
        entry = (await r.client.get(f"/v1/models/{BROKEN}")).json()
        assert entry["status"]["value"] == "failed" and entry["status"]["error"]
        assert (await r.chat(LLAMA)).status_code == 200
        health = (await r.client.get("/health")).json()
        assert health["status"] == "ok"
        ready = await r.client.get("/health/ready")  # the default model failed: not ready
        assert ready.status_code == 503 and ready.json()["error"]
        retried = await r.client.post("/v1/models/load", json={"model": BROKEN})  # tried again: fails again
        assert retried.status_code == 503 and "failed to load" in retried.json()["error"]["message"]
        assert (await r.chat(LLAMA)).status_code == 200


STREAMS = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 4},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/v1/messages": {"messages": USER, "max_tokens": 4},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 4},
}


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_stream_waiting_for_a_corrupt_model_ends_with_an_error_frame(
    model_dir: pathlib.Path, path: str
) -> None:
    async with router_server(model_dir, names=(LLAMA, BROKEN)) as r:
        answer = await r.client.post(path, json=STREAMS[path] | {"model": BROKEN, "stream": True})
        assert answer.status_code == 200
        assert answer.text.startswith(": connected")
        frames = [f for f in answer.text.split("\n\n") if "data: " in f]
        error = json.loads(frames[0].split("data: ", 1)[1])
        message = error["message"] if path == "/v1/responses" else error["error"]["message"]
        assert "failed to load" in message
        if path == "/v1/messages":
            assert frames[0].startswith("event: error") and error["error"]["type"] == "api_error"
        elif path == "/v1/responses":
            assert frames[0].startswith("event: error") and error["code"] == "model_load_failed"
        else:
            assert frames[-1] == "data: [DONE]" and error["error"]["code"] == "model_load_failed"
        assert await r.status(LLAMA) == "unloaded" and await r.status(BROKEN) == "failed"


async def test_unloading_mid_stream_aborts_it_cleanly_and_frees_the_model(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir) as r:
        r.pace.step_s = 0.05
        body = {"model": QWEN, "messages": USER, "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with r.client.stream("POST", "/v1/chat/completions", json=body) as stream:
            chunks = stream.aiter_text()
            text = await chunks.__anext__()
            while '"content"' not in text:
                text += await chunks.__anext__()
            router = r.server.router
            assert router is not None
            slot = router.find(QWEN)
            engine = slot.engine
            assert engine is not None and len(engine.registry) == 1
            unloaded = await r.client.post("/v1/models/unload", json={"model": QWEN})
            assert unloaded.status_code == 200
            assert unloaded.json()["model"]["status"]["value"] == "unloaded"
            text += "".join([c async for c in chunks])
        events = parse_sse(text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == f"the model '{QWEN}' is unloading; request aborted"
        assert len(engine.registry) == 0 and engine.state == "stopped"
        assert slot.engine is None and slot.num_users == 0
        stats = {m["id"]: m for m in (await r.client.get("/v1/stats")).json()["models"]}
        assert stats[QWEN]["stats"] is None and stats[QWEN]["status"] == "unloaded"
        del engine
        gc.collect()
        r.pace.step_s = 0.0
        assert (await r.chat(QWEN)).status_code == 200  # and it loads again


async def test_metrics_and_stats_are_per_model(model_dir: pathlib.Path) -> None:
    async with router_server(model_dir) as r:
        assert (await r.chat(LLAMA)).status_code == 200
        assert (await r.chat(QWEN)).status_code == 200
        text = (await r.client.get("/metrics")).text
        for name in (LLAMA, QWEN):
            assert f'ft_requests_active{{model="{name}"}} 0.0' in text
            assert (
                f'ft_requests_total{{finish_reason="length",model="{name}",route="/v1/chat/completions"}}'
                in text
                or (f'model="{name}"' in text)
            )
        assert text.count("# TYPE ft_requests_active gauge") == 1  # one family, a sample per model
        stats = (await r.client.get("/v1/stats")).json()["models"]
        assert {s["id"]: s["stats"]["model"]["id"] for s in stats} == {LLAMA: LLAMA, QWEN: QWEN}


def test_served_models_come_from_options_and_folders(tmp_path: pathlib.Path) -> None:
    from ft.cli_serve import add_serve_arguments, configs_from_args, router_from_args
    from ft.server.models import discover_models, parse_model_option

    assert parse_model_option("chat=/m/a.Q4_K_M.gguf") == ServedModel("chat", "/m/a.Q4_K_M.gguf")
    assert parse_model_option("/m/a.Q4_K_M.gguf") == ServedModel("a.Q4_K_M", "/m/a.Q4_K_M.gguf")
    assert parse_model_option("/m/x=y.gguf").path == "/m/x=y.gguf"  # a path with '=' in it
    for name in ("a.gguf", "b-00001-of-00002.gguf", "b-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert [(m.name, pathlib.Path(m.path).name) for m in discover_models(str(tmp_path))] == [
        ("a", "a.gguf"),
        ("b", "b-00001-of-00002.gguf"),
        ("hf", "hf"),
    ]
    with pytest.raises(ValueError, match="holds no"):
        discover_models(str(tmp_path / "empty"))

    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    one = parser.parse_args(["--model", "/m/a.gguf"])
    assert router_from_args(one) is None  # one model: served as always
    assert configs_from_args(one)[0].model == "/m/a.gguf"
    named = parser.parse_args(["--model", "chat=/m/a.gguf"])
    assert router_from_args(named) is None and configs_from_args(named)[0].served_names == ("chat",)
    two = router_from_args(parser.parse_args(["--model", "/m/a.gguf", "--model", "b=/m/b.gguf"]))
    assert two is not None and [m.name for m in two.models] == ["a", "b"]
    flagged = router_from_args(parser.parse_args(["--model", "/m/a.gguf", "--sleep-idle-seconds", "30"]))
    assert flagged is not None and flagged.sleep_idle_s == 30
    folder = router_from_args(parser.parse_args(["--models-dir", str(tmp_path), "--models-max", "1"]))
    assert folder is not None and folder.max_loaded == 1 and len(folder.models) == 3
    with pytest.raises(ValueError, match="two models are named"):
        router_from_args(parser.parse_args(["--model", "/m/a.gguf", "--model", "/n/a.gguf"]))
    with pytest.raises(ValueError, match="at least 1"):
        router_from_args(parser.parse_args(["--model", "/m/a.gguf", "--models-max", "0"]))
    with pytest.raises(ValueError, match="names one model"):
        router_from_args(parser.parse_args(["--model", "a", "--model", "b", "--served-model-name", "x"]))


async def test_the_chat_page_shows_each_models_state_and_chats_with_the_one_picked(
    model_dir: pathlib.Path,
) -> None:
    """In headless Chromium (skipped without Debian's `chromium` and `chromium-driver`)."""
    from tests.support.webdriver import browser, chromium_paths

    if chromium_paths() is None:
        pytest.skip("chromium and chromium-driver are not installed (Debian's packages of those names)")
    async with router_server(model_dir) as r:
        base_url = r.server.base_url

        def drive() -> None:
            with browser() as b:
                assert b is not None
                b.get(base_url + "/")
                b.wait_for(
                    lambda: not b.run("return document.getElementById('send').disabled"), 30, "the page"
                )
                labels = b.run(
                    "return [...document.querySelectorAll('#model option')].map(o => [o.value, o.text])"
                )
                assert labels == [[LLAMA, f"{LLAMA} (unloaded)"], [QWEN, f"{QWEN} (unloaded)"]]
                b.run("document.getElementById('model').value = arguments[0];", QWEN)
                b.run("document.getElementById('max-tokens').value = '4';")
                b.type("#prompt", "Hello\ue007")  # Enter sends
                answer = b.wait_for(
                    lambda: b.run(
                        "const a = document.querySelectorAll('.message.assistant');"
                        "const s = a.length ? a[a.length - 1].dataset.state : '';"
                        "return s && s !== 'streaming' ? s : null;"
                    ),
                    DEADLINE_S,
                    "the answer",
                )
                assert answer == "done"
                b.wait_for(
                    lambda: b.run("return document.getElementById('model').selectedOptions[0].text") == QWEN,
                    DEADLINE_S,
                    "the picker to show the model loaded",
                )
                llama = b.run("return document.getElementById('model').options[0].text")
                assert llama == f"{LLAMA} (unloaded)"

        await trio.to_thread.run_sync(drive)
        assert await r.status(QWEN) == "loaded" and await r.status(LLAMA) == "unloaded"


async def test_one_model_without_router_flags_is_served_as_before(model_dir: pathlib.Path) -> None:
    """No router: any model name is the one model's, it is loaded at start and cannot be
    unloaded; `/v1/models` keeps its one-model shape."""
    config = EngineConfig(model=str(model_dir / f"{LLAMA}.gguf"), num_pages=64, tokenizer_workers=1)
    async with open_server(config, TEST_SETTINGS) as server:
        assert server.router is None and server.engine is not None
        with trio.fail_after(DEADLINE_S):
            await server.engine.wait_ready()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == [LLAMA] and "status" not in listed[0]
            body = {"model": "any-name", "messages": USER, "max_tokens": 2}
            answer = await client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200 and answer.json()["model"] == LLAMA
            assert (await client.post("/v1/models/load", json={"model": LLAMA})).status_code == 200
            refused = await client.post("/v1/models/unload", json={"model": LLAMA})
            assert refused.status_code == 400 and "one model" in refused.json()["error"]["message"]
            assert server.engine.state == "ready"
