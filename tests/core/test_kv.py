"""The page pool: allocation, prefix sharing, caching and eviction."""

from __future__ import annotations

import pytest

from ft.core.kv import PagePool, page_hash, partition_root


def test_allocate_and_release_returns_every_page() -> None:
    pool = PagePool(8, 4)
    pages = pool.allocate(5)
    assert pool.num_used == 5 and pool.num_allocatable == 3
    pool.release(pages)
    assert pool.num_used == 0 and pool.num_allocatable == 8


def test_allocate_more_than_allocatable_raises() -> None:
    pool = PagePool(4, 4)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(2)


def test_registered_pages_are_cached_then_reused() -> None:
    pool = PagePool(4, 2)
    h1 = page_hash(None, [1, 2])
    h2 = page_hash(h1, [3, 4])
    pages = pool.allocate(3)
    pool.register(pages[0], h1)
    pool.register(pages[1], h2)
    pool.release(pages)
    assert pool.num_used == 0 and pool.num_cached == 2
    matched = pool.match_prefix([h1, h2, page_hash(h2, [5, 6])])
    assert matched == pages[:2]
    assert pool.num_used == 2 and pool.num_cached == 0
    pool.release(matched)
    assert pool.num_used == 0


def test_cached_pages_are_evicted_lru_first_when_needed() -> None:
    pool = PagePool(2, 2)
    a, b = pool.allocate(2)
    pool.register(a, 11)
    pool.register(b, 22)
    pool.release([a])
    pool.release([b])
    (fresh,) = pool.allocate(1)
    assert fresh == a  # released first, evicted first
    assert pool.match_prefix([11]) == []
    assert pool.match_prefix([22]) == [b]


def test_shared_page_survives_until_last_holder_releases() -> None:
    pool = PagePool(4, 2)
    (p,) = pool.allocate(1)
    pool.register(p, 7)
    assert pool.match_prefix([7]) == [p]
    pool.release([p])
    assert pool.num_used == 1
    pool.release([p])
    assert pool.num_used == 0 and pool.num_cached == 1


def test_double_release_is_caught() -> None:
    pool = PagePool(2, 2)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(AssertionError):
        pool.release(pages)


def test_no_salt_is_the_shared_partition_whose_hashes_are_unchanged() -> None:
    """The shared partition's first page has no parent: the chain hashes a disk tier written
    before partitions existed filed its pages under (pinned)."""
    assert partition_root(None) is None
    first = page_hash(partition_root(None), [1, 2, 3, 4])
    assert first == 0xCA658F67433A5C683EF79832080BF540
    assert page_hash(first, [5, 6, 7, 8]) == 0xA7885ED53F9A901EE5403B979AE77992


def test_each_salt_roots_its_own_chain() -> None:
    roots = {partition_root(salt) for salt in ("a", "b", "", "A")}
    assert len(roots) == 4 and None not in roots
    assert partition_root("a") == partition_root(b"a")  # text is its UTF-8 bytes
    firsts = {page_hash(root, [1, 2, 3, 4]) for root in (None, *roots)}
    assert len(firsts) == 5  # the same tokens, five pages that never match one another
    assert all(page_hash(None, [t]) not in roots for t in range(64))


def test_pages_of_another_partition_never_match() -> None:
    pool = PagePool(4, 2)
    a, b = partition_root("tenant a"), partition_root("tenant b")
    (page,) = pool.allocate(1)
    pool.register(page, page_hash(a, [1, 2]))
    pool.release([page])
    assert pool.match_prefix([page_hash(b, [1, 2])]) == []
    assert pool.match_prefix([page_hash(None, [1, 2])]) == []
    assert pool.match_prefix([page_hash(a, [1, 2])]) == [page]
