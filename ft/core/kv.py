"""The KV page pool: reference-counted pages with a hash-keyed prefix cache.

A page is *used* while some sequence holds it, *cached* while no sequence holds it but its
content (a full page of tokens after a known prefix) is remembered for reuse, and *free*
otherwise. Cached pages are evicted least recently released first when free ones run out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full page of `tokens` following the page whose hash is `parent`."""
    return hash((parent, tuple(tokens)))


class PagePool:
    """Allocates KV pages; shares full pages between sequences with the same prefix."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._hash_of: dict[int, int] = {}  # page -> content hash
        self._page_of: dict[int, int] = {}  # content hash -> page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages, LRU first

    @property
    def num_used(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_pages - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages held by no sequence whose content is kept for prefix reuse."""
        return len(self._evictable)

    @property
    def num_allocatable(self) -> int:
        """Pages `allocate` can hand out now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        """True when `n` pages can be allocated now."""
        return n <= self.num_allocatable

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh pages, evicting cached ones if needed. Raises if there are too few."""
        if not self.can_allocate(n):
            raise MemoryError(f"asked for {n} KV pages, {self.num_allocatable} allocatable")
        pages: list[int] = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Pages holding the longest cached run of `hashes`; each returned page gains a ref."""
        pages: list[int] = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
            pages.append(page)
        return pages

    def register(self, page: int, h: int) -> None:
        """Remember that `page` (held, full) holds the content hashed `h`."""
        if page in self._hash_of or h in self._page_of:
            return
        self._hash_of[page] = h
        self._page_of[h] = page

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages become cached or free."""
        for page in pages:
            self._refs[page] -= 1
            assert self._refs[page] >= 0, f"page {page} released twice"
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
