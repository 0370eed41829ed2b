"""One path for a generation request, whatever its API: chat, completions, messages, responses.

An API supplies only what differs, as a `GenerationApi`: its body parsed into `PromptSpec`s and
`SamplingParams`, its stream events, its final JSON, its in-stream error. The lifecycle is
here, once (`respond`):

1. **Static checks.** The engine must admit the request (503 otherwise; the admission holds a
   drain open until the HTTP request ends, see `Engine.admit`); every prompt is tokenized
   and checked against the context, the KV pool and `--max-running-requests` (`prepare`).
   Tokenizing takes milliseconds, so a request that can never run is a 4xx, never a 200 with
   an error inside.
2. **Non-streamed:** open the request scope(s), gather every choice, answer `api.body(...)`.
3. **Streamed:** a 200 and `: connected` at once; then, inside the response generator, open the
   scope(s) and multiplex deltas with heartbeats while the request waits for a slot, prefills
   and decodes; end with `api.end(...)`, or `api.error(...)` for a failure after the headers.
   The generator is the only thing that holds a scope, and it is always closed with
   `aclose()` (`aclosing` here, Quart's `IterableBody` outside): a client that leaves cancels
   or closes it at once, never later by the garbage collector.

Along the way the request's `RequestRecord` (`ft.server.edge.tracing`) learns its route, token
counts, time to first token and finish reasons, for its log line and the metrics; its id goes
into each engine request.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, has_request_context, request

from ft.engine.engine import Admission
from ft.engine.stream import Choice, RequestStream
from ft.errors import ContextLengthExceeded, FtError
from ft.messages import Delta
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from ft.server.edge.auth import current_client
from ft.server.edge.http_errors import internal_error
from ft.server.edge.tracing import RequestRecord, current_record
from ft.server.generation.context import ServerContext, json_response, json_response_off_loop
from ft.server.generation.sse import CONNECTED, HEARTBEAT, DeltaMux, MuxResult, sse_error, sse_response
from ft.server.models import ModelSlot


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a whole request: prompt (with the prefix-cache hits among them), output."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    @staticmethod
    def of(streams: Sequence[RequestStream]) -> Usage:
        """The usage of a request's engine streams, summed."""
        return Usage(
            prompt_tokens=sum(s.num_prompt_tokens for s in streams),
            completion_tokens=sum(s.num_completion_tokens for s in streams),
            cached_tokens=sum(s.num_cached_tokens for s in streams),
        )


@dataclass(frozen=True, slots=True)
class Generated:
    """A finished non-streamed request: each prompt's ids and choices, and the usage."""

    prompt_ids: list[tuple[int, ...]]
    choices: list[list[Choice]]
    usage: Usage


class GenerationApi:
    """What one API supplies to the lifecycle; a subclass parses its body in `__init__`.

    `prompts` are opened as one engine request each (completions may send several), with
    `params`, in the prefix-cache partition of the caller's tenant and the body's `cache_salt`.
    Stream methods return the frames to send, so none of them holds anything across
    a `yield`.
    """

    prompts: list[PromptSpec]
    params: SamplingParams
    stream: bool
    prompt_ids: list[tuple[int, ...]]  # each prompt's token ids, set once they are known
    heartbeat: bytes = HEARTBEAT
    # The client chooses its size (echo, logprobs, a stored conversation): the body, or a
    # stream's last frames, are built off the loop.
    is_body_large: bool = False
    tool_calls: bool = False  # set once a tool call was parsed out of the output (for the metrics)
    cache_salt: str | None = None  # the body's `cache_salt` (its prefix-cache partition, with the tenant)

    def start(self, usage: Usage) -> list[bytes]:
        """Frames after `: connected`, before the request opens (`usage` counts the prompt)."""
        return []

    def delta(self, k: int, delta: Delta) -> list[bytes]:
        """Frames for one delta of prompt `k`'s request."""
        raise NotImplementedError

    def end(self, usage: Usage) -> list[bytes]:
        """The last frames of a stream that finished."""
        raise NotImplementedError

    def error(self, err: FtError) -> list[bytes]:
        """The last frames of a stream that failed after its headers went out."""
        raise NotImplementedError

    @classmethod
    def stream_error(cls, err: FtError) -> list[bytes]:
        """The frames of a stream that failed before its request was built (router mode: its
        model did not load after `: connected` went out)."""
        return [sse_error(err)]

    def body(self, done: Generated) -> dict[str, Any]:
        """The JSON body of a non-streamed response."""
        raise NotImplementedError


def sampling_params(
    ctx: ServerContext,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    **fields: Any,
) -> SamplingParams:
    """Engine sampling params; knobs the request leaves unset take the model's defaults.

    Raises:
        InvalidRequest: a combination the engine refuses (naming the field).
    """
    defaults = ctx.engine.generation_defaults

    def pick(name: str, value: float | None, fallback: float) -> float:
        return float(value if value is not None else defaults.get(name, fallback))

    return SamplingParams(
        temperature=pick("temperature", temperature, 1.0),
        top_p=pick("top_p", top_p, 1.0),
        top_k=int(pick("top_k", top_k, 0)),
        min_p=pick("min_p", min_p, 0.0),
        repetition_penalty=pick("repetition_penalty", repetition_penalty, 1.0),
        **fields,
    )


