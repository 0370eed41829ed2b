"""`/v1/messages` as Claude Code 2.1 sends it: system turns inside `messages`, the billing-header
block, `output_config`, `thinking`, `context_management`, `cache_control`, `GET`/`HEAD /`, and
hostile variants of each (fake model; the SDK's `messages.parse` on the real one lives in
`test_anthropic_e2e.py`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
import trio

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.fake import CHATML, SPECIALS, FakeRunner, byte_tokenizer_spec, text_script
from ft.engine.loading import ModelParts
from ft.server import RunningServer
from ft.server.anthropic.format import is_header_block, template_messages
from ft.server.anthropic.schemas import MessagesRequest
from ft.server.generation.structured import anthropic_output
from ft.tokenizer.job import renders_mid_system
from ft.tokenizer.template import render_chat
from tests.support.chat_templates import TEMPLATES
from tests.support.engine import fake_hooks, fake_parts
from tests.support.gguf_files import default_model_raw
from tests.support.server import parse_sse, running_server, wait_idle

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;"
AGENT_PROMPT = "You are an interactive agent that helps users with software engineering tasks. " * 15
MID_SYSTEM = "Available agent types for the Agent tool: claude, Explore."
PAGE_SIZE = EngineConfig().page_size


def claude_code_body(billing_suffix: str = "1c0", **extra: Any) -> dict[str, Any]:
    """A request shaped like Claude Code 2.1's first `claude -p` turn (captured, shortened)."""
    ephemeral = {"type": "ephemeral"}
    return {
        "model": "fake",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": BILLING.format(billing_suffix)},
            {"type": "text", "text": "You are a Claude agent.", "cache_control": ephemeral},
            {"type": "text", "text": AGENT_PROMPT, "cache_control": ephemeral},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>Today is 2026-12-01.</system-reminder>"},
                    {"type": "text", "text": "say hello", "cache_control": ephemeral},
                ],
            },
            {"role": "system", "content": MID_SYSTEM},
        ],
        "tools": [
            {
                "name": "Write",
                "description": "Write a file.",
                "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
                "cache_control": ephemeral,
            }
        ],
        "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    } | extra


class PromptLog:
    """The prompts the fake runner was fed (byte tokens decoded), one per sequence."""

    def __init__(self) -> None:
        self._pieces: dict[int, dict[int, tuple[int, ...]]] = {}

    def __call__(self, works: list[SeqWork]) -> None:
        for w in works:
            if w.num_generated == 0:
                self._pieces.setdefault(w.seq_id, {})[w.start_pos] = w.token_ids

    def prompt_ids(self) -> list[list[int]]:
        """Each sequence's fed prompt tokens, in order (a cached prefix is not fed)."""
        return [
            [i for _, piece in sorted(self._pieces[k].items()) for i in piece] for k in sorted(self._pieces)
        ]

    def prompts(self) -> list[str]:
        """`prompt_ids` as text."""
        return [decode(ids) for ids in self.prompt_ids()]


def decode(ids: list[int]) -> str:
    """The byte tokenizer's text of `ids` (special tokens as themselves)."""
    out, run = [], bytearray()
    for i in ids:
        if i < len(SPECIALS):
            out.append(run.decode() + SPECIALS[i])
            run = bytearray()
        else:
            run.append(i - len(SPECIALS))
    return "".join(out) + run.decode()


def with_template(template: str, runner: FakeRunner) -> Callable[[EngineConfig], ModelParts]:
    """The fake model's loader, with another chat template."""
    load = fake_parts(runner, context_length=8192)

    def loader(config: EngineConfig) -> ModelParts:
        parts = load(config)
        return replace(parts, tokenizer=replace(parts.tokenizer, chat_template=template))

    return loader


@asynccontextmanager
async def template_server(template: str, log: PromptLog) -> AsyncIterator[RunningServer]:
    """A fake-model server whose chat template is `template`."""
    runner = FakeRunner(text_script("Hello."))
    hooks = fake_hooks(runner, before_step=log, load_model=with_template(template, runner))
    async with running_server(EngineConfig(num_pages=512), hooks=hooks) as server:
        yield server


def default_template() -> str:
    """The default model's chat template (skips when the model is not cached)."""
    raw = default_model_raw()
    (kv,) = [kv for kv in raw.kvs if kv.key == "tokenizer.chat_template"]
    return kv.payload[8:].decode()  # a GGUF string: u64 length, then the bytes


