"""Grammar specs, their compilation (worker check, limits, cache) and what a matcher accepts."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import random
from collections.abc import Callable

import cbor2
import numpy as np
import pytest
import trio
import trio.testing

from ft.engine import grammars as grammars_module
from ft.engine.fake import byte_tokenizer_spec, run_inline
from ft.engine.grammars import Grammars
from ft.errors import InvalidRequest, Overloaded
from ft.grammar import spec
from ft.grammar.compiled import LLMatcher, grammar_text
from ft.grammar.spec import GrammarSpec
from ft.tokenizer.job import warm_grammar_job
from tests.support.faulty_worker import crashing_grammar_job
from tests.support.grammar import BYTE_VOCAB, byte_matcher, write_byte_spec

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}},
]  # fmt: skip


def accepts(matcher: LLMatcher, text: str) -> bool:
    """Whether `matcher` accepts `text` whole (then EOS)."""
    m = matcher.deep_copy()
    ids = [3 + b for b in text.encode()]
    return m.consume_tokens(ids) and m.is_accepting()


def grammars(tmp_path: pathlib.Path, **kwargs: object) -> Grammars:
    s = byte_tokenizer_spec()
    return Grammars(
        spec_path=write_byte_spec(tmp_path),
        tokenizer_json=s.tokenizer_json,
        eos_token_ids=s.eos_token_ids,
        vocab_size=BYTE_VOCAB,
        **kwargs,  # type: ignore[arg-type]
    )


# --- specs -----------------------------------------------------------------------------------


def test_specs_name_their_field_when_refused() -> None:
    """Each builder refuses a wrong type with an `InvalidRequest` naming the request field."""
    cases = [
        (lambda: spec.json_schema("{not json", "guided_json"), "guided_json"),
        (lambda: spec.json_schema([1, 2], "response_format.json_schema.schema"),
         "response_format.json_schema.schema"),
        (lambda: spec.regex(5, "guided_regex"), "guided_regex"),
        (lambda: spec.grammar(None, "guided_grammar"), "guided_grammar"),
        (lambda: spec.choice([], "guided_choice"), "guided_choice"),
        (lambda: spec.choice(["a", ""], "guided_choice"), "guided_choice"),
        (lambda: GrammarSpec("regex", "x" * (spec.MAX_SOURCE_CHARS + 1), "guided_regex"), "guided_regex"),
    ]  # fmt: skip
    for build, param in cases:
        with pytest.raises(InvalidRequest) as err:
            build()
        assert err.value.param == param


def test_schema_text_keeps_property_order() -> None:
    """Properties stay in the schema's order (generated JSON follows it); equal schemas are equal specs."""
    a = spec.json_schema({"type": "object", "properties": {"z": {}, "a": {}}}, "x")
    assert a.source.index('"z"') < a.source.index('"a"')
    assert a.key == spec.json_schema(json.loads(a.source), "y").key


def test_boolean_schemas_are_any_json_or_a_clear_refusal() -> None:
    """Schema `true` is any JSON value (compact); `false`, which nothing matches, is refused
    naming the field (both were llguidance's "Expecting object schema to apply options")."""
    m = byte_matcher(spec.json_schema(True, "x"))
    assert accepts(m, '{"a": [1, 2]}') and accepts(m, '"s"')
    assert not accepts(m, '{ "a": 1}')
    with pytest.raises(InvalidRequest, match="false") as err:
        spec.json_schema(False, "response_format.json_schema.schema")
    assert err.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("grammar", "good", "bad"),
    [
        (spec.json_schema({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                           "required": ["n"], "additionalProperties": False}, "x"),
         '{"n": 7}', '{"n": 17}'),
        (spec.json_object("x"), '{"a": [1, 2]}', "[1, 2]"),
        (spec.regex(r"[0-9]{3}-[a-z]+", "x"), "123-abc", "12-abc"),
        (spec.choice(["yes", "no"], "x"), "no", "maybe"),
        (spec.grammar('start: "a" b+\nb: "b"', "x"), "abbb", "ba"),  # Lark
        (spec.grammar('root ::= "a" "b"+', "x"), "abb", "a"),  # GBNF
    ],
)  # fmt: skip
def test_each_kind_accepts_its_language(grammar: GrammarSpec, good: str, bad: str) -> None:
    """JSON schema, JSON mode, regex, choice, Lark and GBNF grammars accept and refuse as written."""
    m = byte_matcher(grammar)
    assert accepts(m, good)
    assert not accepts(m, bad)