async def respond_model(
    ctx: ServerContext,
    model: str | None,
    build: Callable[[ServerContext], GenerationApi],
    *,
    stream: bool,
    shape: type[GenerationApi],
) -> Response:
    """Run the request `build` makes for the context of `model` through the lifecycle.

    With one model this is `respond(ctx, build(ctx))` (the name checked by `build`). In router
    mode the model is resolved (404 for one not served) and held until the HTTP request ends;
    if it is not loaded, a non-streamed request waits for its load (bounded), and a stream
    answers at once: `: connected` and heartbeats (`shape.heartbeat`) while the model loads,
    then the request is built and checked against it, and any failure before the request
    exists is `shape.stream_error` in-stream.
    """
    router = ctx.router
    if router is None:
        return await respond(ctx, build(ctx))
    slot = ctx.lease_model(model)
    router.check_loadable(slot)  # a model that failed to load is refused before any stream
    engine = slot.ready_engine()
    if engine is None and not stream:
        engine = await router.acquire(slot)
    if engine is not None:
        view = ctx.bind(engine)
        return await respond(view, build(view))
    record = current_record()
    record.route = request.path if has_request_context() else "embedded"
    record.stream = True
    return sse_response(_load_then_stream(ctx, slot, build, shape, record))


async def _load_then_stream(
    ctx: ServerContext,
    slot: ModelSlot,
    build: Callable[[ServerContext], GenerationApi],
    shape: type[GenerationApi],
    record: RequestRecord,
) -> AsyncGenerator[bytes]:
    """A stream whose model loads after its headers: wait with heartbeats, then build, check
    and stream the request as `respond` would."""
    assert ctx.router is not None
    yield CONNECTED
    try:
        deadline, busy_deadline = ctx.router.deadlines()
        engine = None
        while engine is None:
            with trio.move_on_after(ctx.settings.sse_heartbeat_s):
                engine = await ctx.router.acquire(slot, deadline, busy_deadline)
            if engine is None:
                yield shape.heartbeat
        view = ctx.bind(engine)
        api = build(view)
        if ctx.settings.log_prompts:
            record.prompts = [_loggable(prompt) for prompt in api.prompts]
        admission = engine.admit(len(api.prompts))
        if not record.release_at_end(admission.release):
            admission.release()
        prompt_ids = api.prompt_ids = [await prepare(view, p, api.params, admission) for p in api.prompts]
        record.prompt_tokens = sum(len(ids) for ids in prompt_ids)
    except FtError as e:
        record.error = e
        for frame in shape.stream_error(e):
            yield frame
        return
    except Exception as e:  # noqa: BLE001 - reported in-stream, logged
        record.error = internal_error(e)
        for frame in shape.stream_error(record.error):
            yield frame
        return
    async with aclosing(_events(view, api, prompt_ids, record, admission, is_connected=True)) as events:
        async for frame in events:
            yield frame


async def respond(ctx: ServerContext, api: GenerationApi) -> Response:
    """Run `api`'s request through the lifecycle (see the module docstring)."""
    record = current_record()
    record.route = request.path if has_request_context() else "embedded"  # fixed paths: few labels
    record.stream = api.stream
    if ctx.settings.log_prompts:
        record.prompts = [_loggable(prompt) for prompt in api.prompts]
    # Admitted after the body's validation (a bad request is a 400 whatever the load). A drain
    # that begins later still serves it: it waits for the admission, which the HTTP request
    # holds to its end (a stream's work starts only after its headers are sent).
    admission = ctx.engine.admit(len(api.prompts))
    try:
        return await _respond(ctx, api, record, admission)
    finally:
        if not record.release_at_end(admission.release):
            admission.release()  # no HTTP request to hold it (embedded use): released now


async def _respond(
    ctx: ServerContext, api: GenerationApi, record: RequestRecord, admission: Admission
) -> Response:
    prompt_ids = api.prompt_ids = [
        await prepare(ctx, prompt, api.params, admission) for prompt in api.prompts
    ]
    record.prompt_tokens = sum(len(ids) for ids in prompt_ids)
    if api.stream:
        return sse_response(stream_body(ctx, api, prompt_ids, record, admission))
    async with open_requests(ctx, api, prompt_ids, record, admission) as streams:
        choices = await collect(streams, api.params.n, record)
    done = Generated(prompt_ids, choices, Usage.of(streams))
    if ctx.settings.log_prompts:
        record.outputs = [c.text for per_prompt in choices for c in per_prompt]
    if api.is_body_large:
        response = await json_response_off_loop(lambda: api.body(done))
    else:
        response = json_response(api.body(done))
    record.tool_calls = api.tool_calls
    return response


def _loggable(prompt: PromptSpec) -> Any:
    """What `--log-prompts` logs of a prompt: its messages, text or token ids."""
    if prompt.messages is not None:
        return list(prompt.messages)
    return prompt.text if prompt.text is not None else list(prompt.token_ids or ())


