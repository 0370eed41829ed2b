"""What every route needs: the engine, the settings, and the edge helpers routes share.

Route modules (`openai`, `anthropic`, `responses`, `control`) each expose `register(app, ctx)`;
they read the body with `read_request(ctx, Model)`, check the engine with
`ctx.check_admission()`, and raise `FtError`s that the app's handlers render in the API's shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from quart import Response, request

from ft.engine.engine import Engine
from ft.errors import FtError, InvalidRequest
from ft.server.body import read_json
from ft.server.http_errors import (
    ErrorFormatter,
    HttpError,
    dumps,
    error_headers,
    openai_error_body,
)
from ft.server.settings import ServerSettings

M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerContext:
    """The engine and settings behind an app, and the error shape of each path prefix."""

    engine: Engine
    settings: ServerSettings
    error_formats: list[tuple[str, ErrorFormatter]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)

    def error_format(self, path: str) -> ErrorFormatter:
        """The error body formatter for `path` (the longest registered prefix; else OpenAI's)."""
        best: tuple[int, ErrorFormatter] = (-1, openai_error_body)
        for prefix, fmt in self.error_formats:
            if path.startswith(prefix) and len(prefix) > best[0]:
                best = (len(prefix), fmt)
        return best[1]

    def served_names(self) -> set[str]:
        """Model names a request may ask for."""
        names = {self.engine.model_id}
        if self.settings.served_model_name:
            names.add(self.settings.served_model_name)
        return names

    def check_model(self, model: str | None) -> None:
        """Raise 404 unless `model` is served (None or "" means the served model)."""
        if model and model not in self.served_names():
            raise HttpError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.engine.model_id}'",
                param="model",
                code="model_not_found",
            )

    def check_admission(self) -> None:
        """Raise 503 while loading, stopping, failed, or with a full queue."""
        self.engine.check_admission()

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Raise 400 for a token id outside the vocabulary."""
        vocab = self.engine.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise InvalidRequest(f"token id {t} is outside the vocabulary (0..{vocab - 1})", param=param)


def loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    """`("messages", 0, "content")` -> `"messages[0].content"` (pydantic's markers dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(("[", "function-")):
            continue  # "[key]", validator markers
        else:
            out = f"{out}.{part}" if out else part
    return out or None


def validation_error(e: ValidationError) -> InvalidRequest:
    """The first validation problem, as a 400 naming its field."""
    first = e.errors(include_url=False, include_input=False, include_context=False)[0]
    param = loc_to_param(tuple(first["loc"]))
    where = f"'{param}'" if param else "the body"
    return InvalidRequest(f"invalid value for {where}: {first['msg']}", param=param)


def parse_model(model: type[M], body: Any) -> M:
    """Validate `body` against `model`. Raises `InvalidRequest` naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:  # pragma: no cover - depth is capped before parsing
        raise InvalidRequest("the request body is nested too deeply") from None


async def read_request(ctx: ServerContext, model: type[M], *, allow_empty: bool = False) -> M:
    """Read, parse and validate the current request's JSON body."""
    body = await read_json(request, ctx.settings.max_body_bytes, allow_empty=allow_empty)
    return parse_model(model, body)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response (compact, ASCII-escaped)."""
    return Response(dumps(body), status=status, content_type="application/json", headers=headers)


def error_response(ctx: ServerContext, err: FtError) -> Response:
    """`err` rendered in the shape of the current path's API."""
    fmt = ctx.error_format(request.path)
    return json_response(fmt(err), err.status, error_headers(err))
