"""Listing a KV bucket's keys against a real nats-server, past the 100,000 subjects one
stream-info answer names: the sweepers, quotas and listings read every key of a bucket that
holds every tenant's records, so a cut listing would silently drop other tenants' sessions,
runs and checkpoints from them. Gateway and workers list through the same code
(`natskv.store.KvStore`), each under its own retry policy."""

from __future__ import annotations

import asyncio

import pytest

from protocol import subjects
from protocol.topology import MAX_SUBJECTS_PER_ANSWER
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings
from workers.bus import WorkerBus

BUCKET = subjects.BUCKET_SESSIONS


@pytest.mark.timeout(180)
async def test_listings_page_past_one_stream_info_answer(nats_server: NatsServer) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    worker_bus = WorkerBus(nats_server.url)
    await worker_bus.connect()
    try:
        assert bus.js is not None
        n_keys = MAX_SUBJECTS_PER_ANSWER + 50
        for start in range(0, n_keys, 2000):  # KV puts, pipelined
            await asyncio.gather(
                *(
                    bus.js.publish(f"$KV.{BUCKET}.many.k{i:06d}", b"x")
                    for i in range(start, min(n_keys, start + 2000))
                )
            )
        await bus.put(BUCKET, "few.a", b"1")
        await bus.put(BUCKET, "few.b", b"2")

        keys = await bus.keys(BUCKET, "many")
        assert len(keys) == n_keys and keys[-1] == f"many.k{n_keys - 1:06d}"
        assert len(await bus.keys(BUCKET)) == n_keys + 2
        assert await bus.keys(BUCKET, "few") == ["few.a", "few.b"]
        assert await worker_bus.values(BUCKET, "few") == [b"1", b"2"]
        assert await worker_bus.keys(BUCKET, "few") == ["few.a", "few.b"]
        assert await bus.keys(BUCKET, "none") == []
    finally:
        await worker_bus.close()
        await bus.close()


@pytest.mark.timeout(60)
async def test_a_workers_listing_waits_for_nats_to_come_back(nats_server: NatsServer) -> None:
    """A worker lists under its retry policy, as it reads: a lease round that lists while NATS
    is away resumes once it is back, instead of failing after one request's timeout."""
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()  # creates the topology
    worker_bus = WorkerBus(nats_server.url, timeout_s=1.0)
    await worker_bus.connect(retry_s=30.0)
    try:
        await worker_bus.put(BUCKET, "few.a", b"1")
        await worker_bus.put(BUCKET, "few.b", b"2")
        nats_server.kill()
        listing = asyncio.create_task(worker_bus.values(BUCKET, "few"))
        await asyncio.sleep(2.5)  # past the timeout of a listing request
        assert not listing.done()
        nats_server.start()
        assert await asyncio.wait_for(listing, timeout=15) == [b"1", b"2"]
    finally:
        await worker_bus.close()
        await bus.close()