async def test_a_choice_of_the_most_options_compiles(tmp_path: pathlib.Path) -> None:
    """`MAX_CHOICES` options (prefixes of each other too) compile through the worker's check
    and accept exactly the options: llguidance refuses a rule of over 2000 alternatives."""
    options = [f"o{i}" for i in range(spec.MAX_CHOICES)]
    g = await grammars(tmp_path, executor=run_inline).get(spec.choice(options, "guided_choice"))
    assert accepts(g.template, "o1") and accepts(g.template, "o1234")
    assert not accepts(g.template, "o") and not accepts(g.template, "o4096")


def test_json_is_compact_and_without_free_whitespace() -> None:
    """Separators are ", " and ": "; no other whitespace, so a model cannot pad forever."""
    m = byte_matcher(spec.json_object("x"))
    assert accepts(m, '{"a": 1, "b": 2}')
    assert not accepts(m, '{"a":1}')
    assert not accepts(m, '{ "a": 1}')


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_tool_call_grammar_allows_only_valid_calls(parser: str) -> None:
    """A forced tool choice accepts calls of the allowed tools with valid arguments, nothing else."""

    def call(name: str, args: str) -> str:
        key = "parameters" if parser == "llama3_json" else "arguments"
        body = f'{{"name": "{name}", "{key}": {args}}}'
        return body if parser == "llama3_json" else f"<tool_call>\n{body}\n</tool_call>"

    sep = "; " if parser == "llama3_json" else "\n"
    weather, time_call = call("get_weather", '{"city": "Paris"}'), call("get_time", '{"zone": "utc"}')
    any_tool = byte_matcher(spec.tool_calls(TOOLS, name=None, parallel=True, parser=parser))
    assert accepts(any_tool, weather)
    assert accepts(any_tool, weather + sep + time_call)
    assert not accepts(any_tool, "Sure! " + weather)
    assert not accepts(any_tool, call("get_weather", '{"town": "Paris"}'))
    assert not accepts(any_tool, call("get_time", '{"zone": "mars"}'))
    assert not accepts(any_tool, call("rm_rf", "{}"))
    one = byte_matcher(spec.tool_calls(TOOLS, name="get_time", parallel=False, parser=parser))
    assert accepts(one, time_call)
    assert not accepts(one, weather)
    assert not accepts(one, time_call + sep + time_call)
    with pytest.raises(InvalidRequest):
        spec.tool_calls(TOOLS, name="nope", parallel=True, parser=parser)


def test_auto_tool_choice_with_a_json_answer_allows_either() -> None:
    """`tool_choice: auto` with a JSON format: calls, or the JSON answer, never free text."""
    answer = spec.json_schema(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, "x"
    )
    m = byte_matcher(spec.tool_calls(TOOLS, name=None, parallel=True, parser="hermes", otherwise=answer))
    assert accepts(m, '{"ok": true}')
    assert accepts(m, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')
    assert not accepts(m, "hello")


def test_tool_parameters_with_defs_compile_and_are_followed() -> None:
    """A tool whose parameters use `$defs` and `$ref` (as pydantic writes them) can be forced:
    its references resolve against its own schema, not the grammar's."""
    params = {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}},
    }  # fmt: skip
    tools = [{"type": "function", "function": {"name": "go", "parameters": params}}]
    m = byte_matcher(spec.tool_calls(tools, name=None, parallel=False, parser="hermes"))
    good = '{"name": "go", "arguments": {"where": {"city": "Oslo"}}}'
    assert accepts(m, f"<tool_call>\n{good}\n</tool_call>")
    assert not accepts(m, f"<tool_call>\n{good.replace('city', 'town')}\n</tool_call>")


