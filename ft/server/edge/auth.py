"""Who may call what: the API keys, and the admin routes' stricter rules (see docs/security.md).

Every route but the probes, the chat page's static files (`ft.server.web.WEB_PATHS`, unless
`--no-web-ui`; the calls the page makes need the key) and `/metrics` (unless
`--metrics-require-key`) needs one of the `--api-key`s when any is set; the key it carries
makes its tenant (`ft.server.edge.tenants`). Admin routes (`/v1/admin/...`, and
`ADMIN_PATHS`: loading and unloading models) change the server's state, so they also refuse
what a web page or a proxied client could send:

- any request carrying an `Origin` not listed in `--cors-origins` (a `*` there does not count);
- with `--admin-key`: any request without that key (then the peer's address does not matter);
- without it: any peer that is not loopback, and any request that came through a proxy (it
  carries a forwarding header: behind a proxy every client looks like loopback).

JSON routes refuse bodies not declared `application/json` (`body.require_json_content_type`),
so a cross-site "simple request" (`text/plain`, forms) never reaches a route.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from quart import Request, has_request_context, request

from ft.server.edge.http_errors import HttpError
from ft.server.edge.tenants import ONE_TENANT, Caller, Tenants
from ft.server.edge.tracing import current_record
from ft.server.settings import ServerSettings
from ft.server.web import WEB_PATHS

# Paths that never need the API key: probes, and the scraper's unless --metrics-require-key.
PROBE_PATHS = frozenset({"/health", "/health/live", "/health/ready"})
METRICS_PATH = "/metrics"
ADMIN_PREFIX = "/v1/admin/"
# Admin routes outside the prefix: loading and unloading models (router mode).
ADMIN_PATHS = frozenset({"/v1/models/load", "/v1/models/unload", "/models/load", "/models/unload"})
# Headers a reverse proxy adds; their presence means the loopback peer is only the proxy.
FORWARDING_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-Ip")


def authorize(request: Request, settings: ServerSettings, tenants: Tenants) -> Caller:
    """Raise 401/403 unless the current request may reach its route; return its caller (its
    tenant: the API key's, where several keys are served)."""
    if request.method == "OPTIONS" or request.path in PROBE_PATHS:
        return ONE_TENANT
    if request.path == METRICS_PATH and not settings.metrics_require_key:
        return ONE_TENANT
    if settings.web_ui and request.method in ("GET", "HEAD") and request.path in WEB_PATHS:
        return ONE_TENANT  # static files that hold no data; the page's API calls send the key
    if request.path.startswith(ADMIN_PREFIX) or request.path in ADMIN_PATHS:
        authorize_admin(request, settings, tenants)
        return ONE_TENANT
    return api_caller(request, tenants)


def api_caller(request: Request, tenants: Tenants) -> Caller:
    """The caller the request's API key makes; raise 401 when keys are set and it has none of them."""
    caller = tenants.identify(presented_key(request))
    if caller is None:
        raise _unauthorized("invalid or missing API key (send 'Authorization: Bearer <key>')")
    return caller


def authorize_admin(request: Request, settings: ServerSettings, tenants: Tenants) -> None:
    """Raise 401/403 unless the current request may use an admin route (rules above)."""
    origin = request.headers.get("Origin")
    if origin is not None and origin not in settings.cors_origins:
        raise _forbidden(
            f"admin routes refuse cross-site requests: the Origin '{origin[:100]}' is not listed "
            "in --cors-origins"
        )
    if settings.admin_key is not None:
        if not key_matches(presented_key(request), settings.admin_key):
            raise _unauthorized("invalid or missing admin key (send 'Authorization: Bearer <admin key>')")
        return
    if not is_loopback(request.scope.get("client")):
        raise _forbidden("admin routes are only served to loopback callers (or with --admin-key)")
    if any(name in request.headers for name in FORWARDING_HEADERS):
        raise _forbidden("this request came through a proxy; admin routes behind a proxy need --admin-key")
    api_caller(request, tenants)


def presented_key(request: Request) -> bytes | None:
    """The key the request carries (`Authorization: Bearer` wins over `x-api-key`), as sent.

    Header values reach us decoded as latin-1, so encoding them back gives the bytes on the
    wire: a key sent as UTF-8 compares equal to the configured key's UTF-8 bytes.
    """
    given = request.headers.get("x-api-key")
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    return None if given is None else given.encode("latin-1", errors="replace")


def current_client() -> str | None:
    """Whom the current HTTP request counts against where clients share workers (tokenizing,
    grammar compiles: `ft.actors.fair_limiter`): its tenant where several API keys tell callers
    apart, else its peer's address without the port (behind a proxy every client is the
    proxy); None outside a request (embedded use)."""
    if not has_request_context():
        return None
    tenant = current_record().tenant
    if tenant is not None:
        return f"tenant:{tenant}"
    client = request.scope.get("client")
    return str(client[0]) if client else None


def key_matches(given: bytes | None, expected: str) -> bool:
    """Constant-time comparison of a presented key with the configured one (the admin key;
    the API keys are `Tenants.identify`'s)."""
    return given is not None and hmac.compare_digest(given, expected.encode("utf-8"))


def is_loopback(client: Any) -> bool:
    """True when the ASGI `client` tuple is a loopback address (headers are not trusted)."""
    if not client:
        return False
    try:
        return ipaddress.ip_address(str(client[0]).split("%")[0]).is_loopback
    except ValueError:
        return False


def _unauthorized(message: str) -> HttpError:
    return HttpError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _forbidden(message: str) -> HttpError:
    return HttpError(403, message, type="permission_error", code="forbidden")
