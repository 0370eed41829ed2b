"""What the prompt cache's disk tier does when something other than its own regular file is where
a page's file, its temporary file or its lock should be: a FIFO, a device, a socket, a symlink,
a directory, a truncated file. Each page is a miss within a bounded time, never a hang; a lock
file that is not a regular file stops the start, naming it."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import tempfile
from collections.abc import Callable, Iterator

import pytest
import trio

from ft.core.kv import page_hash
from ft.core.prompt_cache import (
    HEADER,
    LOCK_NAME,
    TRAILER,
    PromptCache,
    PromptCacheRefused,
    cache_identity,
    lock_directory,
)

IDENTITY = cache_identity("model=a;dtype=float16;page_size=4")
KEY = page_hash(None, [1, 2, 3, 4])
PAYLOAD = bytes(range(256)) * 4
GUARD_S = 20  # "never": a read that blocks on what is in a file's place is a hang


@pytest.fixture
def cache(tmp_path: pathlib.Path) -> Iterator[PromptCache]:
    c = PromptCache(tmp_path / "cache", 1 << 20, IDENTITY)
    yield c
    c.close()


def page_file(cache: PromptCache) -> pathlib.Path:
    """Page `KEY`'s file, written and indexed (as a page is once the server runs)."""
    assert cache.write(KEY, [PAYLOAD])
    (path,) = pathlib.Path(cache.own_dir).glob("*.kv")
    return path


