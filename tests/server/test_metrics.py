"""/metrics: Prometheus histograms and counters that move with real requests."""

from __future__ import annotations

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from ft.engine.fake import FakeRunner, text_script
from ft.server import ServerSettings
from tests.support.server import TEST_SETTINGS, fake_server, wait_idle

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels` (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


async def scrape(client: httpx.AsyncClient) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


async def test_histograms_and_counters_move_with_a_request(client: httpx.AsyncClient) -> None:
    """Scrape, request, scrape again: every request histogram and token counter moved."""
    before = await scrape(client)
    r = await client.post(CHAT, json={"messages": USER, "max_tokens": 5})
    assert r.status_code == 200
    await wait_idle(client)
    after = await scrape(client)
    model = {"model": "fake"}
    for histogram in (
        "ft_time_to_first_token_seconds",
        "ft_e2e_request_latency_seconds",
        "ft_request_queue_time_seconds",
        "ft_request_prompt_tokens",
        "ft_request_generation_tokens",
    ):
        assert (
            sample(after, f"{histogram}_count", **model) == sample(before, f"{histogram}_count", **model) + 1
        )
    # Five tokens, one per step: four gaps between them.
    itl = "ft_inter_token_latency_seconds_count"
    assert sample(after, itl, **model) == sample(before, itl, **model) + 4
    assert sample(after, "ft_request_generation_tokens_sum", **model) == 5
    assert sample(after, "ft_generation_tokens_total", **model) == 5
    assert sample(after, "ft_prompt_tokens_total", **model) > sample(
        before, "ft_prompt_tokens_total", **model
    )
    assert sample(after, "ft_requests_total", route=CHAT, finish_reason="length") == 1
    assert sample(after, "ft_kv_total_pages", **model) == 256
    assert sample(after, "ft_info", model="fake", state="ready") == 1


async def test_streams_count_by_finish_reason_and_a_client_that_leaves_as_abort() -> None:
    """A stream that ends counts as stop; one whose client leaves counts as abort."""
    runner = FakeRunner(script=text_script("lorem ipsum " * 50), step_s=0.01)
    async with fake_server(runner) as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as c:
        body = {"messages": USER, "stream": True, "max_tokens": 400}
        async with c.stream("POST", CHAT, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # leave mid-stream
        r = await c.post(CHAT, json={"messages": USER, "stream": True, "stop": ["ipsum"]})
        assert r.status_code == 200
        await wait_idle(c)
        with trio.fail_after(30):
            while sample(text := await scrape(c), "ft_requests_total", finish_reason="abort") < 1:
                await trio.sleep(0.02)  # the abandoned request's end is noted once its task ends
        assert sample(text, "ft_requests_total", route=CHAT, finish_reason="stop") == 1


async def test_rejections_are_counted_by_reason(client: httpx.AsyncClient) -> None:
    """A bad body counts as validation; a request while stopping as stopping; probes do not."""
    assert (await client.post(CHAT, json={"messages": "nope"})).status_code == 400
    assert (await client.post(CHAT, content=b"{}", headers={"content-type": "text/plain"})).status_code == 415
    await client.post("/v1/admin/prepare-stop", json={})
    assert (await client.post(CHAT, json={"messages": USER})).status_code == 503
    assert (await client.get("/v1/models")).status_code == 503
    text = await scrape(client)
    assert sample(text, "ft_requests_rejected_total", reason="validation") == 2
    assert sample(text, "ft_requests_rejected_total", reason="stopping") == 1
    assert sample(text, "ft_requests_total") == 0


async def test_metrics_are_open_unless_metrics_require_key() -> None:
    """With an API key, /metrics stays open; with --metrics-require-key it needs the key too."""
    for require, status in ((False, 200), (True, 401)):
        settings = ServerSettings(
            port=0,
            api_key="k",
            metrics_require_key=require,
            graceful_timeout_s=TEST_SETTINGS.graceful_timeout_s,
        )
        async with fake_server(settings=settings) as s, httpx.AsyncClient(base_url=s.base_url) as c:
            assert (await c.get("/metrics")).status_code == status
            keyed = await c.get("/metrics", headers={"Authorization": "Bearer k"})
            assert keyed.status_code == 200 and "ft_requests_active" in keyed.text
            assert (await c.get("/health/ready")).status_code == 200


async def test_two_servers_in_one_process_keep_separate_metrics() -> None:
    """Each server has its own registry: one's requests do not show in the other's metrics."""
    async with (
        fake_server() as a,
        fake_server() as b,
        httpx.AsyncClient(base_url=a.base_url) as ca,
        httpx.AsyncClient(base_url=b.base_url) as cb,
    ):
        assert (await ca.post(CHAT, json={"messages": USER, "max_tokens": 2})).status_code == 200
        assert sample(await scrape(ca), "ft_requests_total") == 1
        assert sample(await scrape(cb), "ft_requests_total") == 0