async def prepare(
    ctx: ServerContext, prompt: PromptSpec, params: SamplingParams, admission: Admission
) -> tuple[int, ...]:
    """Tokenize `prompt` (admitted: `admission`) and run every static check on it; return its
    token ids. A request the checks refuse is counted as rejected.

    Raises:
        FtError: the prompt cannot be rendered or encoded, or can never fit (a 4xx).
    """
    engine = ctx.engine
    client = current_client()
    if prompt.token_ids is not None:
        ids: Sequence[int] = prompt.token_ids  # checked against the vocabulary by the route
    else:
        # A prompt past the context never fits: refused as soon as that is known.
        with engine.counting_rejections(ContextLengthExceeded):
            ids = await engine.tokenize(
                prompt, admission=admission, client=client, max_tokens=engine.max_model_len
            )
    with engine.counting_rejections():
        engine.check_fits(len(ids), params)
        if params.grammar is not None:
            await engine.check_grammar(params.grammar, client=client)
    return tuple(ids)


@asynccontextmanager
async def open_requests(
    ctx: ServerContext,
    api: GenerationApi,
    prompt_ids: list[tuple[int, ...]],
    record: RequestRecord,
    admission: Admission,
) -> AsyncIterator[list[RequestStream]]:
    """One engine request scope per prompt (named by the record's id, under the HTTP request's
    `admission`, in the prefix-cache partition of the record's tenant and `api.cache_salt`),
    all closed when the block exits; then the record gets their output counts and finish
    reasons (synchronously)."""
    streams: list[RequestStream] = []
    try:
        async with AsyncExitStack() as stack:
            open_request = ctx.engine.open_request
            for ids in prompt_ids:
                scope = open_request(
                    PromptSpec(token_ids=ids, cache_salt=api.cache_salt, tenant=record.tenant),
                    params=api.params,
                    request_id=record.request_id,
                    admission=admission,
                )
                streams.append(await stack.enter_async_context(scope))
            yield streams
    finally:
        usage = Usage.of(streams)
        record.output_tokens, record.cached_tokens = usage.completion_tokens, usage.cached_tokens
        record.finish_reasons = [r for s in streams for _, r in sorted(s.finish_reasons.items())]


async def collect(streams: Sequence[RequestStream], n: int, record: RequestRecord) -> list[list[Choice]]:
    """Every choice of every stream, whole. Raises the first stream error."""
    choices = [[Choice(i) for i in range(n)] for _ in streams]
    mux = DeltaMux(streams)
    while not mux.is_done:
        got = await mux.next(math.inf)
        _note_output(record, got)
        for k, delta in got.deltas:
            choices[k][delta.index].add(delta)
    return choices


def _note_output(record: RequestRecord, got: MuxResult) -> None:
    # a prompt scored with nothing generated (max_tokens 0) answers with its prompt's scores
    if any(delta.token_ids or delta.prompt_logprobs for _, delta in got.deltas):
        record.saw_token()


async def stream_body(
    ctx: ServerContext,
    api: GenerationApi,
    prompt_ids: list[tuple[int, ...]],
    record: RequestRecord,
    admission: Admission,
) -> AsyncIterator[bytes]:
    """The event stream of a streamed request, closed deterministically (`aclosing`)."""
    async with aclosing(_events(ctx, api, prompt_ids, record, admission)) as events:
        async for frame in events:
            yield frame


async def _events(
    ctx: ServerContext,
    api: GenerationApi,
    prompt_ids: list[tuple[int, ...]],
    record: RequestRecord,
    admission: Admission,
    *,
    is_connected: bool = False,
) -> AsyncGenerator[bytes]:
    if not is_connected:
        yield CONNECTED
    outputs: dict[tuple[int, int], list[str]] = {}  # (prompt, choice) -> texts, with --log-prompts
    try:
        for frame in api.start(Usage(sum(len(ids) for ids in prompt_ids))):
            yield frame
        async with open_requests(ctx, api, prompt_ids, record, admission) as streams:
            mux = DeltaMux(streams)
            while not mux.is_done:
                got = await mux.next(ctx.settings.sse_heartbeat_s)
                if got.is_timeout:
                    yield api.heartbeat
                _note_output(record, got)
                for k, delta in got.deltas:
                    if ctx.settings.log_prompts:
                        outputs.setdefault((k, delta.index), []).append(delta.text)
                    if delta.prompt_logprobs:  # a scored prompt's text: linear in it, off the loop
                        frames = await trio.to_thread.run_sync(api.delta, k, delta)
                    else:
                        frames = api.delta(k, delta)
                    for frame in frames:
                        yield frame
        usage = Usage.of(streams)
        ending = await trio.to_thread.run_sync(api.end, usage) if api.is_body_large else api.end(usage)
    except FtError as e:
        record.error = e
        ending = api.error(e)
    except Exception as e:  # noqa: BLE001 - reported in-stream, logged
        record.error = internal_error(e)
        ending = api.error(record.error)
    finally:
        record.tool_calls = api.tool_calls
        record.outputs = ["".join(outputs[key]) for key in sorted(outputs)]
    for frame in ending:
        yield frame
