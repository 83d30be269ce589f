"""Listing a KV bucket's keys against a real nats-server, past the 100,000 subjects one
stream-info answer names: the sweepers, quotas and listings read every key of a bucket that
holds every tenant's records, so a cut listing would silently drop other tenants' sessions,
runs and checkpoints from them."""

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
        assert await bus.keys(BUCKET, "none") == []
    finally:
        await worker_bus.close()
        await bus.close()
