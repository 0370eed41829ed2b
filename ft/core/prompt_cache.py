"""The prompt cache's disk tier: full KV pages in files that outlive evictions and restarts.

Synchronous and trio-free. One server owns a directory (an exclusive `flock` on its lock file;
a second server refuses to start on it). Its layout:

    DIR/ft-prompt-cache.lock                  the owner's lock (its pid inside)
    DIR/v<VERSION>-<identity>/<key>.kv        one full page: all layers' K and V of its slots

`identity` is a hash of everything a page's bytes depend on besides its tokens (the model file,
dtype, KV dtype, page size, the layer and head shapes, the kernels' build, this format's
version); `key` is the page's chain hash (`ft.core.kv.page_hash`, stable across processes). A
file of another identity or version is never read as ours; it only ages out of the size bound.

A file is `header | payload | crc32(header + payload)`; the header holds a magic, the format
version, the identity, the key and the payload's length. Files are written to a temporary name,
fsynced and renamed, so a reader never sees a torn file under a page's name; any file that does
not check out (truncated, corrupted, foreign, another version, not a regular file) is deleted
when read and reported as a miss: never served, never an exception. A cache file is opened
without following a symlink and without blocking (`READ_FLAGS`: a FIFO, a device or a socket in
a page's place opens at once or not at all), and read only when `fstat` says it is a regular
file of the size a page's file has; a temporary file is created `O_EXCL`, so nothing already
under its name (a FIFO that would block the writer) is written to. The lock file and the
version directory must be a regular file and a directory: anything else in their place (a
symlink, a FIFO) stops the start with `PromptCacheRefused`, naming it.

The directory's cache files never exceed `max_bytes`: room is made before a file is written by
deleting the least recently used files (by the order of writes and reads, from their mtimes at
start; a read touches the file's mtime). Writes go through a writer thread behind a queue
bounded in bytes; a page that finds the queue full is dropped, never waited for.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ft.core.kv import HASH_BYTES

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ft.core.batch import PageLoad, PageSave

log = logging.getLogger("ft.prompt_cache")

FORMAT_VERSION = 1
MAGIC = b"FTKVPAGE"
HEADER = struct.Struct(f"<8sI{HASH_BYTES}s{HASH_BYTES}sQ")  # magic, version, identity, key, length
TRAILER = struct.Struct("<I")  # crc32 of header and payload
LOCK_NAME = "ft-prompt-cache.lock"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_DIR = re.compile(r"v(\d+)-([0-9a-f]{32})")
_FILE = re.compile(r"([0-9a-f]{32})\.kv")
# Bytes of page copies the writer's queue holds at most; past it new pages are dropped.
MAX_PENDING_BYTES = 64 << 20
CLOSE_TIMEOUT_S = 10.0  # how long `close` lets the writer finish what is queued
# How a cache file is opened for reading: never through a symlink, never waiting (opening a FIFO
# blocked until a writer came: a request waited 60 s), never as a controlling terminal.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# A temporary file is always a new regular file: nothing already under its name is opened.
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class PromptCacheBusy(RuntimeError):
    """Another process owns the prompt cache directory."""


class PromptCacheRefused(OSError):
    """Something other than a regular file (or a directory) is where the cache keeps its lock
    (or its pages' directory): the directory is not used."""


def file_kind(mode: int) -> str:
    """What a `stat` mode is, in words ("a FIFO", "a symlink")."""
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
    )
    return next((name for is_kind, name in kinds if is_kind(mode)), "not a regular file")


def cache_identity(description: str) -> bytes:
    """The identity (16 bytes) of KV pages computed under `description` (the model's file, dtype,
    KV dtype, page size and shapes: `ModelParts.kv_identity` plus the page size)."""
    text = f"ft prompt cache v{FORMAT_VERSION}\n{description}"
    return hashlib.blake2b(text.encode(), digest_size=HASH_BYTES).digest()


