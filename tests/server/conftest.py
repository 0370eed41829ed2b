"""Server fixtures: a fake-model server and a client on it (helpers: `tests.support.server`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from ft.server import RunningServer
from tests.support.server import fake_server


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    """A fake-model server with default settings."""
    async with fake_server() as s:
        yield s


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[httpx.AsyncClient]:
    """An async HTTP client on `server`."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as c:
        yield c
