"""One model id from the first second of loading on, its aliases, and `/v1/models`' limits."""

from __future__ import annotations

import logging
import pathlib
import threading
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.engine.fake import FakeRunner
from ft.engine.loading import EngineHooks
from ft.server import ServerSettings
from tests.support.engine import fake_hooks, fake_parts
from tests.support.parallel import serve_process
from tests.support.server import TEST_SETTINGS, fake_server, running_server

USER = [{"role": "user", "content": "hi"}]
DEFAULT_ID = "SmolLM2-135M-Instruct.Q4_1"  # the default model's file, without `.gguf`
STRICT = ServerSettings(port=0, graceful_timeout_s=0.5, strict_model_names=True)

# One request per route that names a model, and where its answer says which model answered.
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/messages", {"messages": USER, "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
]


def loading_until(release: threading.Event) -> EngineHooks:
    """The fake model's hooks, its load held until `release` is set."""
    load = fake_parts(FakeRunner())

    def slow_load(config: EngineConfig):  # type: ignore[no-untyped-def]
        release.wait(10)
        return load(config)

    return fake_hooks(load_model=slow_load)


async def test_the_id_shown_while_loading_is_the_id_served_once_loaded() -> None:
    """/health names the model while it loads; that id is what /v1/models lists, what requests
    are accepted with under --strict-model-names, and what their answers say."""
    release = threading.Event()
    hooks = loading_until(release)
    async with (
        running_server(EngineConfig(num_pages=64), hooks=hooks, settings=STRICT, wait_ready=False) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        loading = (await c.get("/health")).json()
        assert loading["status"] == "loading" and loading["model"] == DEFAULT_ID
        release.set()
        with trio.fail_after(30):
            await s.engine.wait_ready()
        assert (await c.get("/health")).json()["model"] == DEFAULT_ID
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [DEFAULT_ID]
        for path, body in ROUTES:
            r = await c.post(path, json=body | {"model": DEFAULT_ID})
            assert r.status_code == 200 and r.json()["model"] == DEFAULT_ID, path


@pytest.mark.parametrize(
    "alias",
    [
        "SmolLM2-135M-Instruct",  # what the README and `ft serve --help` call the default model
        "HuggingFaceTB/SmolLM2-135M-Instruct",  # the repository's name
        "SmolLM2-135M-Instruct.Q4_1.gguf",  # the file's name
        "smollm2-135m-instruct.q4_1",  # any case
    ],
)
async def test_the_models_aliases_are_accepted_and_answered_with_its_id(alias: str) -> None:
    """Under --strict-model-names the file's names are accepted; answers name the id."""
    async with (
        fake_server(settings=STRICT, served_model_name=None) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        for path, body in ROUTES:
            r = await c.post(path, json=body | {"model": alias})
            assert r.status_code == 200 and r.json()["model"] == DEFAULT_ID, path


async def test_an_unknown_model_is_a_404_in_each_dialect_under_strict_names() -> None:
    """With --strict-model-names another name is a 404 in the route's own error shape."""
    async with (
        fake_server(settings=STRICT) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        for path, body in ROUTES:
            r = await c.post(path, json=body | {"model": "gpt-9"})
            assert r.status_code == 404, path
            error = r.json()["error"]
            if path == "/v1/messages":
                assert error["type"] == "not_found_error"
            else:
                assert error["code"] == "model_not_found" and error["param"] == "model"
        r = await c.post("/v1/tokenize", json={"prompt": "a", "model": "gpt-9"})
        assert r.status_code == 404
        assert (await c.get("/v1/models/gpt-9")).status_code == 404


async def test_any_model_name_is_served_by_the_model_by_default() -> None:
    """Without --strict-model-names a client's own model name (an agent's default) is served
    by the one model, and the answer names the model that answered."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for path, body in ROUTES:
            for name in ("gpt-4o", "claude-haiku-4-5", "x" * 256):
                r = await c.post(path, json=body | {"model": name})
                assert r.status_code == 200 and r.json()["model"] == "fake", (path, name)
        r = await c.get("/v1/models/gpt-4o")
        assert r.status_code == 200 and r.json()["id"] == "fake"
        # A path longer than any name (or a request's `model`) is no model's.
        assert (await c.get("/v1/models/" + "x" * 257)).status_code == 404
        assert s.engine.model_id == "fake"


async def test_several_served_names_are_each_listed_and_the_first_answers() -> None:
    """--served-model-name a b: both are listed and accepted; answers name the first."""
    async with (
        fake_server(settings=STRICT, served_model_name=("a", "org/b")) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        data = (await c.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == ["a", "org/b"]
        assert "org/b" in data[0]["aliases"] and DEFAULT_ID in data[0]["aliases"]
        r = await c.post("/v1/chat/completions", json={"model": "org/b", "messages": USER, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "a"
        assert (await c.get("/v1/models/org/b")).json()["id"] == "org/b"
        assert (await c.get(f"/v1/models/{DEFAULT_ID}")).json()["id"] == "a"


async def test_models_entries_carry_the_runtime_context_and_capabilities() -> None:
    """Each entry says the context a prompt and its output share at runtime (after
    --max-model-len) and what ft does with the model, so an agent can size its prompts."""
    async with (
        fake_server(context_length=2048, max_model_len=512, reasoning_parser="think") as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        (entry,) = (await c.get("/v1/models")).json()["data"]
        assert entry["context_length"] == entry["max_model_len"] == 512
        assert entry["capabilities"] == {
            "tools": True,
            "reasoning": True,
            "vision": False,
            "embeddings": True,
            "rerank": "cosine",  # no classification head: rerank compares embeddings
        }
        assert (await c.get("/v1/models/fake")).json() == entry
        # The limit is the one requests meet: a prompt past it is a 400 naming the counts.
        r = await c.post("/v1/completions", json={"prompt": "x" * 600, "max_tokens": 1})
        assert r.status_code == 400 and "512" in r.json()["error"]["message"]
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        (entry,) = (await c.get("/v1/models")).json()["data"]
        assert entry["context_length"] == 2048 and entry["capabilities"]["reasoning"] is False


async def test_models_is_503_while_loading_then_lists_the_model() -> None:
    """GET /v1/models and /v1/models/{id} are 503 until the model is ready (a load balancer
    sends no traffic that would fail)."""
    release = threading.Event()
    config = EngineConfig(num_pages=64, served_model_name="fake")
    async with (
        running_server(config, hooks=loading_until(release), settings=TEST_SETTINGS, wait_ready=False) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=10) as c,
    ):
        assert (await c.get("/v1/models")).status_code == 503
        assert (await c.get("/v1/models/fake")).status_code == 503
        release.set()
        with trio.fail_after(30):
            await s.engine.wait_ready()
        assert (await c.get("/v1/models/fake")).status_code == 200


async def test_other_model_names_are_logged_once_each_up_to_a_bound(caplog: pytest.LogCaptureFixture) -> None:
    """The first request for a name that is not the model's is logged, once per name, for the
    first MAX_LOGGED_MODEL_NAMES names only: names cannot grow the log or the memory."""
    from ft.server.generation.context import MAX_LOGGED_MODEL_NAMES

    caplog.set_level(logging.INFO, logger="ft.server")
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        for _ in range(2):
            for i in range(MAX_LOGGED_MODEL_NAMES + 4):
                body = {"model": f"other-{i}", "prompt": "hi", "max_tokens": 1}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "are served by" in r.getMessage()]
    assert len(logged) == MAX_LOGGED_MODEL_NAMES
    assert len(set(logged)) == MAX_LOGGED_MODEL_NAMES and "'other-0'" in logged[0]


@pytest.mark.slow  # the real default model in a real `ft serve`
async def test_ft_serve_shows_one_id_from_its_first_answer_and_accepts_the_readmes_name(
    tmp_path: pathlib.Path,
) -> None:
    """`ft serve --strict-model-names`: /health's first answer names the model as /v1/models
    does once loaded, and the name the README and --help use is accepted (every client's first
    try was a 404: loading said SmolLM2-135M-Instruct, loaded SmolLM2-135M-Instruct.Q4_1)."""
    async with (
        serve_process(["--strict-model-names"], tmp_path / "serve.log") as (_, url),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        first = (await c.get("/health")).json()["model"]
        with trio.fail_after(120):
            while (await c.get("/health")).json()["status"] != "ok":
                await trio.sleep(0.1)
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [first] == [DEFAULT_ID]
        for name in (first, "SmolLM2-135M-Instruct"):
            body = {"model": name, "messages": USER, "max_tokens": 1}
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["model"] == first
