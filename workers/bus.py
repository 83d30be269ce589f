"""The worker's NATS connection: shard consumers in, outcomes and records out.

The gateway creates the topology (protocol/topology.py); a worker waits for it, so the two never
race to configure it differently. `nats_url` may list a cluster's nodes (comma-separated); the
durable consumers a worker creates have as many replicas as their stream. Each owned shard is read by its durable pull consumer
`ops-<pool>-<shard>` through a long-poll fetch loop that hands messages to a callback.

The KV operations (get, put, compare-and-set, delete, listings) are `natskv.store.KvStore`'s,
shared with the gateway, run under this module's retry policy.

A NATS outage: nats-py reconnects by itself and the durable consumers live on the server, so a
fetch loop only has to keep fetching (a fetch while NATS is away raises a timeout). A KV read,
write or listing goes through `retrying`: tried again with `protocol.backoff.BUS_RETRY` until
`WORKER_RETRY_S` (5 minutes) has passed, because a worker must not lose an outcome it computed;
only then does it raise `Unavailable`, the worker exits non-zero, and its supervisor restarts it.
A fetch loop that dies for any other reason ends the process the same way (`SystemExit`), so a
shard is never left unread by a process that still looks alive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from natskv.store import TRANSIENT_ERRORS, KvStore
from protocol import subjects, topology
from protocol.backoff import BUS_RETRY
from protocol.errors import Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

WORKER_RETRY_S = 300.0  # how long a worker's bus call keeps trying while NATS is away
_VALUE_HEADROOM_BYTES = 16 * 1024  # a KV subject and headers, well inside this
FETCH_POLL_S = 5.0  # the long poll of an idle shard's fetch
BACKLOG_POLL_S = 1.0  # a backlog's fetch: the ops are there already
FETCH_BATCH_MAX = 256  # ops one fetch takes off a backlog


async def retrying(
    nc: Client,
    what: str,
    call: Callable[[], Awaitable[T]],
    retry_s: float,
    dropped: asyncio.Event | None = None,
) -> T:
    """`call()`, tried again while NATS is away, for up to `retry_s`; then `Unavailable`.

    While the connection is down nothing is sent (a request would only wait in the reconnect
    buffer). Only for idempotent calls: a KV put of the same value, a publish with a msg id.
    `dropped` (set while the connection is down): an attempt in flight when the connection
    drops is given up at once, not after its whole timeout (its reply went with the socket: a
    node stopped or killed), and tried again once reconnected.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_s
    delay: float | None = None
    warned = False
    while True:
        failure = "not connected"
        if nc.is_connected:
            try:
                return await _unless_dropped(call, dropped)
            except TRANSIENT_ERRORS as exc:
                failure = type(exc).__name__
                if nc.is_closed:
                    raise Unavailable(f"the bus is closed; {what} failed") from exc
        delay = BUS_RETRY.after(delay)
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.error("giving up on %s after %.0f s: %s", what, retry_s, failure)
            raise Unavailable(f"the bus did not answer ({what}) within {retry_s:.0f} s: {failure}")
        if not warned:
            log.warning("%s: %s; trying again for up to %.0f s", what, failure, remaining)
            warned = True
        await asyncio.sleep(min(delay, remaining))


