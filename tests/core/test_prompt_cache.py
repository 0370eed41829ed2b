"""The prompt cache's disk tier: the page file format, the directory it owns, its size bound,
and how the scheduler saves and loads pages through it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.core import prompt_cache as pc
from ft.core.batch import PageLoad, PageSave, Sampled, StepDone
from ft.core.kv import PagePool, page_hash
from ft.core.prompt_cache import (
    HEADER,
    TRAILER,
    PromptCache,
    PromptCacheBusy,
    cache_identity,
    decode_page,
    encode_page,
)
from ft.core.scheduler import Scheduler
from ft.params import SamplingParams

IDENTITY = cache_identity("model=a;dtype=float16;page_size=4")
OTHER = cache_identity("model=b;dtype=float16;page_size=4")
KEY = page_hash(None, [1, 2, 3, 4])
PAYLOAD = bytes(range(256)) * 4


@pytest.fixture
def cache(tmp_path: pathlib.Path) -> Iterator[PromptCache]:
    c = PromptCache(tmp_path, 1 << 20, IDENTITY)
    yield c
    c.close()


def file_bytes(parts: list[object]) -> bytes:
    return b"".join(bytes(memoryview(p)) for p in parts)  # type: ignore[arg-type]


def cache_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.glob("v*-*/*.kv") if p.is_file())


# --- keys -----------------------------------------------------------------------------------


def test_page_hashes_are_the_same_in_every_process() -> None:
    """The chain hash does not depend on the process (Python's hash() is salted): a page's
    file name after a restart is the name it was written under."""
    code = "from ft.core.kv import page_hash; print(page_hash(page_hash(None, [1, 2]), [3, 4]))"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    seen = {
        subprocess.run(
            [sys.executable, "-c", code], env={**env, "PYTHONHASHSEED": seed}, capture_output=True, text=True
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert seen == {str(page_hash(page_hash(None, [1, 2]), [3, 4]))}


def test_page_hashes_bind_the_whole_chain() -> None:
    """Same tokens after another parent, or the first page against a parent of hash 0: other keys."""
    assert page_hash(None, [1, 2]) != page_hash(0, [1, 2])
    assert page_hash(page_hash(None, [9]), [1, 2]) != page_hash(page_hash(None, [8]), [1, 2])
    assert page_hash(None, [1, 2]) != page_hash(None, [2, 1])
    assert page_hash(None, [1, 2]) < 1 << 128


def test_the_identity_depends_on_every_part_of_its_description() -> None:
    assert cache_identity("a;page_size=16") != cache_identity("a;page_size=32")
    assert len(cache_identity("x")) == 16


# --- the file format ----------------------------------------------------------------------------


def test_a_page_round_trips_through_its_file(cache: PromptCache) -> None:
    assert cache.write(KEY, [PAYLOAD[:100], PAYLOAD[100:]])
    payload = cache.read(KEY, len(PAYLOAD))
    assert payload is not None and bytes(payload) == PAYLOAD
    stats = cache.statistics()
    assert stats.files == 1 and stats.hits == 1 and stats.writes == 1
    assert stats.bytes == stats.bytes_written == stats.bytes_read == HEADER.size + len(PAYLOAD) + TRAILER.size
    assert payload.readonly is False  # torch.frombuffer takes it without a copy


def encoded() -> bytes:
    return file_bytes(encode_page(IDENTITY, KEY, [PAYLOAD]))  # type: ignore[arg-type]


# Offsets inside each region of a file: magic, version, identity, key, length, payload, crc.
REGIONS = {"magic": 0, "version": 8, "identity": 12, "key": 28, "length": 44, "payload": 60, "crc": -2}


@pytest.mark.parametrize("region", REGIONS)
def test_a_flipped_byte_anywhere_is_refused(region: str) -> None:
    data = bytearray(encoded())
    data[REGIONS[region]] ^= 0x01
    assert decode_page(data, IDENTITY, KEY) is None


@pytest.mark.parametrize(
    "cut", [0, 1, 7, 8, 12, 30, HEADER.size - 1, HEADER.size, HEADER.size + 500, -TRAILER.size, -1]
)
def test_a_truncated_file_is_refused_at_every_region(cut: int) -> None:
    data = encoded()
    assert decode_page(data[:cut], IDENTITY, KEY) is None


def test_a_file_extended_past_its_length_is_refused() -> None:
    assert decode_page(encoded() + b"\0", IDENTITY, KEY) is None


def test_a_page_of_another_identity_or_key_is_refused() -> None:
    data = encoded()
    assert decode_page(data, OTHER, KEY) is None
    assert decode_page(data, IDENTITY, KEY + 1) is None
    assert decode_page(data, IDENTITY, KEY) is not None


def test_another_version_is_refused_even_with_a_valid_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "FORMAT_VERSION", pc.FORMAT_VERSION + 1)
    newer = file_bytes(encode_page(IDENTITY, KEY, [PAYLOAD]))  # type: ignore[arg-type]
    monkeypatch.undo()
    assert decode_page(newer, IDENTITY, KEY) is None


# --- files on disk that do not check out ----------------------------------------------------------


def corruptions() -> dict[str, bytes]:
    good = encoded()
    flipped = bytearray(good)
    flipped[HEADER.size + 10] ^= 0xFF
    return {
        "truncated header": good[:20],
        "truncated payload": good[: HEADER.size + 100],
        "no checksum": good[: -TRAILER.size],
        "flipped payload byte": bytes(flipped),
        "foreign identity": file_bytes(encode_page(OTHER, KEY, [PAYLOAD])),  # type: ignore[arg-type]
        "garbage": os.urandom(len(good)),
        "empty": b"",
    }


@pytest.mark.parametrize("kind", corruptions())
def test_a_bad_file_found_at_start_is_deleted_when_read_and_never_served(
    tmp_path: pathlib.Path, kind: str
) -> None:
    """A bad file under a page's name (a torn write, a disk error, a copy from elsewhere) is a
    miss: deleted, counted, never an exception; the page can then be written again."""
    first = PromptCache(tmp_path, 1 << 20, IDENTITY)
    assert first.write(KEY, [PAYLOAD])
    first.close()
    (path,) = cache_files(tmp_path)
    path.write_bytes(corruptions()[kind])
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        assert cache.count_prefix([KEY]) == 1  # listed: files are checked when read
        assert cache.read(KEY, len(PAYLOAD)) is None
        assert not path.exists() and cache.count_prefix([KEY]) == 0
        stats = cache.statistics()
        assert stats.corrupt == 1 and stats.misses == 1 and stats.files == 0 and stats.bytes == 0
        assert cache.write(KEY, [PAYLOAD]) and cache.read(KEY) is not None
    finally:
        cache.close()


def test_a_file_corrupted_while_the_server_runs_is_refused(cache: PromptCache) -> None:
    assert cache.write(KEY, [PAYLOAD])
    (path,) = cache_files(pathlib.Path(cache.directory))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    assert cache.read(KEY) is None and not path.exists()


def test_a_payload_of_the_wrong_size_is_refused(cache: PromptCache) -> None:
    assert cache.write(KEY, [PAYLOAD])
    assert cache.read(KEY, len(PAYLOAD) + 2) is None
    assert cache.statistics().corrupt == 1


def test_a_directory_where_a_file_should_be_is_ignored(tmp_path: pathlib.Path) -> None:
    first = PromptCache(tmp_path, 1 << 20, IDENTITY)
    assert first.write(KEY, [PAYLOAD])
    first.close()
    (path,) = cache_files(tmp_path)
    path.unlink()
    path.mkdir()
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        assert cache.count_prefix([KEY]) == 0 and cache.read(KEY) is None
        assert not cache.write(KEY, [PAYLOAD])  # cannot rename over it: counted, not raised
        assert cache.statistics().write_errors == 1 and path.is_dir()
        assert not list(path.parent.glob("*.tmp"))
    finally:
        cache.close()


def test_a_directory_appearing_after_the_write_is_a_miss(cache: PromptCache) -> None:
    assert cache.write(KEY, [PAYLOAD])
    (path,) = cache_files(pathlib.Path(cache.directory))
    path.unlink()
    path.mkdir()
    assert cache.read(KEY) is None and cache.count_prefix([KEY]) == 0


def test_a_symlink_is_never_followed(tmp_path: pathlib.Path) -> None:
    first = PromptCache(tmp_path / "c", 1 << 20, IDENTITY)
    assert first.write(KEY, [PAYLOAD])
    first.close()
    (path,) = cache_files(tmp_path / "c")
    real = tmp_path / "elsewhere.kv"
    path.rename(real)
    path.symlink_to(real)
    cache = PromptCache(tmp_path / "c", 1 << 20, IDENTITY)
    try:
        assert cache.read(KEY) is None and real.exists()
    finally:
        cache.close()


def test_temporary_files_of_a_killed_writer_are_deleted_at_start(tmp_path: pathlib.Path) -> None:
    first = PromptCache(tmp_path, 1 << 20, IDENTITY)
    first.close()
    torn = pathlib.Path(first.own_dir) / f"{'ab' * 16}.kv.1234.tmp"
    torn.write_bytes(encoded()[:100])
    PromptCache(tmp_path, 1 << 20, IDENTITY).close()
    assert not torn.exists()


def test_files_of_another_identity_are_never_read_but_age_out(tmp_path: pathlib.Path) -> None:
    """Another model's pages share the bound: evicted oldest first, never read as ours."""
    size = HEADER.size + len(PAYLOAD) + TRAILER.size
    other = PromptCache(tmp_path, 1 << 20, OTHER)
    assert other.write(KEY, [PAYLOAD])
    other.close()
    ours = PromptCache(tmp_path, 2 * size, IDENTITY)
    try:
        assert ours.count_prefix([KEY]) == 0 and ours.read(KEY) is None
        assert ours.statistics().files == 1  # counted against the bound
        assert ours.write(KEY + 1, [PAYLOAD]) and ours.write(KEY + 2, [PAYLOAD])
        assert ours.statistics().evicted == 1
        assert not (pathlib.Path(other.own_dir) / f"{KEY.to_bytes(16, 'little').hex()}.kv").exists()
    finally:
        ours.close()


def test_files_it_does_not_recognize_are_left_alone(tmp_path: pathlib.Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "v1-x").mkdir()
    (tmp_path / "v1-x" / "a.kv").write_bytes(b"x" * 10_000)
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        assert cache.statistics().files == 0
    finally:
        cache.close()
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "v1-x" / "a.kv").exists()


