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

    async def consume(
        self,
        stream: str,
        filter_subject: str,
        durable: str,
        on_msg: Callable[[Msg], Awaitable[None]],
    ) -> asyncio.Task[None]:
        """Start a long-poll fetch loop on a durable pull consumer, handing each message to
        `on_msg`; cancelling the returned task stops it (and unsubscribes)."""
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
            try:
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
            finally:
                try:
                    await sub.unsubscribe()
                except Exception:
                    log.debug("unsubscribing %s failed", durable, exc_info=True)

        task = asyncio.create_task(loop(), name=f"fetch-{durable}")
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)
        return task

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        await self.kv[bucket].put(key, value)

    async def get(self, bucket: str, key: str) -> bytes | None:
        try:
            return (await self.kv[bucket].get(key)).value
        except nats.js.errors.KeyNotFoundError:
            return None

    # -- KV compare-and-set, listings, and the ops log (leases, snapshots, replay) ---------------

    async def entry(self, bucket: str, key: str) -> tuple[bytes, int] | None:
        """A key's value and revision (for a compare-and-set), None when absent or deleted."""
        try:
            entry = await self.kv[bucket].get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or b"", int(entry.revision or 0)

    async def swap(self, bucket: str, key: str, value: bytes, revision: int | None) -> bool:
        """Write `key` only if its revision is still `revision` (None: only if absent)."""
        try:
            if revision is None:
                await self.kv[bucket].create(key, value)
            else:
                await self.kv[bucket].update(key, value, last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            return False
        return True

    async def delete(self, bucket: str, key: str) -> None:
        await self.kv[bucket].delete(key)

    async def values(self, bucket: str, prefix: str) -> list[bytes]:
        """Current values of the keys under `prefix.`: one stream-info request lists the keys
        (no consumer is created), then one read each."""
        assert self.js is not None
        subject_prefix = f"$KV.{bucket}."
        info = await self.js.stream_info(
            f"KV_{bucket}", subjects_filter=f"{subject_prefix}{prefix}.>"
        )
        keys = sorted(subject[len(subject_prefix) :] for subject in info.state.subjects or {})
        found = await asyncio.gather(*(self.get(bucket, key) for key in keys))
        return [value for value in found if value]

    async def reset_consumer(self, stream: str, durable: str) -> None:
        """Restart a durable consumer's delivery at its ack floor, in stream order (ADR-60).

        A new owner of a shard calls it before fetching: the previous owner's un-acked ops come
        first, at once, instead of after `ack_wait` and out of order. A consumer that does not
        exist yet has nothing to reset.
        """
        assert self.nc is not None and self.js is not None
        try:
            await self.js.consumer_info(stream, durable)
        except NotFoundError:
            return
        reply = await self.nc.request(
            f"$JS.API.CONSUMER.RESET.{stream}.{durable}", b"", timeout=self.timeout_s
        )
        if b'"error"' in reply.data:
            log.warning("resetting consumer %s failed: %s", durable, reply.data[:200])