def model_file_identity(path: str | os.PathLike[str]) -> str:
    """The identity of a model on disk: its real path, size and mtime (each file's, for a
    directory), so replacing the file changes it without reading gigabytes."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        st = os.stat(real)
        return f"{real}:{st.st_size}:{st.st_mtime_ns}"
    parts = [real]
    for name in sorted(os.listdir(real)):
        full = os.path.join(real, name)
        if os.path.isfile(full):
            st = os.stat(full)
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def encode_page(identity: bytes, key: int, parts: Sequence[Buffer]) -> list[Buffer]:
    """The pieces of a page's file, in order: header, `parts` (the payload), trailer."""
    length = sum(memoryview(p).nbytes for p in parts)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, identity, key.to_bytes(HASH_BYTES, "little"), length)
    crc = zlib.crc32(header)
    for p in parts:
        crc = zlib.crc32(p, crc)
    return [header, *parts, TRAILER.pack(crc)]


def decode_page(data: Buffer, identity: bytes, key: int) -> memoryview | None:
    """The payload of a page's file `data`, or None when anything does not check out (length,
    magic, version, identity, key, checksum)."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER.size + TRAILER.size:
        return None
    magic, version, ident, file_key, length = HEADER.unpack_from(view)
    if (
        magic != MAGIC
        or version != FORMAT_VERSION
        or ident != identity
        or file_key != key.to_bytes(HASH_BYTES, "little")
        or length != view.nbytes - HEADER.size - TRAILER.size
    ):
        return None
    (crc,) = TRAILER.unpack_from(view, view.nbytes - TRAILER.size)
    if zlib.crc32(view[: view.nbytes - TRAILER.size]) != crc:
        return None
    return view[HEADER.size : HEADER.size + length]


@runtime_checkable
class PageIO(Protocol):
    """A runner whose KV pages can be copied out and in (`TorchRunner`)."""

    @property
    def page_payload_bytes(self) -> int:
        """Bytes of one page's payload (K then V, every layer)."""
        ...

    def page_payload(self, page: int) -> list[Buffer]:
        """A copy of page `page`'s KV (safe to keep after the page is reused)."""
        ...

    def load_page(self, page: int, payload: memoryview) -> None:
        """Write `payload` (from `page_payload`) into page `page`."""
        ...


@dataclass(frozen=True, slots=True)
class PromptCacheStats:
    """The disk tier since the start: `hits`/`misses` count page reads (a miss: no valid file),
    `dropped` pages not written because the writer's queue was full, `corrupt` files that did
    not check out (deleted), `evicted` files deleted to stay within `max_bytes`; `files` and
    `bytes` what the directory's cache files hold now."""

    directory: str
    max_bytes: int
    files: int
    bytes: int
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    writes: int
    dropped: int
    write_errors: int
    corrupt: int
    evicted: int