async def _unless_dropped(call: Callable[[], Awaitable[T]], dropped: asyncio.Event | None) -> T:
    """`call()`, or a `TimeoutError` as soon as `dropped` is set."""
    if dropped is None:
        return await call()
    attempt = asyncio.ensure_future(call())
    lost = asyncio.ensure_future(dropped.wait())
    try:
        done, _ = await asyncio.wait({attempt, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        if not attempt.done():
            attempt.cancel()
    if attempt in done:
        return attempt.result()
    raise TimeoutError("the connection dropped")


class WorkerBus(KvStore):
    """A worker's connection, KV handles and shard fetch loops; its KV operations are
    `KvStore`'s, each run under `retried`."""

    def __init__(
        self, nats_url: str, *, ack_wait_s: float = 120.0, timeout_s: float = 10.0
    ) -> None:
        super().__init__(retry=self.retried, request_timeout_s=timeout_s)
        self.nats_url = nats_url
        self.ack_wait_s = ack_wait_s
        self.timeout_s = timeout_s
        self._tasks: list[asyncio.Task[None]] = []
        self._dropped = asyncio.Event()  # set while the connection is down

    async def connect(
        self, wait_topology_s: float = 60.0, *, retry_s: float = WORKER_RETRY_S
    ) -> None:
        """Connect and wait for the gateway's topology; waits up to `retry_s` for NATS itself.

        `retry_s` is also how long a KV operation keeps trying while NATS is away.
        """
        self.retry_s = retry_s

        async def on_error(exc: Exception) -> None:
            # every failed reconnect attempt lands here; the disconnect was logged once already
            if isinstance(exc, OSError | nats.errors.StaleConnectionError):
                log.debug("nats: %s", exc)
            else:
                log.warning("nats: %r", exc)

        async def on_disconnected() -> None:
            self._dropped.set()
            if self.nc is not None and not self.nc.is_closed:
                log.warning("lost the connection to NATS; reconnecting")

        async def on_reconnected() -> None:
            self._dropped.clear()
            log.info("reconnected to NATS")

        self.nc = await asyncio.wait_for(
            nats.connect(
                servers=topology.nats_servers(self.nats_url),
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                ping_interval=topology.PING_INTERVAL_S,
                max_outstanding_pings=topology.MAX_OUTSTANDING_PINGS,
                name="twinkle-worker",
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            ),
            timeout=retry_s,
        )
        self.js = self.nc.jetstream(timeout=self.timeout_s)
        deadline = asyncio.get_running_loop().time() + wait_topology_s
        names = [spec.name for spec in topology.buckets(0.0)]
        # not there yet (BucketNotFound is a NotFound), or NATS blinked meanwhile
        not_yet: tuple[type[Exception], ...] = (NotFoundError, *TRANSIENT_ERRORS)
        while True:
            try:
                await self.js.stream_info(subjects.STREAM_OPS)
                await self.js.stream_info(subjects.STREAM_SAMPLE)
                await self.js.stream_info(subjects.STREAM_METRICS)
                for name in names:
                    self.kv[name] = await self.js.key_value(name)
                return
            except not_yet as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(
                        f"the bus topology was not there within {wait_topology_s} s"
                    ) from exc
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
        js = self.js

        async def subscribe() -> JetStreamContext.PullSubscription:
            return await js.pull_subscribe(
                filter_subject, durable=durable, stream=stream, config=config
            )

        # retried: a stream just scaled up answers "insufficient resources" (503) until its new
        # replicas caught up, and an election answers nothing
        sub = await self.retried(f"consumer {durable}", subscribe)
        await self.retried(f"ack wait of {durable}", lambda: self._set_ack_wait(stream, durable))

        async def loop() -> None:
            # One message at a time while the shard is idle, the backlog's size when ops queue:
            # a fetch of many that meets a stray status (the late 408 of an expired pull) waits
            # for the rest of its batch until the long poll ends, which held a lone op up to 5 s
            batch = 1
            try:
                while True:
                    try:
                        msgs = await sub.fetch(
                            batch=batch, timeout=FETCH_POLL_S if batch == 1 else BACKLOG_POLL_S
                        )
                    except TRANSIENT_ERRORS as exc:
                        # nothing arrived within the long-poll window, or NATS is away: the
                        # client reconnects by itself and the durable consumer waits on the
                        # server
                        assert self.nc is not None
                        if self.nc.is_closed:  # `close` cancels this loop first: not ours
                            raise SystemExit(f"the NATS connection of {durable} closed") from exc
                        if not self.nc.is_connected:
                            await asyncio.sleep(0.5)  # no pull requests piling up meanwhile
                        continue
                    except Exception:
                        log.exception("fetch from %s failed; retrying", durable)
                        await asyncio.sleep(1.0)
                        continue
                    batch = min(FETCH_BATCH_MAX, msgs[-1].metadata.num_pending) or 1
                    try:
                        for msg in msgs:
                            await on_msg(msg)
                    except Exception as exc:
                        # the message's state is unknown (its outcome unwritten or its ack
                        # unsent): exit, and let the supervisor start a worker that reads the
                        # shard afresh
                        log.critical(
                            "handling a message of %s failed; exiting", durable, exc_info=True
                        )
                        raise SystemExit(f"the fetch loop of {durable} failed: {exc!r}") from exc
            finally:
                try:
                    await sub.unsubscribe()
                except Exception:
                    log.debug("unsubscribing %s failed", durable, exc_info=True)

        task = asyncio.create_task(loop(), name=f"fetch-{durable}")
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)
        return task

    async def _set_ack_wait(self, stream: str, durable: str) -> None:
        """A durable consumer keeps the settings it was created with: a worker started with
        another `ack_wait` updates it (the pool's consumer is shared, so the last worker
        started sets it)."""
        assert self.js is not None
        info = await self.js.consumer_info(stream, durable)
        if info.config.ack_wait == self.ack_wait_s:
            return
        log.info(
            "consumer %s: ack_wait %s s -> %s s", durable, info.config.ack_wait, self.ack_wait_s
        )
        await self.js.add_consumer(stream, info.config.evolve(ack_wait=self.ack_wait_s))

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    async def publish_once(self, subject: str, data: bytes, msg_id: str) -> None:
        """A JetStream publish with `Nats-Msg-Id`: stored once however often it is sent."""
        js = self.js
        assert js is not None
        headers = {"Nats-Msg-Id": msg_id}

        async def attempt() -> None:
            await js.publish(subject, data, headers=headers, timeout=self.timeout_s)

        await self.retried(f"publish to {subject}", attempt)

    def max_value_bytes(self) -> int:
        """The largest value one KV write carries: the server's `max_payload`, less room for
        the subject and headers that travel with it."""
        assert self.nc is not None
        return self.nc.max_payload - _VALUE_HEADROOM_BYTES

    async def retried(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()` tried again while NATS is away (`retrying`), as every KV operation is."""
        assert self.nc is not None
        return await retrying(self.nc, what, call, self.retry_s, self._dropped)

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
