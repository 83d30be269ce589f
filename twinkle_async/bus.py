"""The gateway's NATS connection: ensure the topology, publish jobs, read and write KV.

Wraps nats-py once (its `connect()` takes dozens of parameters) so the rest of the gateway sees
a small typed surface. Every call has a timeout. The KV operations (get, put, compare-and-set,
erase, listings) are `natskv.store.KvStore`'s, shared with the workers; this module adds the
connection, the topology, job publishing and the gateway's retry policy they run under.

Riding out a NATS outage: nats-py reconnects by itself (`max_reconnect_attempts=-1`), and core
subscriptions (the KV updates the gateway listens to) are re-sent on reconnect. What fails are
the calls made meanwhile: every KV read or write, stream info, JetStream publish raises
`nats.errors.TimeoutError` after its timeout while the server is away, and a publish larger
than the reconnect buffer (2 MiB) raises `OutboundBufferLimitError` at once (measured with
nats-py 2.16). So each call goes through `_retrying`: while the connection is down it is not
even sent (it would only sit in the reconnect buffer), and on a transient error it is tried
again with `protocol.backoff.BUS_RETRY` until `BusSettings.retry_s` (10 s) has passed; then it
raises `Unavailable`, which answers HTTP 503 with `x-should-retry: true`, and the SDK retries.
Writes are safe to repeat: a job carries `Nats-Msg-Id`, KV puts write the same value again.

On a NATS cluster (`--nats-url` lists its nodes, `BusSettings.nats_replicas` copies of every
stream and bucket) a node's loss moves each stream's leadership to another node, which takes
4-9 s after a crash: meanwhile a publish or KV write raises `NoStreamResponseError` and API
calls time out, both retried like an outage. The client itself moves to a live node (nats-py
reconnects to any server it knows).

A job too big for one message (the server's `max_payload`, 8 MiB with `nats_server`) is
refused before it is sent, as `PayloadTooLarge`: nats-py would raise `MaxPayloadError`, which
no retry cures, after the call's seq was claimed (`encode_job`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, ServiceUnavailableError

from natskv.store import TRANSIENT_ERRORS as TRANSIENT_ERRORS  # what the error middleware retries
from natskv.store import KvStore
from protocol import jobs, subjects, topology
from protocol.backoff import BUS_RETRY
from protocol.errors import PayloadTooLarge, Unavailable
from protocol.jobs import Job, SampleJob
from twinkle_async.settings import BusSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

# Room for the headers a job travels with (`Nats-Msg-Id`, `Tw-Request-Id`: under 300 bytes):
# the server counts them against `max_payload`, nats-py's own check does not.
_HEADER_ROOM_BYTES = 4 * 1024

# JetStream API error codes ensure_topology tells apart.
_STREAM_EXISTS = 10058  # "stream name already in use with a different configuration"
_NO_PEERS = 10005  # "no suitable peers for placement": fewer nodes up than replicas
_NOT_CLUSTERED = 10074  # "replicas > 1 not supported in non-clustered mode"
_SETUP_TIMEOUT_S = 2.0  # one try of a topology request at start-up


class TopologyError(RuntimeError):
    """The topology cannot be made as configured (e.g. replicas on an unclustered server)."""


class Bus(KvStore):
    """One NATS connection with JetStream and the KV buckets (docs/architecture.md, "State").

    Its KV operations are `KvStore`'s, each run under `_retrying`.
    """

    def __init__(self, settings: BusSettings) -> None:
        super().__init__(retry=self._retrying, request_timeout_s=settings.request_timeout_s)
        self.settings = settings
        self._reconnect_hooks: list[Callable[[], Awaitable[None]]] = []
        self._hook_tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._dropped = asyncio.Event()  # set from a disconnect until the reconnect

    async def connect(self) -> None:
        """Connect (waiting up to `connect_wait_s` for NATS) and ensure the topology.

        A cluster that is still forming (no meta leader yet, or not all nodes joined) answers
        with timeouts or "no suitable peers"; both are tried again until `connect_wait_s`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.connect_wait_s
        self.nc = await asyncio.wait_for(
            nats.connect(
                servers=topology.nats_servers(self.settings.nats_url),
                connect_timeout=self.settings.connect_timeout_s,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                ping_interval=topology.PING_INTERVAL_S,
                max_outstanding_pings=topology.MAX_OUTSTANDING_PINGS,
                name="twinkle-gateway",
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
            ),
            timeout=self.settings.connect_wait_s,
        )
        self.js = self.nc.jetstream(timeout=self.settings.request_timeout_s)
        # Short tries: a forming cluster leaves a request unanswered until its timeout.
        setup = self.nc.jetstream(timeout=min(_SETUP_TIMEOUT_S, self.settings.request_timeout_s))
        delay: float | None = None
        while True:
            try:
                await ensure_topology(setup, self.settings)
                for spec in topology.buckets(self.settings.futures_ttl_s):
                    self.kv[spec.name] = await self.js.key_value(spec.name)
                return
            except _SETUP_RETRIED as exc:
                if loop.time() > deadline:
                    if isinstance(exc, _NotYet):
                        raise TopologyError(str(exc)) from exc
                    raise
                delay = BUS_RETRY.after(delay)
                log.info("the bus topology is not ready yet (%s); trying again", exc)
                await asyncio.sleep(delay)

    async def close(self) -> None:
        self._closing = True
        for task in self._hook_tasks:
            task.cancel()
        await asyncio.gather(*self._hook_tasks, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=self.settings.connect_timeout_s)
            except (TimeoutError, nats.errors.Error):
                await self.nc.close()  # NATS is away: nothing left to drain into

    def on_reconnect(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook()` after every reconnect (e.g. to re-read what a subscription missed)."""
        self._reconnect_hooks.append(hook)

    async def _on_error(self, exc: Exception) -> None:
        # every failed reconnect attempt lands here; the disconnect was logged once already
        if isinstance(exc, OSError | nats.errors.StaleConnectionError):
            log.debug("nats: %s", exc)
        else:
            log.warning("nats: %r", exc)

    async def _on_disconnected(self) -> None:
        self._dropped.set()
        if not self._closing:
            log.warning(
                "lost the connection to NATS; reconnecting (calls retry for %.0f s)",
                self.settings.retry_s,
            )

    async def _on_reconnected(self) -> None:
        assert self.nc is not None
        self._dropped.clear()
        log.info(
            "reconnected to NATS at %s",
            self.nc.connected_url.netloc if self.nc.connected_url else "?",
        )
        for hook in self._reconnect_hooks:
            task = asyncio.create_task(self._run_hook(hook), name="bus-reconnect-hook")
            self._hook_tasks.add(task)
            task.add_done_callback(self._hook_tasks.discard)

    async def _run_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        try:
            await hook()
        except Exception:  # a task boundary: a failed hook must not go unnoticed
            log.exception("a reconnect hook failed")

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, tried again while NATS is away, for up to `retry_s`; then `Unavailable`."""
        assert self.nc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.retry_s
        delay: float | None = None
        while True:
            failure = "not connected"
            if self.nc.is_connected:  # else a request would only wait in the reconnect buffer
                try:
                    return await self._attempt(call, max(0.01, deadline - loop.time()))
                except TRANSIENT_ERRORS as exc:
                    failure = type(exc).__name__
                    if self.nc.is_closed:
                        raise Unavailable(f"the bus is closed; {what} failed") from exc
            delay = BUS_RETRY.after(delay)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Unavailable(
                    f"the job bus did not answer ({what}) within"
                    f" {self.settings.retry_s:.0f} s: {failure}"
                )
            log.debug("%s: %s; trying again in %.1f s", what, failure, delay)
            await asyncio.sleep(min(delay, remaining))

    async def _attempt(self, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """One try of `call()`; a `TimeoutError` after `timeout_s`, or at once if the connection
        drops meanwhile: a request in flight then is lost with the socket, and would otherwise
        hold its caller for the whole request timeout."""
        attempt = asyncio.ensure_future(call())
        dropped = asyncio.ensure_future(self._dropped.wait())
        try:
            done, _ = await asyncio.wait(
                {attempt, dropped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            dropped.cancel()
            if not attempt.done():
                attempt.cancel()
        if attempt in done:
            return attempt.result()
        raise TimeoutError("the connection dropped" if dropped in done else "timed out")

    def max_job_bytes(self) -> int:
        """The largest encoded job one publish carries: the server's `max_payload` and the ops
        stream's largest message, whichever is smaller, less room for the headers."""
        assert self.nc is not None
        return min(self.nc.max_payload, topology.StreamSpec.max_msg_bytes) - _HEADER_ROOM_BYTES

    def encode_job(self, job: Job) -> bytes:
        """`job` as it is published; `PayloadTooLarge` (413) when it does not fit one message.

        A sequenced call encodes its job while a refusal can still settle its seq, then hands
        the bytes to `publish_job`.
        """
        return self._fitting(jobs.encode_job(job), "send fewer datums per request")

    def encode_sample_job(self, job: SampleJob) -> bytes:
        """A sample job as it is published, checked as `encode_job` checks a training op: the
        route encodes it before recording the future, which a failed publish left pending."""
        return self._fitting(jobs.encode_sample_job(job), "send a shorter prompt")

    def _fitting(self, data: bytes, advice: str) -> bytes:
        limit = self.max_job_bytes()
        if len(data) > limit:
            raise PayloadTooLarge(
                f"the job is {len(data)} bytes (the request and what the server adds to it,"
                f" e.g. stable_reinforce provenance), over the {limit} bytes one message on the"
                f" job bus carries; {advice}"
            )
        return data

    async def subject_messages(self, stream: str, subject: str) -> list[bytes]:
        """Every message `stream` holds on `subject`, oldest first (an ordered consumer that
        reads them and goes)."""
        js = self.js
        assert js is not None
        info = await js.stream_info(stream, subjects_filter=subject)
        count = (info.state.subjects or {}).get(subject, 0)
        if not count:
            return []
        sub = await js.subscribe(
            subject,
            stream=stream,
            ordered_consumer=True,
            deliver_policy=js_api.DeliverPolicy.ALL,
            inactive_threshold=30.0,
        )
        found: list[bytes] = []
        try:
            while len(found) < count:
                msg = await sub.next_msg(timeout=self.settings.request_timeout_s)
                found.append(msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return found

    async def publish_job(self, pool: str, job: Job, data: bytes | None = None) -> None:
        """Publish a training op to its model's shard; a repeat of `(model_id, seq_id)` is dropped.

        `data`: the job as `encode_job` returned it, when the caller has it already.
        """
        subject = subjects.ops_subject(pool, job.model_id, self.settings.n_shards)
        dedupe_id = subjects.msg_id(job.model_id, job.seq_id)
        payload = self.encode_job(job) if data is None else data
        await self._publish(subject, payload, dedupe_id, job.request_id)

    async def publish_sample(
        self, pool: str, job: SampleJob, dedupe_id: str, data: bytes | None = None
    ) -> None:
        """Publish a sample job for any sampler of the pool; a repeat of `dedupe_id` is dropped.

        `data`: the job as `encode_sample_job` returned it, when the caller has it already.
        """
        payload = self.encode_sample_job(job) if data is None else data
        await self._publish(subjects.sample_subject(pool), payload, dedupe_id, job.request_id)

    async def _publish(self, subject: str, data: bytes, dedupe_id: str, request_id: str) -> None:
        """A JetStream publish with `Nats-Msg-Id`, so a retried publish is stored once."""
        js = self.js
        assert js is not None
        headers = {"Nats-Msg-Id": dedupe_id, "Tw-Request-Id": request_id}
        timeout_s = self.settings.request_timeout_s

        async def attempt() -> None:
            await js.publish(subject, data, headers=headers, timeout=timeout_s)

        await self._retrying(f"publish {request_id}", attempt)

    async def subscribe_kv(
        self, bucket: str, pattern: str, callback: Callable[[str, bytes], Awaitable[None]]
    ) -> Subscription:
        """Live updates of a bucket's keys (no replay of what is already stored).

        A core subscription: nats-py re-sends it after a reconnect, but updates written while
        the connection was down are not delivered; `on_reconnect` is the place to catch up.
        """
        assert self.nc is not None
        prefix = f"$KV.{bucket}."

        async def on_msg(msg: Msg) -> None:
            await callback(msg.subject[len(prefix) :], msg.data)

        return await self.nc.subscribe(f"{prefix}{pattern}", cb=on_msg)


class _NotYet(Exception):
    """A cluster not (yet) able to place a stream: fewer nodes up than its replicas."""


_SETUP_RETRIED: tuple[type[Exception], ...] = (*TRANSIENT_ERRORS, _NotYet)


async def ensure_topology(js: JetStreamContext, settings: BusSettings) -> None:
    """Create the streams and the KV buckets if they do not exist, each with
    `settings.nats_replicas` copies, and scale up those that have fewer (idempotent).

    Raises `TopologyError` for what no retry cures (replicas on an unclustered server), and
    `_NotYet` while the cluster has fewer nodes up than the replicas asked for.
    """
    replicas = topology.check_replicas(settings.nats_replicas)

    def on_file(
        spec: topology.StreamSpec | topology.SampleStreamSpec | topology.MetricsStreamSpec,
        **limits: Any,
    ) -> js_api.StreamConfig:
        """A stream of `spec` stored on disk with the cluster's replicas, and its own limits."""
        return js_api.StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            storage=js_api.StorageType.FILE,
            duplicate_window=spec.duplicate_window_s,
            max_msg_size=spec.max_msg_bytes,
            num_replicas=replicas,
            **limits,
        )

    stream = topology.StreamSpec(
        duplicate_window_s=settings.duplicate_window_s,
        max_age_s=settings.ops_max_age_s,
        max_bytes=settings.ops_max_bytes,
    )
    config = on_file(
        stream,
        retention=js_api.RetentionPolicy.LIMITS,
        max_age=stream.max_age_s,
        max_bytes=stream.max_bytes,
        discard=js_api.DiscardPolicy.OLD,
    )
    sample = topology.SampleStreamSpec()
    sample_config = on_file(
        sample, retention=js_api.RetentionPolicy.WORK_QUEUE, max_age=sample.max_age_s
    )
    history = topology.MetricsStreamSpec()
    metrics_config = on_file(
        history,
        retention=js_api.RetentionPolicy.LIMITS,
        max_age=history.max_age_s,
        max_bytes=history.max_bytes,
        max_msgs_per_subject=history.max_per_run,
        discard=js_api.DiscardPolicy.OLD,
    )
    for stream_config in (config, sample_config, metrics_config):
        try:
            await js.add_stream(stream_config)
        except ServiceUnavailableError:
            raise  # JetStream not ready on this node (a restart, a lost quorum): tried again
        except APIError as exc:
            if exc.err_code != _STREAM_EXISTS:
                raise _topology_error(exc, str(stream_config.name), replicas) from exc
            # exists with another configuration: ours, keeping any higher replica count
            await _update_stream(js, stream_config, replicas)
    for spec in topology.buckets(settings.futures_ttl_s):
        try:
            await js.create_key_value(
                bucket=spec.name, ttl=spec.ttl_s, history=spec.history, replicas=replicas
            )
        except ServiceUnavailableError:
            raise
        except APIError as exc:
            if exc.err_code != _STREAM_EXISTS:
                raise _topology_error(exc, f"bucket {spec.name}", replicas) from exc
            info = await js.stream_info(f"KV_{spec.name}")
            if (info.config.num_replicas or 1) >= replicas:
                log.debug("bucket %s exists with another configuration; keeping it", spec.name)
                continue
            await _update_stream(js, info.config, replicas)


async def _update_stream(js: JetStreamContext, config: js_api.StreamConfig, replicas: int) -> None:
    """Update a stream to `config`, with `replicas` copies unless it has more already."""
    assert config.name is not None
    have = (await js.stream_info(config.name)).config.num_replicas or 1
    try:
        await js.update_stream(config.evolve(num_replicas=max(have, replicas)))
    except ServiceUnavailableError:
        raise
    except APIError as exc:
        raise _topology_error(exc, config.name, replicas) from exc
    if have < replicas:
        log.info("stream %s: scaled from %d replica(s) to %d", config.name, have, replicas)


def _topology_error(exc: APIError, what: str, replicas: int) -> Exception:
    """What a refused stream or bucket means, in words."""
    if exc.err_code == _NOT_CLUSTERED:
        return TopologyError(
            f"{what}: {replicas} replicas asked for (--nats-replicas / TWINKLE_NATS_REPLICAS),"
            " but the NATS server is not clustered; use 1 replica, or a cluster of at least"
            f" {replicas} nodes"
        )
    if exc.err_code == _NO_PEERS:
        return _NotYet(
            f"{what}: fewer NATS cluster nodes up than the {replicas} replicas asked for"
            f" ({exc.description}); start more nodes or lower --nats-replicas"
        )
    return TopologyError(f"{what}: NATS refused it: {exc.description} (code {exc.err_code})")