# --- the bound -----------------------------------------------------------------------------------------


def disk_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in cache_files(root))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["write", "read"]), st.integers(0, 30), st.integers(0, 5000)),
        min_size=1,
        max_size=60,
    ),
    bound=st.integers(1 << 12, 1 << 15),
)
def test_the_directory_never_exceeds_its_bound(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int, int]], bound: int
) -> None:
    """Any sequence of writes (of any size, some larger than the bound) and reads: the files on
    disk never hold more than the bound, and the index says what the disk holds."""
    root = tmp_path_factory.mktemp("bound")
    cache = PromptCache(root, bound, IDENTITY)
    try:
        for op, key, size in ops:
            if op == "write":
                cache.write(key, [bytes([key % 256]) * size])
            else:
                payload = cache.read(key)
                assert payload is None or bytes(payload) == bytes([key % 256]) * len(payload)
            stats = cache.statistics()
            assert disk_bytes(root) == stats.bytes <= bound
            assert len(cache_files(root)) == stats.files
    finally:
        cache.close()
    reopened = PromptCache(root, bound, IDENTITY)
    try:
        assert reopened.statistics().bytes == disk_bytes(root) <= bound
    finally:
        reopened.close()


def test_a_smaller_bound_at_start_evicts_the_oldest_files(tmp_path: pathlib.Path) -> None:
    size = HEADER.size + len(PAYLOAD) + TRAILER.size
    first = PromptCache(tmp_path, 1 << 20, IDENTITY)
    for key in range(5):
        assert first.write(key, [PAYLOAD])
        os.utime(first._path(key), ns=(key * 10**9, key * 10**9))
    first.close()
    cache = PromptCache(tmp_path, 2 * size, IDENTITY)
    try:
        assert cache.count_prefix([3]) == 1 and cache.count_prefix([4]) == 1
        assert cache.count_prefix([0]) == cache.count_prefix([1]) == cache.count_prefix([2]) == 0
        assert disk_bytes(tmp_path) == 2 * size
    finally:
        cache.close()


