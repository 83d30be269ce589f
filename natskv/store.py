"""KV reads, writes, compare-and-sets and listings over one NATS connection, and the errors a
call is tried again for.

`KvStore` is the base of both NATS wrappers (`twinkle_async.bus.Bus`, `workers.bus.WorkerBus`):
each connects, fills in `nc`, `js` and one `KeyValue` handle per bucket (`kv`), and passes its
retry policy, a `Retry`, which every operation here goes through. An operation hands the policy
one attempt; the policy decides whether, when and for how long to try it again (it retries only
`TRANSIENT_ERRORS`). So every operation here is safe to repeat: a put writes the same value
again; a compare-and-set whose first landing went unanswered answers "not written" the second
time, and its caller reads the key back.

Listings (`keys`, `values`) are stream-info requests on the bucket's stream
(`protocol.topology.kv_keys`), never nats-py's KV watcher: its initial replay can end before
the entries already on the wire are read (nats-io/nats.py#842), so a bucket with keys could
list none (`tests/test_static.py` keeps it out of the code).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from protocol import topology

T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")

# What a call raises while NATS is away or coming back; worth another attempt (nats-py 2.16: a
# timeout for every request while disconnected; OutboundBufferLimitError for a publish bigger
# than the reconnect buffer; NoResponders / ServiceUnavailable while the server's JetStream
# starts; NoStreamResponse while a stream or bucket of a cluster elects its leader, 4-9 s after
# a node's crash). Builtin `TimeoutError` is asyncio's; nats' own derives from it.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    ServiceUnavailableError,
    NoStreamResponseError,
)


async def both(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Two bus calls at once (one round trip, not two), each run to the end; then the first
    one's failure, if any."""
    one, two = await asyncio.gather(first, second, return_exceptions=True)
    if isinstance(one, BaseException):
        raise one
    if isinstance(two, BaseException):
        raise two
    return one, two


class Retry(Protocol):
    """A process's retry policy: `call()` under the name `what` (for logs and errors), tried
    again on `TRANSIENT_ERRORS` until the policy gives up (with `protocol.errors.Unavailable`)."""

    def __call__(self, what: str, call: Callable[[], Awaitable[T]]) -> Awaitable[T]: ...


class KvStore:
    """The KV operations on the buckets of one connection, each through `retry`.

    `nc`, `js` and `kv` are None / empty until the subclass has connected; `request_timeout_s`
    bounds one listing request (a KV handle's calls have the JetStream context's timeout).
    """

    def __init__(self, retry: Retry, request_timeout_s: float) -> None:
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.kv: dict[str, KeyValue] = {}
        self._retry = retry
        self._request_timeout_s = request_timeout_s

    async def get(self, bucket: str, key: str) -> bytes | None:
        """A key's value, None when absent or deleted."""
        kv = self.kv[bucket]

        async def attempt() -> bytes | None:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                return None
            return entry.value

        return await self._retry(f"read {bucket}/{key}", attempt)

    async def entry(self, bucket: str, key: str) -> tuple[bytes, int] | None:
        """A key's value and revision (for a compare-and-set), None when absent or deleted."""
        kv = self.kv[bucket]

        async def attempt() -> tuple[bytes, int] | None:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                return None
            return entry.value or b"", int(entry.revision or 0)

        return await self._retry(f"read {bucket}/{key}", attempt)

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        kv = self.kv[bucket]

        async def attempt() -> None:
            await kv.put(key, value)

        await self._retry(f"write {bucket}/{key}", attempt)

    async def create(self, bucket: str, key: str, value: bytes) -> bool:
        """Write `key` only if absent; False when it already exists.

        A retried create whose first attempt did land (its answer was lost) answers False too:
        callers read the key back (`FutureStore.claim`) rather than trust the write was theirs.
        """
        return await self.swap(bucket, key, value, None)

    async def swap(self, bucket: str, key: str, value: bytes, revision: int | None) -> bool:
        """Write `key` only if its revision is still `revision` (None: only if absent)."""
        return await self.swap_revision(bucket, key, value, revision) is not None

    async def swap_revision(
        self, bucket: str, key: str, value: bytes, revision: int | None
    ) -> int | None:
        """`swap`, answering the key's new revision, or None when it was not written.

        A caller that keeps the revision can compare-and-set the key again without reading it.
        """
        kv = self.kv[bucket]

        async def attempt() -> int | None:
            try:
                if revision is None:
                    return int(await kv.create(key, value))
                return int(await kv.update(key, value, last=revision))
            except (KeyWrongLastSequenceError, BadRequestError):
                return None

        what = "create" if revision is None else "update"
        return await self._retry(f"{what} {bucket}/{key}", attempt)

    async def delete(self, bucket: str, key: str) -> None:
        """Delete a key, leaving a delete marker: it stays listed by `keys` (a read of it
        answers None) until the bucket's history drops it; `erase` leaves nothing."""
        kv = self.kv[bucket]

        async def attempt() -> None:
            await kv.delete(key)

        await self._retry(f"delete {bucket}/{key}", attempt)

    async def erase(self, bucket: str, key: str) -> None:
        """Remove a key with no delete marker left behind: a purge of its subject in the
        bucket's stream, so it leaves `keys` too. `key` may hold subject wildcards (`*`)."""
        js = self.js
        assert js is not None

        async def attempt() -> None:
            await js.purge_stream(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")

        await self._retry(f"erase {bucket}/{key}", attempt)

    async def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Keys under `prefix.` (all keys for ""), sorted, deleted ones included (a read of one
        answers None); see `topology.kv_keys`."""
        nc = self.nc
        assert nc is not None
        timeout_s = self._request_timeout_s

        async def request(subject: str, body: bytes) -> bytes:
            return (await nc.request(subject, body, timeout=timeout_s)).data

        return await self._retry(
            f"list {bucket}", lambda: topology.kv_keys(request, bucket, prefix)
        )

    async def values(self, bucket: str, prefix: str = "") -> list[bytes]:
        """Current values of the keys under `prefix.`, in key order: the keys, then one direct
        read each (no consumer); deleted keys and empty values are left out."""
        found = await asyncio.gather(
            *(self.get(bucket, key) for key in await self.keys(bucket, prefix))
        )
        return [value for value in found if value]