class PromptCache:
    """The disk tier of one server: owns `directory` while open (see the module docstring).

    Thread-safe: the scheduler looks keys up on the event loop, the runner's thread reads pages
    and queues copies, the writer thread writes them.

    Raises (constructor):
        PromptCacheBusy: another process holds the directory's lock.
        OSError: the directory cannot be created or read.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        identity: bytes,
        *,
        lock_fd: int | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = os.path.abspath(directory)
        self.max_bytes = max_bytes
        self.identity = identity
        # `lock_fd`: the directory's lock, taken already (`lock_directory`); the cache owns it.
        self._lock_fd = lock_directory(self.directory) if lock_fd is None else lock_fd
        self._mutex = threading.Lock()
        self._wake = threading.Condition(self._mutex)
        self._files: OrderedDict[str, int] = OrderedDict()  # path -> bytes, least recently used first
        self._bytes = 0
        self._keys: set[int] = set()  # pages of our identity on disk
        self._pending: deque[tuple[int, list[Buffer], int]] = deque()  # (key, parts, bytes)
        self._pending_keys: set[int] = set()
        self._pending_bytes = 0
        self._closing = False
        self._deadline: float | None = None
        self.hits = self.misses = self.bytes_read = self.bytes_written = self.writes = 0
        self.dropped = self.write_errors = self.corrupt = self.evicted = 0
        try:
            self.own_dir = os.path.join(self.directory, f"v{FORMAT_VERSION}-{identity.hex()}")
            os.makedirs(self.own_dir, exist_ok=True)
            mode = os.lstat(self.own_dir).st_mode
            if not stat.S_ISDIR(mode):
                raise PromptCacheRefused(
                    f"the prompt cache's page directory {self.own_dir} is {file_kind(mode)}, not a "
                    "directory; remove it or give another --prompt-cache-dir"
                )
            self._scan()
            with self._mutex:
                doomed = self._make_room(0)
            _unlink_all(doomed)
        except BaseException:
            if lock_fd is None:  # a lock handed in stays its caller's until this succeeds
                os.close(self._lock_fd)
            raise
        self._writer = threading.Thread(target=self._write_loop, name="ft-prompt-cache-writer", daemon=True)
        self._writer.start()

    # --- lookups (any thread) ------------------------------------------------------------------

    def contains(self, key: int) -> bool:
        """True when page `key` is on disk or queued to be written."""
        with self._mutex:
            return key in self._keys or key in self._pending_keys

    def count_prefix(self, keys: Iterable[int]) -> int:
        """How many leading `keys` have a file (not checked until read)."""
        n = 0
        with self._mutex:
            for key in keys:
                if key not in self._keys:
                    break
                n += 1
        return n

    def read(self, key: int, expected_bytes: int | None = None) -> memoryview | None:
        """Page `key`'s payload (writable), or None: no file, or one that does not check out
        (deleted), or whose payload is not `expected_bytes` long. A hit becomes the most
        recently used file. Never blocks on what is in the file's place (see `READ_FLAGS`)."""
        path = self._path(key)
        with self._mutex:
            known = key in self._keys
        payload = self._read_file(path, key, expected_bytes) if known else None
        with self._mutex:
            if payload is None:
                self.misses += 1
                return None
            self.hits += 1
            self.bytes_read += HEADER.size + payload.nbytes + TRAILER.size
            if path in self._files:
                self._files.move_to_end(path)
        return payload

    def _read_file(self, path: str, key: int, expected_bytes: int | None) -> memoryview | None:
        try:
            fd = os.open(path, READ_FLAGS)
        except OSError:  # gone (evicted meanwhile), a symlink, a socket, no permission
            self._discard(path, corrupt=os.path.lexists(path))
            return None
        payload = None
        try:
            st = os.fstat(fd)
            size = st.st_size
            expected_size = None if expected_bytes is None else HEADER.size + expected_bytes + TRAILER.size
            is_sized = size == expected_size if expected_size is not None else size <= self.max_bytes
            if stat.S_ISREG(st.st_mode) and is_sized:
                buf = bytearray(size)
                with open(fd, "rb", closefd=False) as f:
                    got = f.readinto(buf)
                payload = decode_page(buf, self.identity, key) if got == size else None
            if payload is not None:
                with contextlib.suppress(OSError):
                    os.utime(fd)  # the LRU order the next start reads
        except OSError:  # an I/O error
            payload = None
        finally:
            os.close(fd)
        if payload is None:
            self._discard(path, corrupt=True)
        return payload

    # --- writing ---------------------------------------------------------------------------------

    def has_room(self, nbytes: int) -> bool:
        """True when the writer's queue can take a page of `nbytes` now."""
        with self._mutex:
            return not self._closing and self._pending_bytes + nbytes <= MAX_PENDING_BYTES

    def submit(self, key: int, parts: list[Buffer]) -> bool:
        """Queue page `key` (`parts`: a copy of its payload) for the writer; never blocks.

        Returns False when it was dropped (queue full, closing) and True when it is queued or
        already on disk.
        """
        nbytes = sum(memoryview(p).nbytes for p in parts)
        with self._mutex:
            if key in self._keys or key in self._pending_keys:
                return True
            if self._closing or self._pending_bytes + nbytes > MAX_PENDING_BYTES:
                self.dropped += 1
                return False
            self._pending.append((key, parts, nbytes))
            self._pending_keys.add(key)
            self._pending_bytes += nbytes
            self._wake.notify()
        return True

    def write(self, key: int, parts: Sequence[Buffer]) -> bool:
        """Write page `key` now (the writer thread's work; tests call it directly). Returns
        whether a file was written; a failure is counted and logged, never raised."""
        pieces = encode_page(self.identity, key, parts)
        total = sum(memoryview(p).nbytes for p in pieces)
        path = self._path(key)
        with self._mutex:
            if key in self._keys:
                return False
            if total > self.max_bytes:
                self.dropped += 1
                return False
            doomed = self._make_room(total)
            self._bytes += total  # reserved: the bound holds while the file is written
        _unlink_all(doomed)  # before the new file exists: the directory stays within the bound
        tmp = f"{path}.{os.getpid()}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, WRITE_FLAGS, 0o644)
            try:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    while view.nbytes:
                        view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            if not isinstance(e, FileExistsError):  # another's file under the name: not ours to delete
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            with self._mutex:
                self._bytes -= total
                self.write_errors += 1
                first = self.write_errors == 1
            if first:
                log.warning("prompt cache: writing %s failed: %s (later failures are only counted)", path, e)
            return False
        with self._mutex:
            self._files[path] = total
            self._keys.add(key)
            self.writes += 1
            self.bytes_written += total
        return True

    def save_pages(self, io: PageIO, saves: Sequence[PageSave]) -> int:
        """Copy each saved page out of `io` and queue it (the runner's thread, before its step
        writes any page); a page that finds the queue full is dropped before it is copied.
        Returns how many were queued."""
        queued = 0
        nbytes = io.page_payload_bytes
        for save in saves:
            if self.contains(save.key):
                continue
            if not self.has_room(nbytes):
                with self._mutex:
                    self.dropped += 1
                continue
            queued += self.submit(save.key, io.page_payload(save.page_id))
        return queued

    def load_pages(self, io: PageIO, loads: Sequence[PageLoad]) -> tuple[tuple[int, int], ...]:
        """Read each load's pages into `io` in order, stopping at the first that is missing or
        does not check out. Returns (seq id, pages loaded) per load."""
        out: list[tuple[int, int]] = []
        nbytes = io.page_payload_bytes
        for load in loads:
            n = 0
            for page, key in zip(load.page_ids, load.keys, strict=True):
                payload = self.read(key, nbytes)
                if payload is None:
                    break
                io.load_page(page, payload)
                n += 1
            out.append((load.seq_id, n))
        return tuple(out)

    def _write_loop(self) -> None:
        while True:
            with self._mutex:
                while not self._pending and not self._closing:
                    self._wake.wait()
                late = self._deadline is not None and time.monotonic() > self._deadline
                if not self._pending or late:
                    self._pending.clear()
                    self._pending_keys.clear()
                    self._pending_bytes = 0
                    return
                key, parts, nbytes = self._pending[0]
            try:
                self.write(key, parts)
            except Exception:  # never lose the writer: a bug here must not stop the cache
                log.exception("prompt cache: writing a page failed")
            with self._mutex:
                self._pending.popleft()
                self._pending_keys.discard(key)
                self._pending_bytes -= nbytes

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let the writer finish what is queued (at most `timeout_s`), then release the
        directory. Synchronous and idempotent."""
        with self._mutex:
            if self._closing and self._lock_fd < 0:
                return
            self._closing = True
            self._deadline = time.monotonic() + timeout_s
            self._wake.notify()
        self._writer.join(timeout_s + 1.0)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # --- the directory ---------------------------------------------------------------------------

    def statistics(self) -> PromptCacheStats:
        """The disk tier now (a frozen record)."""
        with self._mutex:
            return PromptCacheStats(
                directory=self.directory,
                max_bytes=self.max_bytes,
                files=len(self._files),
                bytes=self._bytes,
                hits=self.hits,
                misses=self.misses,
                bytes_read=self.bytes_read,
                bytes_written=self.bytes_written,
                writes=self.writes,
                dropped=self.dropped,
                write_errors=self.write_errors,
                corrupt=self.corrupt,
                evicted=self.evicted,
            )

    def _path(self, key: int) -> str:
        return os.path.join(self.own_dir, f"{key.to_bytes(HASH_BYTES, 'little').hex()}{SUFFIX}")

    def _scan(self) -> None:
        """Index every cache file of every identity (oldest first); delete the temporary files
        a killed writer left (we own the directory: nobody else is writing)."""
        found: list[tuple[int, str, int]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not _DIR.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
                    continue
                is_own = os.path.join(self.directory, entry.name) == self.own_dir
                with os.scandir(entry.path) as files:
                    for f in files:
                        if f.name.endswith(TMP_SUFFIX) and f.is_file(follow_symlinks=False):
                            with contextlib.suppress(OSError):
                                os.unlink(f.path)
                            continue
                        match = _FILE.fullmatch(f.name)
                        if match is None or not f.is_file(follow_symlinks=False):
                            continue
                        st = f.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, f.path, st.st_size))
                        if is_own:
                            self._keys.add(int.from_bytes(bytes.fromhex(match.group(1)), "little"))
        for _, path, size in sorted(found):
            self._files[path] = size
            self._bytes += size

    def _make_room(self, nbytes: int) -> list[str]:
        """Drop least recently used files from the index until `nbytes` more fit (holding the
        mutex); return their paths, which the caller deletes once it has released the mutex
        (lookups on the event loop never wait for the disk)."""
        doomed: list[str] = []
        while self._files and self._bytes + nbytes > self.max_bytes:
            path, size = self._files.popitem(last=False)
            self._bytes -= size
            self._forget_key(path)
            self.evicted += 1
            doomed.append(path)
        return doomed

    def _discard(self, path: str, *, corrupt: bool) -> None:
        """Drop a file that did not check out (or vanished) from the index and the disk."""
        with self._mutex:
            size = self._files.pop(path, None)
            if size is not None:
                self._bytes -= size
            self._forget_key(path)
            if corrupt:
                self.corrupt += 1
        if corrupt:
            with contextlib.suppress(OSError):
                os.unlink(path)  # a directory in its place is left alone (never served)

    def _forget_key(self, path: str) -> None:
        if os.path.dirname(path) == self.own_dir:
            match = _FILE.fullmatch(os.path.basename(path))
            if match is not None:
                self._keys.discard(int.from_bytes(bytes.fromhex(match.group(1)), "little"))


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def lock_directory(directory: str | os.PathLike[str]) -> int:
    """Create `directory` if needed and take its exclusive lock (the fd holds it until closed),
    so a second server fails at once, before it loads a model.

    Raises:
        PromptCacheBusy: another process holds it (the message names the directory and pid).
        PromptCacheRefused: the lock file is not a regular file (a symlink, a FIFO, a directory).
    """
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, LOCK_FLAGS, 0o644)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
            raise
        raise _refused_lock(path, os.lstat(path).st_mode) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refused_lock(path, mode)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise PromptCacheBusy(
            f"the prompt cache directory {directory} is in use by another ft server (pid {holder}); "
            "give each server its own --prompt-cache-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _refused_lock(path: str, mode: int) -> PromptCacheRefused:
    return PromptCacheRefused(
        f"the prompt cache's lock file {path} is {file_kind(mode)}, not a regular file; "
        "remove it or give another --prompt-cache-dir"
    )
