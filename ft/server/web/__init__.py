"""The chat page at `/`: static files served from memory with a strict Content-Security-Policy.

The page (`static/`: `index.html`, `app.js`, `markdown.js`, `app.css`, `icon.svg`) is
hand-written HTML, JS and CSS with no build step; it talks to the same API any client does
(`/v1/models`, `/v1/chat/completions`), from the same origin, so it needs no CORS and opens no
admin route (its `Origin` is not in `--cors-origins`). Its files are public — they hold no data
— so `auth.authorize` serves `WEB_PATHS` without the API key; every API call the page makes
needs the key like any other client's.
"""

from __future__ import annotations

from importlib import resources

from quart import Response
from quart_trio import QuartTrio

from ft.server.edge.http_errors import HttpError
from ft.server.generation.context import ServerContext

# name under /web/ -> content type. Only these are served; nothing is read from disk per request.
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
PAGE_PATH = "/"
WEB_PATHS = frozenset({PAGE_PATH, *(f"/web/{name}" for name in ASSETS)})

# No inline script or style, nothing from another origin, no framing, no <base>, no form posts,
# and Trusted Types with no policy: assigning a string to innerHTML throws, so no code path
# (ours or a library's) can turn model text into markup.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-cache",
}


def read_static(name: str) -> bytes:
    """One of the page's files, as shipped in the package (`ft/server/web/static/`)."""
    return (resources.files(__package__) / "static" / name).read_bytes()


def register(app: QuartTrio, ctx: ServerContext) -> None:
    """Serve the page at `/` and its files under `/web/`, unless `--no-web-ui`."""
    if not ctx.settings.web_ui:
        return
    page = read_static("index.html")
    assets = {name: read_static(name) for name in ASSETS}

    @app.get(PAGE_PATH)
    async def chat_page() -> Response:
        # Clients probe the base URL before their first request (Claude Code sends `HEAD /`):
        # quart answers HEAD with these headers and no body.
        return static_response(page, "text/html; charset=utf-8")

    @app.get("/web/<name>")
    async def web_asset(name: str) -> Response:
        if name not in assets:
            raise HttpError(404, f"no route GET /web/{name[:100]}", code="not_found")
        return static_response(assets[name], ASSETS[name])


def static_response(body: bytes, content_type: str) -> Response:
    """`body` with its content type and the page's security headers."""
    return Response(body, content_type=content_type, headers=SECURITY_HEADERS)
