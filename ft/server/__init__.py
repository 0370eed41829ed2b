"""The HTTP server: a quart-trio app on hypercorn's trio worker, serving one engine."""

from __future__ import annotations

from ft.server.app import RunningServer, create_app, open_server, serve
from ft.server.generation.context import ServerContext
from ft.server.settings import ServerSettings

__all__ = ["RunningServer", "ServerContext", "ServerSettings", "create_app", "open_server", "serve"]
