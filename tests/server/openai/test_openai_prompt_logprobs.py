"""Prompt logprobs on /v1/completions (`echo` with `logprobs`, as vLLM answers lm-eval), on the
fake model: the shapes, `max_tokens: 0`, streaming. The numbers: tests/model/test_prompt_logprobs."""

from __future__ import annotations

import httpx
import trio

from tests.support.server import fake_server, health_watch, loop_load, parse_sse

PROMPT = "Paris is"  # the fake model's byte tokenizer: one token per byte (and no BOS)


async def complete(c: httpx.AsyncClient, **body: object) -> httpx.Response:
    with trio.fail_after(30):
        return await c.post("/v1/completions", json={"prompt": PROMPT} | body)


async def test_echo_with_logprobs_scores_every_prompt_token_but_the_first() -> None:
    """Echo with logprobs N: the prompt's tokens, a null logprob for the first, then each
    token's logprob and top-N alternatives (with the token itself), then the generated ones."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await complete(c, echo=True, logprobs=1, max_tokens=2)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        lp = choice["logprobs"]
        n = r.json()["usage"]["prompt_tokens"]
        assert "".join(lp["tokens"][:n]) == PROMPT and len(lp["tokens"]) == n + 2
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        for token, top in zip(lp["tokens"][1:n], lp["top_logprobs"][1:n], strict=True):
            assert token in top
        assert lp["text_offset"][:n] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]


async def test_max_tokens_zero_with_echo_returns_the_scored_prompt_only() -> None:
    """lm-eval's loglikelihood request (echo, max_tokens 0, logprobs 1): the prompt and its
    logprobs, nothing generated, finish reason `length`, no completion tokens."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await complete(c, echo=True, logprobs=1, max_tokens=0, temperature=0)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        n = r.json()["usage"]["prompt_tokens"]
        assert len(choice["logprobs"]["tokens"]) == n
        assert choice["logprobs"]["token_logprobs"][1:] == [-1.0] * (n - 1)
        assert r.json()["usage"]["completion_tokens"] == 0
        streamed = parse_sse((await complete(c, echo=True, logprobs=1, max_tokens=0, stream=True)).text)
        chunks = [f["choices"][0] for f in streamed if f != "[DONE]" and f["choices"]]
        assert "".join(ch["text"] for ch in chunks) == PROMPT
        tokens = [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
        logprobs = [x for ch in chunks if ch["logprobs"] for x in ch["logprobs"]["token_logprobs"]]
        assert len(tokens) == n and logprobs == [None] + [-1.0] * (n - 1)
        assert chunks[-1]["finish_reason"] == "length"


async def test_max_tokens_zero_without_echo_is_a_400_naming_it() -> None:
    """max_tokens 0 without echo would return nothing at all: a 400 naming the field."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await complete(c, max_tokens=0)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_logprobs_without_echo_do_not_score_the_prompt() -> None:
    """Without echo only the generated tokens have logprobs (the prompt is not scored)."""
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await complete(c, logprobs=1, max_tokens=2)
        assert r.json()["choices"][0]["logprobs"]["tokens"] == ["H", "e"]


async def test_a_large_scored_echo_keeps_health_answering() -> None:
    """A scored echo near the entry limit (16 x 1000 prompt tokens, logprobs 5: 112k entries)
    is built off the loop: no step on the loop takes a fair part of the build, and /health
    keeps answering."""
    prompts = [[65 + i] * 1000 for i in range(16)]
    body = {"prompt": prompts, "echo": True, "logprobs": 5, "max_tokens": 0}
    async with fake_server(num_pages=4096) as s, httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        async with health_watch(s.base_url), loop_load() as load:
            with trio.fail_after(60):
                r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == 1000
        assert load.longest_step_s < load.off_loop_s / 2, load  # CPU, measured in this run


async def test_max_tokens_zero_scores_a_prompt_that_fills_the_context() -> None:
    """lm-eval's loglikelihood truncates each request to the model's length (`inp[-max_length:]`)
    and sends it with echo, logprobs and max_tokens 0: a prompt of exactly the context is scored
    (vLLM accepts prompt + max_tokens <= max_model_len), not a 400."""
    context = 256
    body = {"prompt": [[65] * context], "echo": True, "logprobs": 1, "max_tokens": 0}
    async with fake_server(context_length=context) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        with trio.fail_after(30):
            fits = await c.post("/v1/completions", json=body | {"prompt": [[65] * (context - 1)]})
            assert fits.status_code == 200, fits.text
            r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text[:500]
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == context


async def test_max_tokens_zero_ignores_a_grammar_it_would_not_use() -> None:
    """Nothing is generated, so nothing is constrained: a `response_format` beside max_tokens 0
    costs no compile and changes nothing."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with fake_server() as s, httpx.AsyncClient(base_url=s.base_url) as c:
        r = await complete(c, echo=True, logprobs=1, max_tokens=0, response_format=schema)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["text"] == PROMPT and r.json()["usage"]["completion_tokens"] == 0
