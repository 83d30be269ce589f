"""The worker's NATS connection: shard consumers in, outcomes and records out.

The gateway creates the topology (protocol/topology.py); a worker waits for it, so the two never
race to configure it differently. Each owned shard is read by its durable pull consumer
`ops-<pool>-<shard>` through a long-poll fetch loop that hands messages to a callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from protocol import subjects, topology

log = logging.getLogger(__name__)


class WorkerBus:
    """A worker's connection, KV handles and shard fetch loops."""

    def __init__(
        self, nats_url: str, *, ack_wait_s: float = 120.0, timeout_s: float = 10.0
    ) -> None:
        self.nats_url = nats_url
        self.ack_wait_s = ack_wait_s
        self.timeout_s = timeout_s
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.kv: dict[str, KeyValue] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self, wait_topology_s: float = 60.0) -> None:
        self.nc = await nats.connect(
            self.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, name="twinkle-worker"
        )
        self.js = self.nc.jetstream(timeout=self.timeout_s)
        deadline = asyncio.get_running_loop().time() + wait_topology_s
        names = [spec.name for spec in topology.buckets(0.0)]
        while True:
            try:
                await self.js.stream_info(subjects.STREAM_OPS)
                await self.js.stream_info(subjects.STREAM_SAMPLE)
                for name in names:
                    self.kv[name] = await self.js.key_value(name)
                return
            except (NotFoundError, BucketNotFoundError):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(
                        f"the gateway did not create the bus topology within {wait_topology_s} s"
                    ) from None
                log.info("waiting for the gateway to create the bus topology")
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.nc is not None and not self.nc.is_closed:
            # close, not drain: every op is acked explicitly, and an un-acked one must be
            # redelivered to the next worker rather than waited for here
            await self.nc.close()

    async def consume_shard(
        self, pool: str, shard: int, on_msg: Callable[[Msg], Awaitable[None]]
    ) -> None:
        """Start the fetch loop of one shard's durable consumer."""
        await self.consume(
            subjects.STREAM_OPS,
            subjects.shard_filter(pool, shard),
            subjects.consumer_name(pool, shard),
            on_msg,
        )

    async def consume(
        self,
        stream: str,
        filter_subject: str,
        durable: str,
        on_msg: Callable[[Msg], Awaitable[None]],
    ) -> None:
        """Start a long-poll fetch loop on a durable pull consumer, handing each message to `on_msg`."""
        assert self.js is not None
        config = js_api.ConsumerConfig(
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_ack_pending=20000,
            deliver_policy=js_api.DeliverPolicy.ALL,
        )
        sub = await self.js.pull_subscribe(
            filter_subject, durable=durable, stream=stream, config=config
        )

        async def loop() -> None:
            while True:
                try:
                    msgs = await sub.fetch(batch=256, timeout=5.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue  # nothing arrived within the long-poll window
                except (nats.errors.ConnectionClosedError, asyncio.CancelledError):
                    raise
                except Exception:
                    log.exception("fetch from %s failed; retrying", durable)
                    await asyncio.sleep(1.0)
                    continue
                for msg in msgs:
                    await on_msg(msg)

        self._tasks.append(asyncio.create_task(loop(), name=f"fetch-{durable}"))

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        await self.kv[bucket].put(key, value)

    async def get(self, bucket: str, key: str) -> bytes | None:
        try:
            return (await self.kv[bucket].get(key)).value
        except nats.js.errors.KeyNotFoundError:
            return None