# --- system turns inside messages ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "in_place"),
    [
        ("chatml", True),
        ("qwen-2.5", True),
        ("qwen-3", True),
        ("llama-3", True),
        ("mistral-v0.1", False),  # roles must alternate user/assistant
        ("mistral-v0.3", False),  # likewise, after the first system message
        ("gemma-2", False),  # refuses a system role
        ("deepseek-r1", False),  # gathers every system message at the front
        ("smollm3", False),  # renders only the first system message
    ],
)
def test_load_probe_finds_where_system_turns_render_in_place(name: str, in_place: bool) -> None:
    """The load-time probe says which templates render a system turn between two others."""
    template = CHATML if name == "chatml" else TEMPLATES[name]
    spec = replace(byte_tokenizer_spec(), chat_template=template, bos_token="<s>")
    assert renders_mid_system(spec) is in_place


def test_the_default_models_template_renders_system_turns_in_place() -> None:
    """SmolLM2's template renders every role where it is."""
    spec = replace(byte_tokenizer_spec(), chat_template=default_template())
    assert renders_mid_system(spec)


def request(messages: list[dict[str, Any]], system: Any = None) -> MessagesRequest:
    body: dict[str, Any] = {"max_tokens": 8, "messages": messages}
    if system is not None:
        body["system"] = system
    return MessagesRequest.model_validate(body)


USER_A = {"role": "user", "content": "A"}
ASSISTANT_B = {"role": "assistant", "content": "B"}
SYSTEM_S = {"role": "system", "content": [{"type": "text", "text": "S"}]}
USER_C = {"role": "user", "content": "C"}


def test_system_turns_stay_in_place_where_the_template_renders_them() -> None:
    """With a template that renders them, system turns are system messages where they were."""
    req = request([USER_A, ASSISTANT_B, SYSTEM_S, USER_C, SYSTEM_S], system="P")
    roles = [(m["role"], m["content"]) for m in template_messages(req, system_turns=True)]
    assert roles == [
        ("system", "P"),
        ("user", "A"),
        ("assistant", "B"),
        ("system", "S"),
        ("user", "C"),
        ("system", "S"),
    ]


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        # Mid-conversation: into the next user turn.
        ([USER_A, ASSISTANT_B, SYSTEM_S, USER_C], [("user", "A"), ("assistant", "B"), ("user", "S\n\nC")]),
        # Last (Claude Code's shape): into the user turn before it.
        ([USER_A, SYSTEM_S], [("user", "A\n\nS")]),
        # After an assistant turn, at the end: a user turn of its own.
        ([USER_A, ASSISTANT_B, SYSTEM_S], [("user", "A"), ("assistant", "B"), ("user", "S")]),
        # Before any other turn: part of the system prompt.
        ([SYSTEM_S, USER_A], [("system", "P\n\nS"), ("user", "A")]),
    ],
)
def test_system_turns_fold_into_the_neighbouring_user_turn_for_strict_templates(
    messages: list[dict[str, Any]], expected: list[tuple[str, str]]
) -> None:
    """Where the template cannot render them, system turns keep their place as user text."""
    got = template_messages(request(messages, system="P"), system_turns=False)
    if expected[0][0] != "system":
        expected = [("system", "P"), *expected]
    assert [(m["role"], m["content"]) for m in got] == expected


@pytest.mark.parametrize(
    "name", ["mistral-v0.1", "mistral-v0.3", "gemma-2", "gemma-3", "deepseek-r1", "smollm3"]
)
def test_folded_system_turns_render_on_strict_templates(name: str) -> None:
    """Claude Code's conversation shapes render, with the system turn's text, on strict templates."""
    for messages in ([USER_A, SYSTEM_S], [USER_A, ASSISTANT_B, SYSTEM_S, USER_C]):
        folded = template_messages(request(messages), system_turns=False)
        text = render_chat(TEMPLATES[name], folded, bos_token="<s>", eos_token="</s>")
        assert "S" in text.replace("<s>", "").replace("</s>", "")


