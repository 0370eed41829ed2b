"""What every route needs: the engine, the settings, and the edge helpers routes share.

Route modules (`openai`, `anthropic`, `responses`, `control`) each expose `register(app, ctx)`;
they read the body with `read_request(ctx, Model)`, check the engine with
`ctx.check_admission()`, and raise `FtError`s that the app's handlers render in the API's shape.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import trio
from pydantic import BaseModel, ValidationError
from quart import Response, request

from ft.engine.engine import Engine
from ft.errors import FtError, InvalidRequest
from ft.params import check_token_ids
from ft.server.edge.body import parse_json, read_body, require_json_content_type, run_sized
from ft.server.edge.http_errors import (
    ErrorFormatter,
    HttpError,
    dumps,
    error_headers,
    openai_error_body,
)
from ft.server.edge.tenants import Tenants
from ft.server.edge.tracing import current_record
from ft.server.metrics import ServerMetrics
from ft.server.models import ModelRouter, ModelSlot
from ft.server.settings import ServerSettings

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("ft.server")
MAX_LOGGED_MODEL_NAMES = 16  # names not the model's that are logged (once each): a bounded set


@dataclass
class ServerContext:
    """The engine and settings behind an app, its metrics, and the error shape of each path
    prefix.

    With one model (`router` None) `bound` is its engine, and every route uses it. In router
    mode (`ft.server.models`) the app's context is bound to none: a route resolves the
    request's `model` (`for_model`, `lease_model`) and works on a copy bound to that model's
    engine (`bind`), which shares everything else.
    """

    settings: ServerSettings
    bound: Engine | None = None
    router: ModelRouter | None = None
    error_formats: list[tuple[str, ErrorFormatter]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    metrics: ServerMetrics = field(init=False)
    tenants: Tenants = field(init=False)  # the API keys, and who each one is
    other_model_names: set[str] = field(default_factory=set)  # logged once each, up to a bound

    def __post_init__(self) -> None:
        self.tenants = Tenants(self.settings.all_api_keys)
        if self.router is not None:
            router = self.router
            self.metrics = ServerMetrics(router.engines, router.default.name)
            router.on_engine = self.metrics.watch
        else:
            engine = self.engine
            self.metrics = ServerMetrics(lambda: iter((engine,)), engine.model_id)
            self.metrics.watch(engine)

    @property
    def engine(self) -> Engine:
        """The engine this context's routes use (router mode: the request's model's, once bound)."""
        if self.bound is None:
            raise RuntimeError("this context is bound to no engine: resolve the request's model first")
        return self.bound

    def bind(self, engine: Engine) -> ServerContext:
        """This context for `engine`'s requests (a shallow copy: settings, metrics and error
        formats shared)."""
        view = copy.copy(self)
        view.bound = engine
        return view

    def lease_model(self, model: str | None) -> ModelSlot:
        """Router mode: the slot a request's `model` names, held busy until the HTTP request ends
        (the request's record is labelled with it). Raises 404 `model_not_found`."""
        assert self.router is not None
        slot = self.router.find(model)
        lease = self.router.lease(slot)
        record = current_record()
        record.model = slot.name
        if not record.release_at_end(lease.release):
            lease.release()  # no HTTP request to hold it (embedded use): only the 404 check counts
        return slot

    async def for_model(self, model: str | None) -> ServerContext:
        """The context a request for `model` runs in: with one model, this one (`check_model`);
        in router mode, bound to that model's engine, loaded first when it is not (waiting at
        most the load timeout).

        Raises:
            HttpError: 404 for a model not served; 503 `models_busy` when no room frees up.
            EngineStopping: the model failed to load (its error), or the load timed out (503).
        """
        if self.router is None:
            self.check_model(model)
            return self
        slot = self.lease_model(model)
        return self.bind(await self.router.acquire(slot))

    def error_format(self, path: str) -> ErrorFormatter:
        """The error body formatter for `path` (the longest registered prefix; else OpenAI's)."""
        best: tuple[int, ErrorFormatter] = (-1, openai_error_body)
        for prefix, fmt in self.error_formats:
            if path.startswith(prefix) and len(prefix) > best[0]:
                best = (len(prefix), fmt)
        return best[1]

    def check_model(self, model: str | None) -> None:
        """Check a request's `model` against the served model's names (`ft.model_names`).

        None, "" and every name of the model pass. Any other name is served by the one model
        too (logged once), unless `settings.strict_model_names`: then it is a 404.
        """
        if self.router is not None:
            self.router.find(model)  # router mode: a name no model answers to is a 404
            return
        if not model or self.engine.names.accepts(model):
            return
        if self.settings.strict_model_names:
            raise HttpError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.engine.model_id}'",
                param="model",
                code="model_not_found",
            )
        if len(self.other_model_names) < MAX_LOGGED_MODEL_NAMES and model not in self.other_model_names:
            self.other_model_names.add(model)
            log.info(
                "requests for model %r are served by %r (--strict-model-names refuses them)",
                model,
                self.engine.model_id,
            )

    def check_admission(self) -> None:
        """Raise 503 while loading, stopping, failed, or with a full queue (a pure check)."""
        self.engine.check_admission()

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Raise 400 for a token id outside the vocabulary (503 while there is none yet)."""
        if ids and not self.engine.vocab_size:
            raise self.engine.refusal()  # loading or failed: the 503 every request gets then
        check_token_ids(ids, self.engine.vocab_size, param=param)


# Union members pydantic names in an error's location (`input.str`, `system.list[TextBlock]`).
_TYPE_MARKERS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def _is_marker(part: str) -> bool:
    """True for the parts of a pydantic location that name a validator or a union member."""
    return "[" in part or part in _TYPE_MARKERS or part.startswith("function-") or part[:1].isupper()


def loc_to_param(loc: tuple[int | str, ...], body: Any = None) -> str | None:
    """`("messages", 0, "content")` -> `"messages[0].content"` (pydantic's markers dropped).

    With the `body` that failed, the tag of a tagged union (`content[0].text.text` for a
    `{"type": "text"}` block) is recognised as the node's `type` and dropped too.
    """
    out, node, tagged = "", body, None
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
        elif _is_marker(part):
            continue  # "[key]", validator markers, union members
        elif (
            isinstance(node, dict)
            and node is not tagged
            and node.get("type") == part
            and part not in node  # `{"type": "json_schema", "json_schema": ...}` names a field
            and i + 1 < len(loc)
        ):
            tagged = node  # a tagged union's tag: once per node, never the last part
        else:
            out = f"{out}.{part}" if out else part
            node = node.get(part) if isinstance(node, dict) else None
    return out or None


def validation_error(e: ValidationError, body: Any = None) -> InvalidRequest:
    """The first validation problem, as a 400 naming its field.

    For a union field pydantic reports one error per member; the deepest one is the member the
    client meant (a list whose item is wrong, not "should be a valid string").
    """
    errors = e.errors(include_url=False, include_input=False, include_context=False)
    field = errors[0]["loc"][:1]
    first = max((x for x in errors if x["loc"][:1] == field), key=lambda x: len(x["loc"]))
    param = loc_to_param(tuple(first["loc"]), body)
    where = f"'{param}'" if param else "the body"
    return InvalidRequest(f"invalid value for {where}: {first['msg']}", param=param)


def parse_model(model: type[M], body: Any) -> M:
    """Validate `body` against `model`. Raises `InvalidRequest` naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e, body) from None
    except RecursionError:  # pragma: no cover - depth is capped before parsing
        raise InvalidRequest("the request body is nested too deeply") from None


