"""The gateway's NATS connection: ensure the topology, publish jobs, read and write KV.

Wraps nats-py once (its `connect()` takes dozens of parameters) so the rest of the gateway sees
a small typed surface. Every call has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from protocol import subjects, topology
from protocol.errors import Unavailable
from protocol.jobs import Job, SampleJob, encode_job, encode_sample_job
from twinkle_async.settings import BusSettings

log = logging.getLogger(__name__)


class Bus:
    """One NATS connection with JetStream and the KV buckets of DESIGN.md §4."""

    def __init__(self, settings: BusSettings) -> None:
        self.settings = settings
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.kv: dict[str, KeyValue] = {}

    async def connect(self) -> None:
        self.nc = await nats.connect(
            self.settings.nats_url,
            connect_timeout=self.settings.connect_timeout_s,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            name="twinkle-gateway",
        )
        self.js = self.nc.jetstream(timeout=self.settings.request_timeout_s)
        await ensure_topology(self.js, self.settings)
        for spec in topology.buckets(self.settings.futures_ttl_s):
            self.kv[spec.name] = await self.js.key_value(spec.name)

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()

    def bucket(self, name: str) -> KeyValue:
        return self.kv[name]

    async def publish_job(self, pool: str, job: Job) -> None:
        """Publish a training op to its model's shard; a repeat of `(model_id, seq_id)` is dropped."""
        subject = subjects.ops_subject(pool, job.model_id, self.settings.n_shards)
        dedupe_id = subjects.msg_id(job.model_id, job.seq_id)
        await self._publish(subject, encode_job(job), dedupe_id, job.request_id)

    async def publish_sample(self, pool: str, job: SampleJob, dedupe_id: str) -> None:
        """Publish a sample job for any sampler of the pool; a repeat of `dedupe_id` is dropped."""
        await self._publish(
            subjects.sample_subject(pool), encode_sample_job(job), dedupe_id, job.request_id
        )

    async def _publish(self, subject: str, data: bytes, dedupe_id: str, request_id: str) -> None:
        """A JetStream publish with `Nats-Msg-Id`; a bus that does not answer is `Unavailable`."""
        assert self.js is not None
        try:
            await self.js.publish(
                subject,
                data,
                headers={"Nats-Msg-Id": dedupe_id, "Tw-Request-Id": request_id},
                timeout=self.settings.request_timeout_s,
            )
        except (
            nats.errors.TimeoutError,
            nats.errors.ConnectionClosedError,
            nats.errors.NoRespondersError,
        ) as exc:
            raise Unavailable(
                f"the job bus did not accept {request_id}: {type(exc).__name__}"
            ) from exc

    async def get(self, bucket: str, key: str) -> bytes | None:
        try:
            entry = await self.kv[bucket].get(key)
        except KeyNotFoundError:
            return None
        return entry.value

    async def entry(self, bucket: str, key: str) -> tuple[bytes, int] | None:
        """A key's value and revision (for a compare-and-set), None when absent."""
        try:
            entry = await self.kv[bucket].get(key)
        except KeyNotFoundError:
            return None
        return entry.value or b"", int(entry.revision or 0)

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        await self.kv[bucket].put(key, value)

    async def create(self, bucket: str, key: str, value: bytes) -> bool:
        """Write `key` only if absent; False when it already exists."""
        try:
            await self.kv[bucket].create(key, value)
        except (KeyWrongLastSequenceError, BadRequestError):
            return False
        return True

    async def swap(self, bucket: str, key: str, value: bytes, revision: int | None) -> bool:
        """Write `key` only if its revision is still `revision` (None: only if absent)."""
        if revision is None:
            return await self.create(bucket, key, value)
        try:
            await self.kv[bucket].update(key, value, last=revision)
        except (KeyWrongLastSequenceError, BadRequestError):
            return False
        return True

    async def delete(self, bucket: str, key: str) -> None:
        await self.kv[bucket].delete(key)

    async def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Keys under `prefix.` (deleted ones included: a read of one answers None).

        One stream-info request with a subject filter: no consumer is created, so a burst of
        listings leaves nothing behind on the server (a KV watcher would leave a consumer each).
        """
        assert self.js is not None
        subject_prefix = f"$KV.{bucket}."
        pattern = f"{subject_prefix}{prefix}.>" if prefix else f"{subject_prefix}>"
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=pattern)
        subjects_found = info.state.subjects or {}
        return sorted(subject[len(subject_prefix) :] for subject in subjects_found)

    async def values(self, bucket: str, prefix: str = "") -> list[bytes]:
        """Current values of the keys under `prefix.`, in key order (direct reads, no consumer)."""
        found = await asyncio.gather(
            *(self.get(bucket, key) for key in await self.keys(bucket, prefix))
        )
        return [value for value in found if value]

    async def subscribe_kv(
        self, bucket: str, pattern: str, callback: Callable[[str, bytes], Awaitable[None]]
    ) -> Subscription:
        """Live updates of a bucket's keys (no replay of what is already stored)."""
        assert self.nc is not None
        prefix = f"$KV.{bucket}."

        async def on_msg(msg: Msg) -> None:
            await callback(msg.subject[len(prefix) :], msg.data)

        return await self.nc.subscribe(f"{prefix}{pattern}", cb=on_msg)


async def ensure_topology(js: JetStreamContext, settings: BusSettings) -> None:
    """Create the ops stream and the KV buckets if they do not exist (idempotent)."""
    stream = topology.StreamSpec(
        duplicate_window_s=settings.duplicate_window_s,
        max_age_s=settings.ops_max_age_s,
        max_bytes=settings.ops_max_bytes,
    )
    config = js_api.StreamConfig(
        name=stream.name,
        subjects=list(stream.subjects),
        retention=js_api.RetentionPolicy.LIMITS,
        storage=js_api.StorageType.FILE,
        max_age=stream.max_age_s,
        max_bytes=stream.max_bytes,
        discard=js_api.DiscardPolicy.OLD,
        duplicate_window=stream.duplicate_window_s,
        max_msg_size=stream.max_msg_bytes,
    )
    sample = topology.SampleStreamSpec()
    sample_config = js_api.StreamConfig(
        name=sample.name,
        subjects=list(sample.subjects),
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.FILE,
        max_age=sample.max_age_s,
        duplicate_window=sample.duplicate_window_s,
        max_msg_size=sample.max_msg_bytes,
    )
    for stream_config in (config, sample_config):
        try:
            await js.add_stream(stream_config)
        except BadRequestError:
            await js.update_stream(stream_config)
    for spec in topology.buckets(settings.futures_ttl_s):
        try:
            await js.create_key_value(bucket=spec.name, ttl=spec.ttl_s, history=spec.history)
        except BadRequestError:
            log.debug("bucket %s exists with another configuration; keeping it", spec.name)