@pytest.mark.parametrize("name", ["chatml", "mistral-v0.3"])
async def test_claude_code_request_streams_on_lenient_and_strict_templates(name: str) -> None:
    """Claude Code's request shape is answered, with the system turn in the prompt after the user's
    text: as a system turn on ChatML, folded into the user's turn on Mistral's strict template."""
    log = PromptLog()
    template = CHATML if name == "chatml" else TEMPLATES[name]
    async with template_server(template, log) as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        r = await c.post("/v1/messages?beta=true", json=claude_code_body(), headers={"anthropic-beta": "x"})
        assert r.status_code == 200, r.text
        kinds = [e["type"] for e in parse_sse(r.text)]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        counted = await c.post("/v1/messages/count_tokens", json=claude_code_body() | {"stream": None})
        assert counted.status_code == 200, counted.text
        (ids,) = log.prompt_ids()
        assert counted.json()["input_tokens"] == len(ids)
        prompt = decode(ids)
        assert prompt.index("say hello") < prompt.index(MID_SYSTEM)
        if name == "chatml":
            assert f"<|im_start|>system\n{MID_SYSTEM}<|im_end|>" in prompt
        else:
            assert prompt.count("[INST]") == 1 and prompt.index(MID_SYSTEM) < prompt.index("[/INST]")


@pytest.mark.parametrize("tail", ["system turn", "text in the result's turn"])
async def test_system_turn_after_a_tool_result_renders_on_a_strict_template(tail: str) -> None:
    """Claude Code's turn after a tool call (tool_use, tool_result, then its system turn last,
    or text beside the result) is answered on Mistral v0.3's strict template, the text in the
    prompt (before: 400, "roles must alternate")."""
    call_id = "abcdefghi"  # Mistral's template wants nine alphanumerics
    result = {"type": "tool_result", "tool_use_id": call_id, "content": "ok"}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "say hello"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "Write", "input": {}}]},
    ]
    if tail == "system turn":
        messages += [{"role": "user", "content": [result]}, {"role": "system", "content": MID_SYSTEM}]
    else:
        messages += [{"role": "user", "content": [result, {"type": "text", "text": MID_SYSTEM}]}]
    log = PromptLog()
    async with (
        template_server(TEMPLATES["mistral-v0.3"], log) as s,
        httpx.AsyncClient(base_url=s.base_url, timeout=30) as c,
    ):
        with trio.fail_after(30):
            r = await c.post("/v1/messages", json=claude_code_body(messages=messages, stream=False))
        assert r.status_code == 200, r.text[:500]
        (ids,) = log.prompt_ids()
        assert MID_SYSTEM in decode(ids)


# --- the billing header and the prefix cache ---------------------------------------------------


def test_only_one_line_x_anthropic_header_blocks_are_metadata() -> None:
    """The header rule is narrow: one short line shaped `x-anthropic-<name>: value`."""
    assert is_header_block(BILLING.format("1c0"))
    assert is_header_block("x-anthropic-billing-header: cc_version=2.1.197.abc; cch=0f3a1;\n")
    assert not is_header_block("You are Claude Code.")
    assert not is_header_block(BILLING.format("1c0") + "\nYou are Claude Code.")
    assert not is_header_block("Note: x-anthropic-billing-header: cc_version=1")
    assert not is_header_block("x-anthropic-billing-header: " + "a" * 2000)


async def test_billing_header_is_left_out_so_the_next_turn_reads_the_prefix_cache() -> None:
    """Two turns whose billing headers differ share their whole prompt prefix: the second reads
    all but its last page from the cache, and neither prompt holds the header."""
    log = PromptLog()
    async with template_server(CHATML, log) as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as c:
        usages = []
        for suffix in ("1c0", "7f2"):
            r = await c.post("/v1/messages", json=claude_code_body(suffix, stream=False))
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        first, second = usages
        prompt_tokens = first["input_tokens"] + first["cache_read_input_tokens"]
        assert second["input_tokens"] + second["cache_read_input_tokens"] == prompt_tokens > 1000
        assert second["cache_read_input_tokens"] >= prompt_tokens - PAGE_SIZE
        assert all("x-anthropic" not in p for p in log.prompts())


# --- output_config, thinking, GET / ----------------------------------------------------------