def release(path: pathlib.Path) -> None:
    """Let a reader blocked opening the FIFO at `path` go (opening it to write needs a reader)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


async def read_within_guard(cache: PromptCache) -> object:
    """`cache.read(KEY, ...)` in a thread, failing the test if it takes past `GUARD_S`."""
    with trio.fail_after(GUARD_S):
        return await trio.to_thread.run_sync(cache.read, KEY, len(PAYLOAD), abandon_on_cancel=True)


def bind_socket(path: pathlib.Path) -> socket.socket:
    """A unix socket bound at `path` (bound under a short name, then moved: sun_path is short)."""
    short = pathlib.Path(tempfile.mkdtemp(prefix="ftsock")) / "s"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(short))
    os.replace(short, path)
    short.parent.rmdir()
    return sock


def replace_with(path: pathlib.Path, make: Callable[[pathlib.Path], None]) -> None:
    path.unlink()
    make(path)


async def test_a_fifo_in_place_of_a_page_is_a_miss_not_a_hang(cache: PromptCache) -> None:
    path = page_file(cache)
    replace_with(path, os.mkfifo)
    try:
        assert await read_within_guard(cache) is None
    finally:
        release(path)
    assert cache.statistics().corrupt == 1 and not path.exists()
    assert cache.count_prefix([KEY]) == 0 and cache.read(KEY) is None


async def test_a_symlink_to_a_device_in_place_of_a_page_is_a_miss(cache: PromptCache) -> None:
    for device in ("/dev/zero", "/dev/null"):
        path = page_file(cache)
        path.unlink()
        path.symlink_to(device)
        assert await read_within_guard(cache) is None
        assert not path.is_symlink()  # the link deleted, the device untouched
        assert pathlib.Path(device).exists()


async def test_a_device_node_in_place_of_a_page_is_a_miss(cache: PromptCache) -> None:
    path = page_file(cache)
    path.unlink()
    try:
        os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    assert await read_within_guard(cache) is None
    assert not path.exists()


async def test_a_socket_in_place_of_a_page_is_a_miss(cache: PromptCache) -> None:
    path = page_file(cache)
    path.unlink()
    with bind_socket(path):
        assert await read_within_guard(cache) is None
    assert cache.statistics().corrupt == 1


async def test_a_symlink_out_of_the_directory_is_never_followed(
    cache: PromptCache, tmp_path: pathlib.Path
) -> None:
    """A link to a valid page file elsewhere: refused by `O_NOFOLLOW`, the target left alone."""
    path = page_file(cache)
    outside = tmp_path / "outside.kv"
    path.rename(outside)
    path.symlink_to(outside)
    assert await read_within_guard(cache) is None
    assert outside.read_bytes()[: len(b"FTKVPAGE")] == b"FTKVPAGE" and not path.is_symlink()


async def test_a_directory_in_place_of_a_page_is_a_miss(cache: PromptCache) -> None:
    path = page_file(cache)
    replace_with(path, lambda p: p.mkdir())
    assert await read_within_guard(cache) is None
    assert path.is_dir() and cache.count_prefix([KEY]) == 0


async def test_a_truncated_page_is_a_miss_and_deleted(cache: PromptCache) -> None:
    path = page_file(cache)
    assert path.stat().st_size == HEADER.size + len(PAYLOAD) + TRAILER.size
    os.truncate(path, HEADER.size + 10)
    assert await read_within_guard(cache) is None
    assert not path.exists() and cache.statistics().corrupt == 1


async def test_a_page_of_another_size_is_a_miss_without_reading_it(cache: PromptCache) -> None:
    """A file that checks out but holds a page of another length (asked for this one's)."""
    assert cache.write(KEY, [PAYLOAD + PAYLOAD])
    with trio.fail_after(GUARD_S):
        assert await trio.to_thread.run_sync(cache.read, KEY, len(PAYLOAD)) is None
    assert cache.statistics().corrupt == 1


async def test_a_fifo_under_the_temporary_name_fails_the_write_not_the_writer(cache: PromptCache) -> None:
    """The writer creates its temporary file `O_EXCL`: a FIFO already there is a counted write
    error (opening it to write would wait for a reader forever), and nothing else is touched."""
    name = f"{KEY.to_bytes(16, 'little').hex()}.kv.{os.getpid()}.tmp"
    tmp = pathlib.Path(cache.own_dir) / name
    os.mkfifo(tmp)
    try:
        with trio.fail_after(GUARD_S):
            written = await trio.to_thread.run_sync(cache.write, KEY, [PAYLOAD], abandon_on_cancel=True)
    finally:
        release(tmp)
    assert not written and cache.statistics().write_errors == 1
    assert tmp.exists() and cache.read(KEY) is None


async def test_a_fifo_as_the_lock_file_stops_the_start_naming_it(tmp_path: pathlib.Path) -> None:
    lock = tmp_path / LOCK_NAME
    os.mkfifo(lock)
    try:
        with trio.fail_after(GUARD_S), pytest.raises(PromptCacheRefused, match=f"{lock} is a FIFO"):
            await trio.to_thread.run_sync(lock_directory, tmp_path, abandon_on_cancel=True)
    finally:
        release(lock)


@pytest.mark.parametrize("kind", ["symlink", "directory", "socket"])
def test_a_lock_file_that_is_not_a_regular_file_stops_the_start(tmp_path: pathlib.Path, kind: str) -> None:
    lock = tmp_path / LOCK_NAME
    target = tmp_path / "elsewhere"
    target.write_text("mine")
    with contextlib.ExitStack() as stack:
        if kind == "symlink":
            lock.symlink_to(target)
        elif kind == "directory":
            lock.mkdir()
        else:
            stack.enter_context(bind_socket(lock))
        with pytest.raises(PromptCacheRefused, match=f"lock file {lock} is a {kind}"):
            PromptCache(tmp_path, 1 << 20, IDENTITY)
    assert target.read_text() == "mine"


def test_a_symlink_in_place_of_the_page_directory_stops_the_start(tmp_path: pathlib.Path) -> None:
    first = PromptCache(tmp_path / "cache", 1 << 20, IDENTITY)
    own = pathlib.Path(first.own_dir)
    first.close()
    own.rmdir()
    (tmp_path / "elsewhere").mkdir()
    own.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PromptCacheRefused, match=f"{own} is a symlink"):
        PromptCache(tmp_path / "cache", 1 << 20, IDENTITY)
    PromptCache(tmp_path / "other", 1 << 20, IDENTITY).close()  # nothing held