@pytest.mark.parametrize("parameters", [{}, True, {"properties": {"a": {"type": "integer"}}}, None])
def test_tool_arguments_are_always_an_object(parameters: object) -> None:
    """However loosely a tool's parameters are given, a forced call's arguments are a JSON
    object (what the tool-call parsers accept as a call), never a string or a number."""
    function = {"name": "f"} if parameters is None else {"name": "f", "parameters": parameters}
    m = byte_matcher(spec.tool_calls([{"type": "function", "function": function}], name=None,
                                     parallel=False, parser="hermes"))  # fmt: skip
    assert accepts(m, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert not accepts(m, '<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call>')
    assert not accepts(m, '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>')


@pytest.mark.parametrize("name", ['a"b}', "x\ny", "🌦️ weather", '}\nstart: "pwned"\n%json {'])
def test_tool_names_cannot_inject_grammar(name: str) -> None:
    """A tool name is a literal in the grammar: quotes, braces, newlines and emoji are escaped."""
    tools = [{"type": "function", "function": {"name": name}}]
    m = byte_matcher(spec.tool_calls(tools, name=None, parallel=False, parser="hermes"))
    body = json.dumps({"name": name, "arguments": {}}, ensure_ascii=False, separators=(", ", ": "))
    assert accepts(m, f"<tool_call>\n{body}\n</tool_call>")
    assert not accepts(m, "pwned")


# --- compilation -----------------------------------------------------------------------------

HOSTILE = [
    spec.regex("(x{500}){500}", "guided_regex"),  # costs 130+ ms a token without tighter fuel
    spec.regex("(a{1000}){1000}", "guided_regex"),
    spec.json_schema({"enum": [f"value{i}" for i in range(60_000)]}, "guided_json"),
    spec.json_schema({"type": "string", "pattern": "^(x{500}){500}$"}, "guided_json"),
    spec.json_schema({"$ref": "#/$defs/missing"}, "guided_json"),
    spec.json_schema({"type": "frobnicate"}, "guided_json"),
    spec.grammar("start: undefined_rule", "guided_grammar"),
    spec.regex("(unclosed", "guided_regex"),
]


async def test_hostile_grammars_are_refused_quickly(tmp_path: pathlib.Path) -> None:
    """Invalid grammars and ones that explode llguidance's limits are `InvalidRequest`s naming
    the field, refused by the checks and limits (~0.2-0.5 s each), not by the compile deadline:
    one of a minute (before: minutes), so that a loaded machine's slowness is not a refusal."""
    g = grammars(tmp_path, timeout_s=60.0)
    await g.get(spec.json_object("x"))  # spawn the worker and build its tokenizer first
    for hostile in HOSTILE:
        with pytest.raises(InvalidRequest) as err:
            await g.get(hostile)
        assert err.value.param == hostile.param
        assert "to compile" not in str(err.value), (hostile, err.value)  # not the deadline's refusal


async def test_a_schema_that_crashes_the_compiler_costs_a_worker_not_the_server(
    tmp_path: pathlib.Path,
) -> None:
    """A schema nested thousands deep overflows llguidance's stack: the worker dies, the
    request gets a 400, and the next grammar compiles."""
    depth = 5000  # deeper than Python's json reads: built as text, as llguidance would get it
    deep = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    g = grammars(tmp_path)
    with pytest.raises(InvalidRequest, match="crashed|nested|recursion"):
        await g.get(GrammarSpec("json_schema", deep, "guided_json"))
    with pytest.raises(InvalidRequest, match="cannot be read"):
        spec.json_schema(deep, "guided_json")
    crash = grammars(tmp_path, check_job=crashing_grammar_job)
    with pytest.raises(InvalidRequest, match="crashed its compiler"):
        await crash.get(spec.json_object("x"))
    assert await g.get(spec.regex("[ab]+", "x"))


async def test_a_compiler_past_its_deadline_is_a_400(
    tmp_path: pathlib.Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A compilation that outlives `timeout_s` is cancelled (the worker would be killed); the
    worker's start and tokenizer load do not count (a cold worker is not the grammar's fault).
    Mock time: the compile itself runs inline and takes none of it, however loaded the machine."""

    async def never(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        if job is warm_grammar_job:
            return job(payload)
        await trio.sleep_forever()
        raise AssertionError

    g = grammars(tmp_path, executor=never, timeout_s=5.0)
    with pytest.raises(InvalidRequest, match="longer than 5 s"):
        await g.get(spec.json_object("x"))

    async def cold(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        await trio.sleep(0.3 if job is warm_grammar_job else 0.0)  # a worker spawning
        return job(payload)

    assert await grammars(tmp_path, executor=cold, timeout_s=0.2).get(spec.json_object("x"))


async def test_the_deadline_runs_from_when_a_worker_is_free(
    tmp_path: pathlib.Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A burst of new specs queued for the workers is not refused (and the refusal cached)
    for the time spent waiting: each gets `timeout_s` of its own compiling (mock time)."""
    one_worker = trio.CapacityLimiter(1)

    async def slow(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        async with one_worker:
            await trio.sleep(0.3)
            return job(payload)

    g = grammars(tmp_path, executor=slow, timeout_s=1.0, workers=1, max_compiles=5)
    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(g.get, spec.regex(f"a{i}", "guided_regex"))
    assert g.num_compiled == 5


async def test_each_spec_compiles_once_refusals_too(tmp_path: pathlib.Path) -> None:
    """Equal specs share one compilation (concurrent ones wait for it); a refusal is remembered.
    Each request gets a template of its own, built from the checked text."""
    g = grammars(tmp_path, executor=run_inline)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(g.get, spec.json_schema(schema, "x"))
    assert g.num_compiled == 1
    first = await g.get(spec.json_schema(schema, "y"))
    second = await g.get(spec.json_schema(schema, "z"))
    assert first.template is not second.template and accepts(second.template, '{"a": 1}')
    for _ in range(3):
        with pytest.raises(InvalidRequest):
            await g.get(spec.regex("(", "guided_regex"))
    assert g.num_compiled == 2


async def test_the_cache_is_bounded_by_the_bytes_it_holds(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache keeps checked texts (no matcher: each request builds its own), measured in
    bytes with their sources: at most `CACHE_BYTES` (the newest first)."""
    monkeypatch.setattr(grammars_module, "CACHE_BYTES", 2500)
    g = grammars(tmp_path, executor=run_inline)
    for i in range(5):
        await g.get(spec.choice([f"{i}" + "x" * 400], "x"))
        assert g.num_retained_bytes <= 2500
    assert len(g) == 2
    huge = spec.choice(["y" * 2000], "x")
    assert (await g.get(huge)).spec == huge  # larger than the budget: served, kept alone
    assert len(g) == 1


async def test_killable_worker_is_the_default(tmp_path: pathlib.Path) -> None:
    """The engine's grammars compile in a trio-parallel worker killed on cancellation."""
    with trio.move_on_after(30):
        assert (await grammars(tmp_path).get(spec.choice(["a", "b"], "x"))).spec.kind == "choice"


@pytest.mark.parametrize(
    "grammar",
    ['start: s\ns: s s | s s s | "a" | "aa" | ""', 'start: s\ns: s s | s s s | "a" | "b" | "ab" | ""'],
)
async def test_ambiguous_grammars_are_refused_at_compile_time(tmp_path: pathlib.Path, grammar: str) -> None:
    """The issue's 46-character grammars, whose every token costs more than the last, are
    found by the walk (the shortest tokens, the lowest, random ones; each timed) and refused:
    a 400 naming the field, before any stream."""
    g = grammars(tmp_path, executor=run_inline)
    with pytest.raises(InvalidRequest, match="too ambiguous|items") as err:
        await g.get(spec.grammar(grammar, "guided_grammar"))
    assert err.value.param == "guided_grammar"


async def test_a_full_compile_queue_refuses_new_specs_and_each_client_gets_a_share(
    tmp_path: pathlib.Path,
) -> None:
    """Behind `max_compiles` slow compiles a new spec is refused at once with `Overloaded`
    (503, Retry-After) instead of queueing behind them; one client holds at most half of the
    queue, so another still gets in; a cached spec never queues."""
    release = trio.Event()

    async def slow(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        await release.wait()
        return job(payload)

    g = grammars(tmp_path, executor=slow, max_compiles=4)
    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(functools.partial(g.get, spec.regex(f"a{i}", "x"), client="flood"))
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(30), pytest.raises(Overloaded):
            await g.get(spec.regex("a9", "x"), client="flood")
        for i in range(2):
            nursery.start_soon(functools.partial(g.get, spec.regex(f"b{i}", "x"), client="other"))
        await trio.testing.wait_all_tasks_blocked()
        assert g.num_compiling == 4
        with trio.fail_after(30), pytest.raises(Overloaded) as err:
            await g.get(spec.regex("tiny", "x"))
        assert err.value.status == 503
        release.set()
    assert g.num_compiling == 0
    assert (await g.get(spec.regex("a0", "x"))).spec.source == "a0"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def test_long_requests_leave_nothing_in_the_cache(tmp_path: pathlib.Path) -> None:
    """A counting regex's lexer grows with every token a request explores (~21 KB a token
    here). Six distinct such grammars, each followed for 1000 tokens by one request: each
    request's template goes with it, so memory stays within about one request's growth
    (templates shared through the cache kept all six: ~125 MiB)."""

    async def unwalked(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        # The walk refuses this class on the byte tokenizer (lone UTF-8 bytes explode it);
        # what is measured here is what a request leaves behind, so skip it.
        asked = cbor2.loads(payload)
        if "kind" not in asked:  # a new worker's warm-up: nothing to start here
            return cbor2.dumps({})
        return cbor2.dumps({"grammar": grammar_text(GrammarSpec(asked["kind"], asked["source"]))})

    g = grammars(tmp_path, executor=unwalked)
    letters = [3 + b for b in b"abcdefghijklmnopqrstuvwxyz0123456789"]
    rng = random.Random(0)
    growth: list[float] = []
    before = _rss_mib()
    for i in range(6):
        m = (await g.get(spec.regex(rf"(?:TAG{i})?[\p{{L}}\p{{N}}]{{1,20000}}", "x"))).matcher()
        mask = np.zeros((BYTE_VOCAB + 31) // 32, dtype=np.int32)
        for _ in range(1000):
            m.llg.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            assert m.llg.consume_token(rng.choice(letters))
        del m
        growth.append(_rss_mib() - before)
    assert g.num_retained_bytes < 64 << 10  # six short texts
    assert growth[-1] < max(2.5 * growth[0], 30), growth


@pytest.mark.parametrize("parser", ["phi4_mini_json", "granite"])
def test_tool_call_grammar_of_the_array_formats_allows_only_valid_calls(parser: str) -> None:
    """Phi-4-mini's and Granite's forced tool choice: one marker, the calls as a JSON array
    (several only when parallel), which the same format's parser reads back."""
    from ft.core.toolcalls import parse_tool_calls

    close = "]<|/tool_call|>" if parser == "phi4_mini_json" else "]"
    weather, time_call = (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{"name": "get_time", "arguments": {"zone": "utc"}}',
    )
    any_tool = byte_matcher(spec.tool_calls(TOOLS, name=None, parallel=True, parser=parser))
    both = f"<|tool_call|>[{weather}, {time_call}{close}"
    assert accepts(any_tool, f"<|tool_call|>[{weather}{close}")
    assert accepts(any_tool, both)
    assert parse_tool_calls(both, parser) == (
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "utc"}')],
    )
    assert not accepts(any_tool, f"Sure! <|tool_call|>[{weather}{close}")
    assert not accepts(any_tool, f'<|tool_call|>[{{"name": "rm_rf", "arguments": {{}}}}{close}')
    one = byte_matcher(spec.tool_calls(TOOLS, name="get_time", parallel=False, parser=parser))
    assert accepts(one, f"<|tool_call|>[{time_call}{close}")
    assert not accepts(one, f"<|tool_call|>[{time_call}, {time_call}{close}")
    assert not accepts(one, f"<|tool_call|>[{weather}{close}")
