"""Per-tenant quotas: hard caps that refuse, and a token rate that queues.

Pure core (`Limits`, `effective`, `check_cap`, `take`) and a thin KV shell (`Quotas`).

- Hard caps (active adapters, LoRA rank, tokens per request, concurrent samples, checkpoint
  bytes) answer a `QuotaExceeded` (403) naming the limit and the current value.
- The training-token rate is a token bucket per tenant (`tokens_per_minute`, with a burst of
  `rate_burst_s` seconds' worth, a minute by default), kept in KV so every gateway shares it. A request over the rate is *accepted* and
  queued: it gets a `not_before` time the worker honours, and until then the SDK's polls answer
  `try_again` with `queue_state="paused_rate_limit"` and the reason. Only a queue longer than
  `max_queue_s` is refused (429, which the SDK retries with backoff).

`None` everywhere means unlimited. A tenant's quota record overrides the deployment defaults
limit by limit.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

from protocol import records, subjects
from protocol.errors import QuotaExceeded, RateLimited
from protocol.records import QuotaRecord, RateBucket
from twinkle_async.bus import Bus
from twinkle_async.settings import Limits

LIMIT_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Limits))


def effective(defaults: Limits, record: QuotaRecord | None) -> Limits:
    """The defaults, overridden by every limit the tenant's record sets."""
    if record is None:
        return defaults
    overrides = {
        name: getattr(record, name) for name in LIMIT_NAMES if getattr(record, name) is not None
    }
    return replace(defaults, **overrides)


def check_cap(name: str, current: int, adding: int, limit: int | None) -> None:
    """Refuse when `current + adding` would pass `limit`, naming both."""
    if limit is not None and current + adding > limit:
        raise QuotaExceeded(
            f"quota {name} exceeded: {current} in use, this request needs {adding} more, the"
            f" limit is {limit}"
        )


def check_limit(name: str, value: int, limit: int | None) -> None:
    """Refuse a single value over its limit (a rank, a request's tokens), naming both."""
    if limit is not None and value > limit:
        raise QuotaExceeded(
            f"quota {name} exceeded: this request needs {value}, the limit is {limit}"
        )


def check_room(name: str, used: int, limit: int | None) -> None:
    """Refuse when a stock (stored bytes) has reached its limit, naming both."""
    if limit is not None and used >= limit:
        raise QuotaExceeded(f"quota {name} exceeded: {used} used, the limit is {limit}")


def take(
    bucket: RateBucket | None, tokens: int, per_minute: int, now: float, burst_s: float = 60.0
) -> tuple[RateBucket, float]:
    """Take `tokens` from a bucket refilling at `per_minute`, holding `burst_s` seconds' worth.

    Returns the new bucket and when the request may start: now if the bucket covers it, else
    once the refill has paid the debt. Debt accumulates, so a tenant's requests start in the
    order they were taken.
    """
    rate_per_s = per_minute / 60.0
    capacity = rate_per_s * burst_s
    if bucket is None:
        level = capacity
    else:
        level = min(capacity, bucket.level + (now - bucket.updated_at) * rate_per_s)
    level -= tokens
    start_at = now if level >= 0 else now + (-level) / rate_per_s
    return RateBucket(level=level, updated_at=now), start_at


def rate_key(tenant_id: str) -> str:
    return f"rate.{tenant_id}"


class Quotas:
    """Limits per tenant from KV `tw_quotas` (briefly cached), and the shared rate buckets."""

    def __init__(
        self,
        bus: Bus,
        defaults: Limits,
        *,
        max_queue_s: float = 600.0,
        burst_s: float = 60.0,
        cache_s: float = 2.0,
    ) -> None:
        self.bus = bus
        self.defaults = defaults
        self.max_queue_s = max_queue_s
        self.burst_s = burst_s
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, Limits]] = {}

    async def record(self, tenant_id: str) -> QuotaRecord | None:
        data = await self.bus.get(subjects.BUCKET_QUOTAS, tenant_id)
        return records.decode(data, QuotaRecord) if data else None

    async def limits(self, tenant_id: str) -> Limits:
        now = time.monotonic()
        cached = self._cache.get(tenant_id)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        limits = effective(self.defaults, await self.record(tenant_id))
        self._cache[tenant_id] = (now, limits)
        return limits

    async def set(self, record: QuotaRecord) -> Limits:
        await self.bus.put(subjects.BUCKET_QUOTAS, record.tenant_id, records.encode(record))
        self._cache.pop(record.tenant_id, None)
        return effective(self.defaults, record)

    async def admit_tokens(self, tenant_id: str, tokens: int, per_minute: int) -> float:
        """When `tokens` of training may start for the tenant (a compare-and-set on its bucket).

        Raises `RateLimited` when the queue ahead of this request is longer than `max_queue_s`.
        """
        key = rate_key(tenant_id)
        while True:
            entry = await self.bus.entry(subjects.BUCKET_USAGE, key)
            bucket = records.decode(entry[0], RateBucket) if entry else None
            now = time.time()
            new_bucket, start_at = take(bucket, tokens, per_minute, now, self.burst_s)
            if start_at - now > self.max_queue_s:
                raise RateLimited(
                    f"quota tokens_per_minute: {per_minute} training tokens per minute; this"
                    f" request would wait {start_at - now:.0f} s behind the tenant's queue"
                    f" (at most {self.max_queue_s:.0f} s); retry later"
                )
            revision = entry[1] if entry else None
            if await self.bus.swap(
                subjects.BUCKET_USAGE, key, records.encode(new_bucket), revision
            ):
                return start_at


class InFlight:
    """Sample requests a tenant has in flight on this gateway, for `max_concurrent_samples`.

    Counted per gateway (each admits up to the limit): a request is in flight from its submit
    until its result is retrieved, or at most `ttl_s` (a client that never asks stops counting).
    """

    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._started: dict[str, dict[str, float]] = {}

    def count(self, tenant_id: str, now: float) -> int:
        started = self._started.get(tenant_id, {})
        for request_id in [r for r, t in started.items() if now - t > self.ttl_s]:
            del started[request_id]
        return len(started)

    def add(self, tenant_id: str, request_id: str, now: float) -> None:
        self._started.setdefault(tenant_id, {})[request_id] = now

    def done(self, tenant_id: str, request_id: str) -> None:
        started = self._started.get(tenant_id)
        if started is not None:
            started.pop(request_id, None)
            if not started:
                del self._started[tenant_id]
