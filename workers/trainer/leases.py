"""Shard leases: which trainer worker of a pool consumes which shard of `TW_OPS`.

Every op of a model lands in one shard, and a model's adapter state lives on the worker that
trains it, so each shard has exactly one owner at a time. Ownership is a lease in KV
`tw_leases` (key `<pool>.<shard>`): claimed with a create, renewed with a compare-and-set on
the entry's revision, taken over by anyone once its `expires_at` has passed (a dead owner stops
renewing), handed over by deleting it.

Pure core: `plan` decides, from the leases and the live workers, what one worker claims and
releases so that shards spread evenly (each worker aims at ceil(shards / workers)). The shell,
`LeaseKeeper`, runs it every `renew_s` and tells the service which shards it gained and lost.
A restarted worker with the same id finds its own unexpired leases and keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from protocol import records, subjects
from protocol.records import LeaseRecord
from workers.bus import WorkerBus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeasePlan:
    """What one worker does this round: shards to claim (free or expired) and to hand over."""

    claim: tuple[int, ...]
    release: tuple[int, ...]


def plan(
    n_shards: int,
    me: str,
    leases: dict[int, LeaseRecord],
    live_workers: set[str],
    now: float,
) -> LeasePlan:
    """This worker's claims and releases for one round.

    - A shard whose lease expired has lost its owner: claim it at once, whatever the share
      (its models wait for someone; the spread is evened out later).
    - A shard never claimed: claim it while below the fair share, ceil(shards / live workers).
    - Release shards beyond the share while another live worker holds none and none is free,
      or when holding more than one beyond it.

    `leases` holds the current lease of each shard that has one; `live_workers` are the pool's
    trainers with a fresh heartbeat (`me` is always counted).
    """
    workers = live_workers | {me}
    share = math.ceil(n_shards / len(workers))
    mine = sorted(s for s, lease in leases.items() if lease.worker_id == me)
    orphaned = [
        s for s, lease in leases.items() if lease.worker_id != me and lease.expires_at <= now
    ]
    unclaimed = [s for s in range(n_shards) if s not in leases]
    room = max(0, share - len(mine) - len(orphaned))
    claim = sorted(orphaned) + unclaimed[:room]
    holders = {lease.worker_id for lease in leases.values() if lease.expires_at > now}
    starving = not unclaimed and any(w not in holders for w in workers if w != me)
    release = mine[share:] if starving or len(mine) > share + 1 else []
    return LeasePlan(claim=tuple(claim), release=tuple(release))


Gain = Callable[[int, str | None], Awaitable[None]]  # (shard, the owner whose lease ran out)
Loss = Callable[[int], Awaitable[None]]


class LeaseKeeper:
    """Keeps this worker's leases of one pool: renew, claim, release, every `renew_s`."""

    def __init__(
        self,
        bus: WorkerBus,
        pool: str,
        worker_id: str,
        n_shards: int,
        *,
        lease_s: float = 10.0,
        renew_s: float = 2.5,
        live_workers: Callable[[], Awaitable[dict[str, float]]],
        on_gain: Gain,
        on_lose: Loss,
    ) -> None:
        self.bus = bus
        self.pool = pool
        self.worker_id = worker_id
        self.n_shards = n_shards
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.live_workers = live_workers
        self.on_gain = on_gain
        self.on_lose = on_lose
        self.held: set[int] = set()
        # workers whose lease ran out, and when: dead until a heartbeat newer than that shows
        self._dead_since: dict[str, float] = {}
        self.settled = asyncio.Event()  # set after the first round: this worker's share is known

    async def run(self) -> None:
        """Every `renew_s`: one round (a failed round is logged; the next one retries)."""
        while True:
            try:
                await self.round(time.time())
                self.settled.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # a loop boundary: NATS away, say; the leases are renewed later
                log.exception("lease round failed; retrying in %.1f s", self.renew_s)
            await asyncio.sleep(self.renew_s)

    async def round(self, now: float) -> None:
        leases = await self._leases()
        for shard, ours in sorted(leases.items()):
            # a previous run of this worker (same id, restarted after a crash) held it
            if ours.worker_id == self.worker_id and shard not in self.held:
                if await self._renew(shard, now):
                    self.held.add(shard)
                    log.info("resumed shard %d of %s", shard, self.pool)
                    await self.on_gain(shard, None)
        for shard in list(self.held):
            lease = leases.get(shard)
            if (
                lease is None
                or lease.worker_id != self.worker_id
                or not await self._renew(shard, now)
            ):
                await self._lost(shard)
        for lease in leases.values():
            if lease.worker_id != self.worker_id and lease.expires_at <= now:
                self._dead_since[lease.worker_id] = lease.expires_at
        beats = await self.live_workers()
        live = {w for w, beat in beats.items() if beat > self._dead_since.get(w, float("-inf"))}
        plan_now = plan(self.n_shards, self.worker_id, leases, live, now)
        gained = [shard for shard in plan_now.claim if await self._claim(shard, now)]
        for shard in gained:
            before = leases.get(shard)
            await self.on_gain(shard, before.worker_id if before is not None else None)
        for shard in plan_now.release:
            await self.release(shard)

    async def release(self, shard: int) -> None:
        """Hand a shard over: stop consuming it first, then delete the lease."""
        if shard not in self.held:
            return
        await self.on_lose(shard)
        self.held.discard(shard)
        await self.bus.delete(subjects.BUCKET_LEASES, subjects.lease_key(self.pool, shard))
        log.info("released shard %d of %s", shard, self.pool)

    async def release_all(self) -> None:
        for shard in list(self.held):
            try:
                await self.release(shard)
            except Exception:
                log.exception("releasing shard %d failed; its lease will expire", shard)

    async def _lost(self, shard: int) -> None:
        log.warning("lost the lease of shard %d of %s", shard, self.pool)
        self.held.discard(shard)
        await self.on_lose(shard)

    async def _leases(self) -> dict[int, LeaseRecord]:
        found: dict[int, LeaseRecord] = {}
        for value in await self.bus.values(subjects.BUCKET_LEASES, self.pool):
            lease = records.decode(value, LeaseRecord)
            found[lease.shard] = lease
        return found

    def _record(self, shard: int, now: float, claimed_at: float | None = None) -> bytes:
        return records.encode(
            LeaseRecord(
                pool=self.pool,
                shard=shard,
                worker_id=self.worker_id,
                expires_at=now + self.lease_s,
                claimed_at=claimed_at if claimed_at is not None else now,
            )
        )

    async def _claim(self, shard: int, now: float) -> bool:
        key = subjects.lease_key(self.pool, shard)
        entry = await self.bus.entry(subjects.BUCKET_LEASES, key)
        revision = entry[1] if entry is not None and entry[0] else None
        if entry is not None and entry[0]:
            lease = records.decode(entry[0], LeaseRecord)
            if lease.expires_at > now and lease.worker_id != self.worker_id:
                return False  # someone renewed it meanwhile
        swapped = await self.bus.swap(
            subjects.BUCKET_LEASES, key, self._record(shard, now), revision
        )
        if not swapped:
            return False
        self.held.add(shard)
        log.info("claimed shard %d of %s", shard, self.pool)
        return True

    async def _renew(self, shard: int, now: float) -> bool:
        key = subjects.lease_key(self.pool, shard)
        entry = await self.bus.entry(subjects.BUCKET_LEASES, key)
        if entry is None or not entry[0]:
            return False
        lease = records.decode(entry[0], LeaseRecord)
        if lease.worker_id != self.worker_id:
            return False
        if not await self.bus.swap(
            subjects.BUCKET_LEASES, key, self._record(shard, now, lease.claimed_at), entry[1]
        ):
            return False
        return True
