"""API keys and tenants: who is calling. A pure core (hashing, minting) and a KV shell.

Keys are `tml-<random>`; only their sha256 is stored (`tw_keys`, key `h.<hash>` → `KeyRecord`,
and `id.<key_id>` → the hash, so an operator can revoke by id). A gateway resolves a key to its
tenant with one KV read, then caches the answer; every gateway watches the bucket live, so a
revocation reaches all of them at once, and a cached entry is re-read after `cache_ttl_s`
anyway (a watch can miss an update across a reconnect).

Bootstrap keys from `--api-key` / `--key-file` live in settings, never in KV: a local cluster
works before any tenant exists.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from nats.aio.subscription import Subscription

from protocol import records, subjects
from protocol.errors import NotFound
from protocol.records import KeyRecord
from twinkle_async.bus import Bus

KEY_PREFIX = "tml-"


def hash_key(key: str) -> str:
    """The stored form of a key (hex sha256)."""
    return hashlib.sha256(key.encode()).hexdigest()


def mint_key() -> tuple[str, str]:
    """A new key and its id: `(tml-<43 url-safe chars>, key-<12 hex>)`."""
    return KEY_PREFIX + secrets.token_urlsafe(32), f"key-{secrets.token_hex(6)}"


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison (an admin key, a bootstrap key)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def key_index(key_id: str) -> str:
    return f"id.{key_id}"


def hash_index(key_hash: str) -> str:
    return f"h.{key_hash}"


@dataclass
class _Cached:
    record: KeyRecord | None
    read_at: float


class KeyRing:
    """Resolves API keys to tenants: bootstrap keys first, then KV, cached and watched."""

    def __init__(self, bus: Bus, bootstrap: dict[str, str], cache_ttl_s: float = 30.0) -> None:
        self.bus = bus
        self.bootstrap = {hash_key(key): tenant for key, tenant in bootstrap.items()}
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, _Cached] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe_kv(subjects.BUCKET_KEYS, "h.>", self._on_update)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_update(self, key: str, data: bytes) -> None:
        # Any change to a key (revoked, deleted) drops the cached answer; the next call re-reads.
        self._cache.pop(key[len("h.") :], None)

    async def tenant_of(self, key: str) -> str | None:
        """The tenant a key belongs to, or None for an unknown or revoked key."""
        if not key.startswith(KEY_PREFIX):
            return None
        return await self.tenant_of_hash(hash_key(key))

    async def tenant_of_hash(self, key_hash: str) -> str | None:
        """`tenant_of` for a key known by its hash (a console session keeps only that)."""
        tenant = self.bootstrap.get(key_hash)
        if tenant is not None:
            return tenant
        now = time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is None or now - cached.read_at > self.cache_ttl_s:
            data = await self.bus.get(subjects.BUCKET_KEYS, hash_index(key_hash))
            cached = _Cached(records.decode(data, KeyRecord) if data else None, now)
            if cached.record is not None:
                self._cache[key_hash] = cached  # unknown keys are not cached: no memory for junk
        record = cached.record
        if record is None or record.revoked_at is not None:
            return None
        return record.tenant_id

    # -- administration ------------------------------------------------------------------------

    async def create(self, tenant_id: str, label: str) -> tuple[str, KeyRecord]:
        """Mint a key for `tenant_id`; the key itself is returned once and never stored."""
        key, key_id = mint_key()
        record = KeyRecord(
            key_id=key_id,
            tenant_id=tenant_id,
            key_hash=hash_key(key),
            prefix=key[: len(KEY_PREFIX) + 6],
            created_at=time.time(),
            label=label,
        )
        await self.bus.put(
            subjects.BUCKET_KEYS, hash_index(record.key_hash), records.encode(record)
        )
        await self.bus.put(subjects.BUCKET_KEYS, key_index(key_id), record.key_hash.encode())
        return key, record

    async def list(self, tenant_id: str | None = None) -> list[KeyRecord]:
        found = [
            records.decode(value, KeyRecord)
            for value in await self.bus.values(subjects.BUCKET_KEYS, "h")
        ]
        mine = [r for r in found if tenant_id is None or r.tenant_id == tenant_id]
        return sorted(mine, key=lambda r: r.created_at)

    async def revoke(self, key_id: str) -> KeyRecord:
        """Revoke a key by id; it fails on every gateway from its next call."""
        key_hash = await self.bus.get(subjects.BUCKET_KEYS, key_index(key_id))
        data = (
            await self.bus.get(subjects.BUCKET_KEYS, hash_index(key_hash.decode()))
            if key_hash
            else None
        )
        if data is None:
            raise NotFound(f"key_id {key_id!r} not found")
        record = records.decode(data, KeyRecord)
        if record.revoked_at is None:
            record.revoked_at = time.time()
            await self.bus.put(
                subjects.BUCKET_KEYS, hash_index(record.key_hash), records.encode(record)
            )
        self._cache.pop(record.key_hash, None)
        return record