def test_output_config_format_is_structured_output() -> None:
    """`output_config.format` is the same JSON-schema constraint as `output_format`."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "schema": schema}
    new = anthropic_output(
        MessagesRequest.model_validate(
            {"max_tokens": 8, "messages": [USER_A], "output_config": {"format": fmt, "effort": "low"}}
        )
    )
    old = anthropic_output(
        MessagesRequest.model_validate({"max_tokens": 8, "messages": [USER_A], "output_format": fmt})
    )
    assert new is not None and old is not None
    assert (new.kind, json.loads(new.source)) == (old.kind, json.loads(old.source)) == ("json_schema", schema)
    assert new.param == "output_config.format.schema"


async def test_thinking_sets_the_templates_enable_thinking() -> None:
    """`thinking` reaches the template as `enable_thinking` (Qwen 3 writes an empty think block
    when it is off); `adaptive` means on."""
    log = PromptLog()
    async with template_server(TEMPLATES["qwen-3"], log) as s, httpx.AsyncClient(base_url=s.base_url) as c:
        for thinking in ("disabled", "adaptive"):
            body = {"max_tokens": 4, "messages": [USER_A], "thinking": {"type": thinking}}
            r = await c.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
        off, on = log.prompts()
        assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")


async def test_get_and_head_on_the_root_answer_200(server: RunningServer) -> None:
    """Clients probe the base URL first (Claude Code: `HEAD /`); it is the chat page (with
    `--no-web-ui` the JSON status: tests/server/web/test_web_page.py)."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as c:
        head = await c.head("/")
        assert head.status_code == 200 and head.content == b""
        got = await c.get("/")
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/html")


# --- hostile variants --------------------------------------------------------------------------


HUGE = "x" * (1 << 20)
DEEP: Any = {"type": "object"}
for _ in range(200):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"output_config": {"effort": ""}}, "effort"),
        ({"output_config": {"effort": HUGE}}, "effort"),
        ({"output_config": {"format": {"type": "regex", "schema": {}}}}, "format"),
        ({"output_config": {"format": {"type": "json_schema", "schema": DEEP}}}, "nested deeper"),
        (
            {
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
                "output_format": {"type": "json_schema", "schema": {"type": "object"}},
            },
            "output_config.format",
        ),
        ({"output_config": HUGE}, "output_config"),
        ({"context_management": {"edits": [{"type": "clear_thinking_20251015"}] * 10_000}}, "edits"),
        ({"context_management": {"edits": [{"type": HUGE}]}}, "type"),
        ({"context_management": {"edits": HUGE}}, "edits"),
        ({"thinking": {"type": "always"}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2**64}}, "budget_tokens"),
        (
            {"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]},
            "cache_control",
        ),
        (
            {"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": HUGE}}]},
            "ttl",
        ),
        ({"tools": [{"name": "t", "input_schema": {}, "cache_control": HUGE}]}, "cache_control"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": []}]}]},
            "cache_control",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "cache_control": {"type": 1}}
                        ],
                    }
                ]
            },
            "cache_control",
        ),
        (
            {
                "messages": [
                    USER_A,
                    {
                        "role": "system",
                        "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}],
                    },
                ]
            },
            "system turn",
        ),
        (
            {
                "messages": [
                    USER_A,
                    {
                        "role": "system",
                        "content": [{"type": "image", "source": {"type": "base64", "data": HUGE}}],
                    },
                ]
            },
            "text only",
        ),
        ({"messages": [SYSTEM_S] * 4096}, "user or assistant turn"),
        ({"messages": [USER_A, SYSTEM_S] * 2049}, "messages"),
    ],
)
async def test_hostile_agent_fields_are_400_and_hold_nothing(
    server: RunningServer, extra: dict[str, Any], field: str
) -> None:
    """Each new field's hostile variant is a 400 naming it, streamed or not, and holds nothing."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
        baseline = (await wait_idle(c))["requests"]["active"]
        for stream in (False, True):
            body = {"model": "fake", "max_tokens": 4, "messages": [USER_A], "stream": stream} | extra
            with trio.fail_after(20):
                r = await c.post("/v1/messages", json=body)
            assert r.status_code == 400, r.text[:500]
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and field in error["message"], error["message"][
                :500
            ]
            assert (await wait_idle(c))["requests"]["active"] == baseline
        ok = await c.post("/v1/messages", json=claude_code_body(stream=False))
        assert ok.status_code == 200, ok.text
