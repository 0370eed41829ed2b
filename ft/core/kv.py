"""The KV page pool: reference-counted pages with a hash-keyed prefix cache.

A page is *used* while some sequence holds it, *cached* while no sequence holds it but its
content (a full page of tokens after a known prefix) is remembered for reuse, and *free*
otherwise. Cached pages are evicted least recently released first when free ones run out.

A page's hash names its whole chain (every token up to the page's end) and its partition, and is
the same in every process: the prompt cache's disk tier (`ft.core.prompt_cache`) files pages under
it. A partition (`partition_root`: one per tenant and cache salt) is the first page's parent, so
pages of different partitions never match, in the pool or on disk; the shared partition's first
parent is None, the hashes pages always had.

With a draft model (speculative decoding) a page also holds the draft's KV, written only when
the draft was fed the page's tokens: the pool remembers which pages have it (`mark_drafted`),
until they are handed out again, so a prefix-cache hit skips feeding the draft those pages.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

HASH_BYTES = 16  # 128-bit page hashes: a chain key on disk must not collide across restarts
_PARTITION_PERSON = b"ft-cache-salt"  # a partition's root is never any page's hash


def partition_root(salt: bytes | str | None) -> int | None:
    """The parent hash of the first page of `salt`'s partition of the prefix cache.

    None (no salt) is the shared partition: its first page has no parent, so its hashes are the
    ones pages had before partitions existed and a disk tier written then still matches. Any
    other salt (an empty one included) names its own partition, a blake2b of the salt under a
    personalization no page hash uses.
    """
    if salt is None:
        return None
    data = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else salt
    digest = hashlib.blake2b(data, digest_size=HASH_BYTES, person=_PARTITION_PERSON).digest()
    return int.from_bytes(digest, "little")


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full page of `tokens` following the page whose hash is `parent` (for the first
    page, its partition's root: `partition_root`, None in the shared partition): blake2b over
    the parent's hash and the token ids, stable across processes (Python's `hash()` is salted
    per process)."""
    head = b"\0" * (1 + HASH_BYTES) if parent is None else b"\1" + parent.to_bytes(HASH_BYTES, "little")
    body = struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(head + body, digest_size=HASH_BYTES).digest(), "little")


class PagePool:
    """Allocates KV pages; shares full pages between sequences with the same prefix."""

    def __init__(
        self, num_pages: int, page_size: int, on_evict: Callable[[int, int], None] | None = None
    ) -> None:
        self.num_pages = num_pages
        # Called with (page, hash) when a cached page is evicted, before `allocate` returns it:
        # its KV is still intact until the next step writes the page (the disk tier saves it).
        self.on_evict = on_evict
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._hash_of: dict[int, int] = {}  # page -> content hash
        self._page_of: dict[int, int] = {}  # content hash -> page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages, LRU first
        self._drafted: set[int] = set()  # pages whose draft-model KV is written (full pages)

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
                h = self._hash_of.pop(page)
                del self._page_of[h]
                if self.on_evict is not None:
                    self.on_evict(page, h)
            self._refs[page] = 1
            self._drafted.discard(page)  # to be written anew
            pages.append(page)
        return pages

    def mark_drafted(self, pages: Sequence[int]) -> None:
        """Note that full pages `pages` (held) hold the draft model's KV of their tokens too."""
        self._drafted.update(pages)

    def num_drafted(self, pages: Sequence[int]) -> int:
        """How many of `pages`, from the first, hold the draft model's KV."""
        n = 0
        while n < len(pages) and pages[n] in self._drafted:
            n += 1
        return n

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

    def share(self, pages: Sequence[int]) -> None:
        """One more reference to each of `pages` (held): another sequence reads them too (a
        choice of `n` forked after its request's shared prompt)."""
        for page in pages:
            assert self._refs[page] > 0, f"page {page} is not held"
            self._refs[page] += 1

    def register(self, page: int, h: int) -> bool:
        """Remember that `page` (held, full) holds the content hashed `h`; False when the page
        or the content is known already (another page holds the same content)."""
        if page in self._hash_of or h in self._page_of:
            return False
        self._hash_of[page] = h
        self._page_of[h] = page
        return True

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
