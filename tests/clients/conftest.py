"""The clients' fixtures: one `ft serve` (default model) for the session, and a scratch home
with the clients' environment for each test. Every test here is slow (it runs the model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.clients import FtServe, client_env


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ft_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FtServe]:
    """`ft serve` with the default model, ready, logging JSON lines."""
    server = FtServe(tmp_path_factory.mktemp("ft-serve") / "serve.log")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def env(tmp_path: Path, ft_serve: FtServe, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The clients' environment (`client_env`), also set in this process for in-process clients."""
    values = client_env(tmp_path / "home", ft_serve)
    for key, value in values.items():
        if key != "PATH":
            monkeypatch.setenv(key, value)
    return values
