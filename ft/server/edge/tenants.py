"""Who a request is: the tenant of the API key it carries (see docs/security.md).

A server with several API keys (`--api-key` given more than once, `--api-key-file`) serves each
key as a tenant of its own: the prefix cache is partitioned per tenant
(`PromptSpec.cache_partition`), so no tenant's prompt can be read back by another through
`cached_tokens` or time to first token. With one key or none there is one tenant (`Caller.tenant`
None) and nothing changes.

A tenant is named by a blake2b of its key, never the key: that id is what the request's record
holds (`RequestRecord.tenant`) and what the cache partitions by. Keys are matched by their
digests, each presented key against every configured one with `hmac.compare_digest` and no
early exit, so neither which key matched nor how much of it did shows in the time taken.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

MAX_API_KEYS = 4096  # the match compares against every key: ~0.3 ms a request at this bound
_MATCH_PERSON = b"ft-api-key"
_TENANT_PERSON = b"ft-tenant"


@dataclass(frozen=True, slots=True)
class Caller:
    """Whom a request was let in as: its `tenant` id (None: the one tenant of a server with one
    API key or none)."""

    tenant: str | None = None


ONE_TENANT = Caller()


def tenant_id(key: str | bytes) -> str:
    """The id of the tenant whose API key is `key`: 32 hex digits of a blake2b of it."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return hashlib.blake2b(data, digest_size=16, person=_TENANT_PERSON).hexdigest()


def _digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=32, person=_MATCH_PERSON).digest()


class Tenants:
    """The server's API keys, kept as digests, and the tenant each one is."""

    def __init__(self, keys: Sequence[str]) -> None:
        if len(keys) > MAX_API_KEYS:
            raise ValueError(f"at most {MAX_API_KEYS} API keys, got {len(keys)}")
        encoded = [key.encode("utf-8") for key in keys]
        self._digests = tuple(_digest(key) for key in encoded)
        # One key (or none) is one tenant: its cache is shared as before.
        self._tenants = tuple(Caller(tenant_id(key)) for key in encoded) if len(keys) > 1 else ()

    @property
    def num_keys(self) -> int:
        """How many API keys are configured (0: no key needed)."""
        return len(self._digests)

    def identify(self, presented: bytes | None) -> Caller | None:
        """The caller `presented` (a request's key, as sent; None: none sent) makes, or None
        when a key is needed and it matches none.

        The presented key is hashed once and its digest compared with every configured one,
        all of them whatever matches.
        """
        if not self._digests:
            return ONE_TENANT
        if presented is None:
            return None
        given = _digest(presented)
        matches = [hmac.compare_digest(given, digest) for digest in self._digests]
        if True not in matches:
            return None
        return self._tenants[matches.index(True)] if self._tenants else ONE_TENANT