def test_a_read_makes_its_file_the_most_recently_used(tmp_path: pathlib.Path) -> None:
    size = HEADER.size + len(PAYLOAD) + TRAILER.size
    cache = PromptCache(tmp_path, 2 * size, IDENTITY)
    try:
        assert cache.write(1, [PAYLOAD]) and cache.write(2, [PAYLOAD])
        assert cache.read(1) is not None
        assert cache.write(3, [PAYLOAD])  # evicts 2, read less recently than 1
        assert cache.count_prefix([1]) == 1 and cache.count_prefix([2]) == 0
    finally:
        cache.close()


# --- the owner ------------------------------------------------------------------------------------------


def test_a_second_owner_is_refused_naming_the_directory(cache: PromptCache) -> None:
    with pytest.raises(PromptCacheBusy, match="in use by another ft server") as info:
        PromptCache(cache.directory, 1 << 20, IDENTITY)
    assert cache.directory in str(info.value) and str(os.getpid()) in str(info.value)


def test_a_second_process_is_refused_until_the_owner_closes(tmp_path: pathlib.Path) -> None:
    code = (
        "import sys; from ft.core.prompt_cache import PromptCache, PromptCacheBusy\n"
        "try: PromptCache(sys.argv[1], 1 << 20, bytes(16)).close()\n"
        "except PromptCacheBusy as e: print(e); sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    refused = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert refused.returncode == 3 and str(tmp_path) in refused.stdout
    cache.close()
    taken = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert taken.returncode == 0, taken.stderr


# --- the writer -----------------------------------------------------------------------------------------


def test_the_writer_writes_what_is_submitted_and_close_flushes_it(tmp_path: pathlib.Path) -> None:
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    for key in range(10):
        assert cache.submit(key, [PAYLOAD])
    cache.close()
    assert len(cache_files(tmp_path)) == 10
    assert cache.statistics().writes == 10


def test_a_full_queue_drops_pages_and_never_blocks(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pc, "MAX_PENDING_BYTES", 3 * len(PAYLOAD))
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    release = threading.Event()
    original = cache.write

    def stuck(key: int, parts: list[bytes]) -> bool:
        release.wait(10)
        return original(key, parts)

    cache.write = stuck  # type: ignore[method-assign]
    results = [cache.submit(key, [PAYLOAD]) for key in range(6)]
    assert results.count(False) >= 2 and cache.statistics().dropped == results.count(False)
    assert not cache.has_room(len(PAYLOAD))
    release.set()
    cache.close()
    assert cache.statistics().writes == results.count(True)


def test_a_failing_disk_is_counted_not_raised(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pc.os, "fsync", full)
    try:
        assert not cache.write(KEY, [PAYLOAD])
        assert cache.statistics().write_errors == 1 and cache.statistics().bytes == 0
        assert not list(pathlib.Path(cache.own_dir).iterdir())
    finally:
        monkeypatch.undo()
        cache.close()


# --- the scheduler's side ----------------------------------------------------------------------------


class FakePages:
    """A `PageIO` over a dict: page -> payload bytes."""

    page_payload_bytes = 8

    def __init__(self) -> None:
        self.pages: dict[int, bytes] = {}

    def page_payload(self, page: int) -> list[bytes]:
        return [self.pages.get(page, bytes(8))]

    def load_page(self, page: int, payload: memoryview) -> None:
        self.pages[page] = bytes(payload)


def scheduler(cache: PromptCache, num_pages: int = 32) -> Scheduler:
    return Scheduler(
        PagePool(num_pages, 4),
        max_running=4,
        max_model_len=128,
        max_prefill_tokens=64,
        eos_token_ids=[0],
        disk=cache,
        disk_min_tokens=8,
    )


def serve(
    s: Scheduler,
    io: FakePages,
    cache: PromptCache,
    prompt: list[int],
    uid: int,
    partition: bytes | None = None,
) -> list[StepDone]:
    """Run request `uid` to its end, moving pages as the runner would; return its steps."""
    s.add(uid, prompt, SamplingParams(max_tokens=2, temperature=0), cache_partition=partition)
    dones = []
    while (batch := s.schedule()) is not None:
        cache.save_pages(io, batch.saves)
        loaded = cache.load_pages(io, batch.loads)
        for work in batch.works:  # "compute": a page's bytes name its tokens' chain
            for pos in range(work.start_pos, work.start_pos + len(work.token_ids)):
                page = work.page_ids[pos // 4]
                io.pages[page] = (pos // 4).to_bytes(8, "little")
        sampled = tuple(Sampled(w.seq_id, 5) for w in batch.works if w.sample)
        done = StepDone(batch.step, sampled, loaded=loaded)
        s.on_step_done(batch, done)
        dones.append(done)
    return dones


def test_the_scheduler_saves_registered_pages_and_a_new_one_loads_them(tmp_path: pathlib.Path) -> None:
    """Full pages are saved once registered; a scheduler with an empty pool (a restart) loads
    them in a step of their own, counts them as cached prompt tokens, and prefills the rest."""
    prompt = list(range(1, 22))  # 21 tokens: 5 full pages before the last token
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        serve(scheduler(cache), FakePages(), cache, prompt, 1)
    finally:
        cache.close()
    assert len(cache_files(tmp_path)) >= 5
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        s, io = scheduler(cache), FakePages()
        s.add(2, prompt, SamplingParams(max_tokens=2, temperature=0))
        first = s.schedule()
        assert first is not None and first.works == () and len(first.loads) == 1
        (load,) = first.loads
        assert len(load.keys) == 5
        s.on_step_done(first, StepDone(first.step, (), loaded=cache.load_pages(io, first.loads)))
        seq = next(iter(s.running.values()))
        assert seq.num_computed == 20 and seq.num_cached_prompt == 20 and s.num_disk_hit_tokens == 20
        second = s.schedule()
        assert second is not None and [(w.start_pos, len(w.token_ids)) for w in second.works] == [(20, 1)]
        assert [io.pages[p] for p in load.page_ids] == [i.to_bytes(8, "little") for i in range(5)]
    finally:
        cache.close()


def test_pages_on_disk_load_only_into_their_own_partition(tmp_path: pathlib.Path) -> None:
    """A restart's disk tier keeps the partitions apart: another tenant's (or the shared)
    prompt of the same tokens reads nothing; the same partition reads the five pages."""
    prompt = list(range(1, 22))
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        serve(scheduler(cache), FakePages(), cache, prompt, 1, b"tenant a")
    finally:
        cache.close()
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        for partition, num_loaded in ((b"tenant b", 0), (None, 0), (b"tenant a", 5)):
            s = scheduler(cache)
            s.add(2, prompt, SamplingParams(max_tokens=2, temperature=0), cache_partition=partition)
            first = s.schedule()
            assert first is not None and sum(len(load.keys) for load in first.loads) == num_loaded
    finally:
        cache.close()


def test_a_load_that_stops_early_prefills_from_the_first_missing_page(tmp_path: pathlib.Path) -> None:
    prompt = list(range(1, 22))
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        serve(scheduler(cache), FakePages(), cache, prompt, 1)
    finally:
        cache.close()
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        s = scheduler(cache)
        s.add(2, prompt, SamplingParams(max_tokens=2, temperature=0))
        first = s.schedule()
        assert first is not None
        s.on_step_done(first, StepDone(first.step, (), loaded=((first.loads[0].seq_id, 2),)))
        second = s.schedule()
        assert second is not None and [(w.start_pos, len(w.token_ids)) for w in second.works] == [(8, 13)]
        assert next(iter(s.running.values())).num_cached_prompt == 8
    finally:
        cache.close()


def test_a_short_prefix_on_disk_is_prefilled_not_read(tmp_path: pathlib.Path) -> None:
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        s = scheduler(cache)
        cache.write(page_hash(None, [1, 2, 3, 4]), [bytes(8)])  # 4 tokens < disk_min_tokens
        s.add(1, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=1))
        batch = s.schedule()
        assert batch is not None and batch.loads == () and batch.works[0].start_pos == 0
    finally:
        cache.close()


def test_an_evicted_page_not_on_disk_is_saved_before_its_page_is_reused(tmp_path: pathlib.Path) -> None:
    """A page whose write was dropped is saved when the pool evicts it, in the batch that
    reuses it (the runner copies saves before the step writes)."""
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        s = scheduler(cache, num_pages=8)
        s.add(1, list(range(1, 22)), SamplingParams(max_tokens=1))
        while (batch := s.schedule()) is not None:  # saves dropped: nothing reaches the disk
            sampled = tuple(Sampled(w.seq_id, 5) for w in batch.works if w.sample)
            s.on_step_done(batch, StepDone(batch.step, sampled))
        assert s.pool.num_cached == 5 and cache.statistics().writes == 0
        s.add(2, list(range(100, 121)), SamplingParams(max_tokens=1))
        batch = s.schedule()
        assert batch is not None
        reused = {p for w in batch.works for p in w.page_ids}
        assert {save.page_id for save in batch.saves} <= reused and len(batch.saves) >= 3
        assert all(isinstance(save, PageSave) for save in batch.saves)
    finally:
        cache.close()


def test_an_aborted_load_frees_its_pages(tmp_path: pathlib.Path) -> None:
    prompt = list(range(1, 22))
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        serve(scheduler(cache), FakePages(), cache, prompt, 1)
    finally:
        cache.close()
    cache = PromptCache(tmp_path, 1 << 20, IDENTITY)
    try:
        s = scheduler(cache)
        s.add(2, prompt, SamplingParams(max_tokens=2))
        first = s.schedule()
        assert first is not None and first.loads
        s.abort(2)
        s.on_step_done(first, StepDone(first.step, (), loaded=((first.loads[0].seq_id, 5),)))
        assert s.pool.num_used == 0 and s.schedule() is None
        assert isinstance(first.loads[0], PageLoad)
    finally:
        cache.close()
