"""The shard fetch loop against a real nats-server: an op that reaches an idle shard is handed
on at once, even when a stray status (the `408 Request Timeout` of a pull request that expired
as the client gave up on it) lands in the loop's inbox first. A fetch of many messages that
took such a status for the end of its own pull waited for the rest of the batch until its long
poll expired, holding a lone tenant's op up to 5 s."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from nats.aio.msg import Msg

from protocol import subjects
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings
from workers.bus import WorkerBus

POOL = "fetchpool"


def _inbox_of(worker_bus: WorkerBus) -> str:
    """The deliver inbox of the worker's one pull subscription (nats-py keeps its
    subscriptions in `_subs`)."""
    assert worker_bus.nc is not None
    inboxes = [
        s.subject
        for s in worker_bus.nc._subs.values()
        if s.subject.startswith("_INBOX.") and not s.subject.endswith(".*")  # not the replies'
    ]
    assert len(inboxes) == 1, inboxes
    return inboxes[0]


@pytest.mark.timeout(60)
async def test_an_op_on_an_idle_shard_is_not_held_by_a_stray_status(
    nats_server: NatsServer,
) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()  # creates the topology
    worker_bus = WorkerBus(nats_server.url)
    await worker_bus.connect()
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        await arrived.put(time.monotonic())
        await msg.ack()

    stream, durable = subjects.STREAM_OPS, subjects.consumer_name(POOL, 0)
    task = await worker_bus.consume(stream, subjects.shard_filter(POOL, 0), durable, on_msg)
    try:
        assert worker_bus.nc is not None and bus.js is not None
        inbox = _inbox_of(worker_bus)
        for _ in range(3):
            await asyncio.sleep(0.5)  # the loop waits in its long poll on the idle shard
            # a short pull request on the loop's inbox: its expiry sends a real 408 there
            await worker_bus.nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
                json.dumps({"batch": 1, "expires": 50_000_000}).encode(),
                reply=inbox,
            )
            await asyncio.sleep(0.3)  # the 408 is in
            sent = time.monotonic()
            await bus.js.publish(f"{subjects.OPS_PREFIX}.{POOL}.0.m", b"op")
            got = await asyncio.wait_for(arrived.get(), timeout=10.0)
            assert got - sent < 1.0, f"an op on an idle shard waited {got - sent:.2f} s"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker_bus.close()
        await bus.close()
