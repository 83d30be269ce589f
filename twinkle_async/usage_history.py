"""Hourly usage history for the billing usage API, kept by the gateways in KV `tw_usage`.

Workers write cumulative counters per (tenant, worker) (`u.<tenant>.<worker>`, see
`workers/usage.py`) and nothing about *when* the work ran. The gateway watches those keys and
keeps, per (tenant, worker), the last value it saw in each UTC hour (`UsageHistory`, key
`hist.<tenant>.<worker_token>`); an hour's usage is the difference between its snapshot and the
one before. Pure core (`add_snapshot`, `hourly_usage`) and a thin KV shell (`UsageLedger`).

Invariants:
- Bounded: at most `MAX_HOURS` snapshots per (tenant, worker); the dropped front becomes the
  baseline, so the oldest kept hour still has a difference.
- Idempotent and commutative: every gateway may record the same update; for each hour the
  snapshot with the latest `updated_at` wins, so concurrent writers (compare-and-set) converge.
- Attribution is by the hour a worker's flush was written (`updated_at`, flushed every few
  seconds). Usage flushed while no gateway was running is attributed to the hour of the next
  flush a gateway saw; a worker whose counters went backwards (restarted under the same id)
  counts its new total from zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec
from nats.aio.subscription import Subscription

from protocol import records, subjects
from protocol.records import UsageHistory, UsageRecord
from twinkle_async.bus import Bus
from twinkle_async.registry import Registry

log = logging.getLogger(__name__)

HOUR_S = 3600
MAX_HOURS = 15 * 24  # the API's window is at most 14 days
COUNTERS: tuple[str, ...] = (
    "tokens_trained",
    "tokens_forward",
    "forward_backward_requests",
    "optim_steps",
    "samples",
    "sampled_tokens",
)
_MAX_SWAPS = 8


def hour_of(ts: float) -> int:
    """The UTC hour (hours since the epoch) a Unix time falls in."""
    return int(ts // HOUR_S)


def history_key(tenant_id: str, worker_id: str) -> str:
    return f"hist.{tenant_id}.{subjects.token(worker_id)}"


def live_prefix(tenant_id: str) -> str:
    """Prefix of the workers' own cumulative keys of a tenant (`workers/usage.py`)."""
    return f"u.{tenant_id}"


def add_snapshot(history: UsageHistory, record: UsageRecord, max_hours: int = MAX_HOURS) -> bool:
    """Record `record` as its hour's snapshot if it is the latest seen for that hour.

    Changes `history` in place; False when it was already there or older (nothing to write).
    """
    hour = hour_of(record.updated_at)
    snaps = history.snapshots
    index = len(snaps)
    while index > 0 and hour_of(snaps[index - 1].updated_at) > hour:
        index -= 1
    if index > 0 and hour_of(snaps[index - 1].updated_at) == hour:
        if snaps[index - 1].updated_at >= record.updated_at:
            return False
        snaps[index - 1] = record
    else:
        if index == 0 and history.baseline is not None and snaps:
            return False  # older than everything kept: its hour is gone
        snaps.insert(index, record)
    while len(snaps) > max_hours:
        history.baseline = snaps.pop(0)
    return True


@dataclass(frozen=True)
class HourUsage:
    """What one worker ran for one tenant in one UTC hour."""

    hour: int
    worker_id: str
    base_model: str
    counts: dict[str, int]


def hourly_usage(history: UsageHistory) -> list[HourUsage]:
    """Each kept hour's difference from the snapshot before it (or from zero)."""
    found = []
    previous = history.baseline
    for snap in history.snapshots:
        before = {name: getattr(previous, name) if previous else 0 for name in COUNTERS}
        now = {name: getattr(snap, name) for name in COUNTERS}
        if any(now[name] < before[name] for name in COUNTERS):
            before = dict.fromkeys(COUNTERS, 0)  # the counters restarted
        counts = {name: now[name] - before[name] for name in COUNTERS}
        if any(counts.values()):
            found.append(
                HourUsage(hour_of(snap.updated_at), history.worker_id, history.base_model, counts)
            )
        previous = snap
    return found


class UsageLedger:
    """Watches the workers' usage keys and keeps each (tenant, worker) history in KV.

    Updates are coalesced per key and written by one owned task at most every `interval_s`.
    """

    def __init__(self, bus: Bus, registry: Registry, interval_s: float = 1.0) -> None:
        self.bus = bus
        self.registry = registry
        self.interval_s = interval_s
        self._pending: dict[str, UsageRecord] = {}
        # each (tenant, worker)'s counters as last heard (the console's token rates read them)
        self.latest: dict[str, UsageRecord] = {}
        self._wake = asyncio.Event()
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe_kv(subjects.BUCKET_USAGE, "u.>", self._on_update)
        for value in await self.bus.values(subjects.BUCKET_USAGE, "u"):
            self._remember(value)
        self._task = asyncio.create_task(self._run(), name="usage-ledger")

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _on_update(self, key: str, data: bytes) -> None:
        if data:
            self._remember(data)

    def _remember(self, data: bytes) -> None:
        try:
            record = records.decode(data, UsageRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # not a usage record (a rate bucket shares the bucket, under `rate.`)
        key = f"{record.tenant_id}/{record.worker_id}"
        self._pending[key] = self.latest[key] = record
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            for record in pending.values():
                try:
                    await self.record(record)
                except Exception:
                    log.exception(
                        "usage history of %s on %s not written", record.tenant_id, record.worker_id
                    )
            await asyncio.sleep(self.interval_s)

    async def record(self, record: UsageRecord) -> None:
        """Add one cumulative record to its (tenant, worker) history (compare-and-set)."""
        key = history_key(record.tenant_id, record.worker_id)
        worker = self.registry.workers.get(record.worker_id)
        for _ in range(_MAX_SWAPS):
            entry = await self.bus.entry(subjects.BUCKET_USAGE, key)
            if entry is None:
                history = UsageHistory(record.tenant_id, record.worker_id)
            else:
                history = records.decode(entry[0], UsageHistory)
            if not history.base_model and worker is not None:
                history.base_model = worker.base_model
            if not add_snapshot(history, record):
                return
            revision = entry[1] if entry else None
            if await self.bus.swap(subjects.BUCKET_USAGE, key, records.encode(history), revision):
                return
        log.warning("usage history %s is contended; the next update will add it", key)

    async def histories(self, tenant_id: str) -> list[UsageHistory]:
        """A tenant's histories, each with the workers' latest counters added (not written)."""
        found: dict[str, UsageHistory] = {}
        for value in await self.bus.values(subjects.BUCKET_USAGE, f"hist.{tenant_id}"):
            history = records.decode(value, UsageHistory)
            found[history.worker_id] = history
        for value in await self.bus.values(subjects.BUCKET_USAGE, live_prefix(tenant_id)):
            live = records.decode(value, UsageRecord)
            if live.tenant_id != tenant_id:
                continue
            history = found.setdefault(live.worker_id, UsageHistory(tenant_id, live.worker_id))
            add_snapshot(history, live)
        return list(found.values())