class SizedRequest(NamedTuple, Generic[M]):
    """A validated request body and its size in bytes (to size the work that follows it)."""

    body: M
    num_bytes: int


async def read_sized_request(
    ctx: ServerContext, model: type[M], *, allow_empty: bool = False
) -> SizedRequest[M]:
    """Read, parse and validate the current request's JSON body (an empty one is `{}` when
    `allow_empty`); with its size.

    Raises 415 unless the body is declared as JSON, 413 past the size limit, 400 for the rest.
    A large body is parsed and validated in a thread: that work is linear in its size.
    """
    require_json_content_type(request)
    data = await read_body(request, ctx.settings.max_body_bytes)
    if allow_empty and not data.strip():
        return SizedRequest(parse_model(model, {}), len(data))
    result: M = await run_sized(len(data), _parse_body, model, data)
    return SizedRequest(result, len(data))


async def read_request(ctx: ServerContext, model: type[M], *, allow_empty: bool = False) -> M:
    """Read, parse and validate the current request's JSON body (see `read_sized_request`)."""
    return (await read_sized_request(ctx, model, allow_empty=allow_empty)).body


def _parse_body(model: type[M], data: bytes) -> M:
    return parse_model(model, parse_json(data))


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response (compact, ASCII-escaped)."""
    return Response(dumps(body), status=status, content_type="application/json", headers=headers)


async def json_response_off_loop(build: Callable[[], Any]) -> Response:
    """A JSON response whose body `build()` makes, built and serialized in a thread.

    For bodies whose size the client chooses (echo, logprobs): that work is linear in it.
    """
    text = await trio.to_thread.run_sync(lambda: dumps(build()))
    return Response(text, status=200, content_type="application/json")


def error_response(ctx: ServerContext, err: FtError) -> Response:
    """`err` rendered in the shape of the current path's API (and noted in the request's record)."""
    current_record().error = err
    fmt = ctx.error_format(request.path)
    return json_response(fmt(err), err.status, error_headers(err))
