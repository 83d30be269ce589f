"""Per-tenant quotas: hard caps that refuse, a token rate that queues, and samples in flight.

Pure core (`Limits`, `effective`, `check_cap`, `take`, `admit_sample`, `release_sample`) and
thin KV shells (`Quotas`, `InFlight`).

- Hard caps (active adapters, LoRA rank, tokens per request, checkpoint bytes) answer a
  `QuotaExceeded` (403) naming the limit and the current value.
- Concurrent samples (`max_concurrent_samples`) are counted for the whole cluster in one KV
  entry per tenant, written with a compare-and-set so two gateways cannot both take the last
  slot; a sample over the limit answers `RateLimited` (429, which the SDK retries).
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
from protocol.errors import QuotaExceeded, RateLimited, Unavailable
from protocol.records import InFlightSamples, QuotaRecord, RateBucket
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


# The most entries one tenant's in-flight record holds, whatever its limit (an operator may set
# a higher one): so the value stays well under a stock nats-server's 1 MiB `max_payload`, at
# most 139 bytes an entry (a 128-character request id and a float, msgpack), 570 KB in all;
# with our 43-character request ids, 220 KB.
MAX_IN_FLIGHT = 4096

_MAX_SWAP_TRIES = 64  # compare-and-set attempts of one admit or release under contention


def live_samples(record: InFlightSamples | None, now: float, ttl_s: float) -> dict[str, float]:
    """The record's requests admitted at most `ttl_s` before `now` (a copy): a client that
    never fetches its result stops counting."""
    if record is None:
        return {}
    return {rid: t for rid, t in record.started.items() if now - t <= ttl_s}


def admit_sample(
    record: InFlightSamples | None,
    request_id: str,
    limit: int,
    now: float,
    ttl_s: float,
    max_entries: int = MAX_IN_FLIGHT,
) -> InFlightSamples | None:
    """The tenant's in-flight record with `request_id` added, dropping expired entries; None
    when it is in already (a retried submit: nothing to write).

    Raises `RateLimited` when `limit` requests are in flight, or `max_entries`.
    """
    started = live_samples(record, now, ttl_s)
    if request_id in started:
        return None
    if len(started) >= limit:
        raise RateLimited(
            f"quota max_concurrent_samples: {limit} sample requests in flight; retry when one"
            " finishes"
        )
    if len(started) >= max_entries:
        raise RateLimited(
            f"{len(started)} sample requests of this tenant are in flight, the most this cluster"
            f" keeps count of (quota max_concurrent_samples is {limit}); retry when one finishes"
        )
    started[request_id] = now
    return InFlightSamples(started=started)


def release_sample(record: InFlightSamples | None, request_id: str) -> InFlightSamples | None:
    """The record without `request_id`; None when it was not in (nothing to write)."""
    if record is None or request_id not in record.started:
        return None
    return InFlightSamples(
        started={rid: t for rid, t in record.started.items() if rid != request_id}
    )


def in_flight_key(tenant_id: str) -> str:
    """The tenant's in-flight samples in `tw_usage`. Like `rate_key`, it holds the tenant id as
    it is: a valid KV key for every tenant name `rules.check_tenant_name` lets through."""
    return f"inflight.{tenant_id}"


class InFlight:
    """Sample requests a tenant has in flight on the whole cluster, for `max_concurrent_samples`.

    One `tw_usage` entry per tenant (`inflight.<tenant>`) that every gateway updates with a
    compare-and-set. A request is in flight from its submit until its result is retrieved (or
    it is cancelled), or at most `ttl_s` (a client that never asks stops counting). Only a
    tenant with the limit costs a KV round trip; entries left when a limit is removed expire.
    """

    def __init__(
        self,
        bus: Bus,
        quotas: Quotas,
        *,
        ttl_s: float = 600.0,
        max_entries: int = MAX_IN_FLIGHT,
    ) -> None:
        self.bus = bus
        self.quotas = quotas
        self.ttl_s = ttl_s
        self.max_entries = max_entries

    async def admit(self, tenant_id: str, request_id: str, limit: int | None, now: float) -> None:
        """Count `request_id` in, or raise `RateLimited` when `limit` are in flight already.

        `limit` is the tenant's `max_concurrent_samples` (None: nothing is counted). Admitting
        an id already in is a success that writes nothing.
        """
        if limit is None:
            return
        key = in_flight_key(tenant_id)
        for _ in range(_MAX_SWAP_TRIES):
            entry = await self.bus.entry(subjects.BUCKET_USAGE, key)
            record = records.decode(entry[0], InFlightSamples) if entry else None
            admitted = admit_sample(record, request_id, limit, now, self.ttl_s, self.max_entries)
            if admitted is None:
                return
            revision = entry[1] if entry else None
            if await self.bus.swap(subjects.BUCKET_USAGE, key, records.encode(admitted), revision):
                return
        raise Unavailable(
            f"could not count sample {request_id} in: the tenant's samples in flight changed"
            f" under {_MAX_SWAP_TRIES} tries; retry"
        )

    async def done(self, tenant_id: str, request_id: str) -> None:
        """Count `request_id` out (its result was fetched, or it was cancelled); no write when
        it is not in, and no read of the in-flight entry for a tenant without the limit."""
        if (await self.quotas.limits(tenant_id)).max_concurrent_samples is None:
            return
        key = in_flight_key(tenant_id)
        for _ in range(_MAX_SWAP_TRIES):
            entry = await self.bus.entry(subjects.BUCKET_USAGE, key)
            if entry is None:
                return
            released = release_sample(records.decode(entry[0], InFlightSamples), request_id)
            if released is None:
                return
            if await self.bus.swap(subjects.BUCKET_USAGE, key, records.encode(released), entry[1]):
                return
        raise Unavailable(
            f"could not count sample {request_id} out: the tenant's samples in flight changed"
            f" under {_MAX_SWAP_TRIES} tries; retry"
        )
