"""What keeps one sample request from taking its sampler down again and again.

A sample job is acked only once its answer is written, so a sampler that dies while sampling
(out of memory, a crash in the engine) leaves the job to be handed out again. A request that
kills every sampler it reaches would do so forever, and every other tenant's samples with it.

The count lives in the request's own pending future (`Outcome.attempts` in `tw_futures`), so
any sampler of the pool reads it when it takes the job, whichever one began it before:
- before a request goes to the engine, its sampler raises the count by one (a compare-and-set
  on the pending outcome: a cancel or an answer that landed first wins, and the request is
  dropped); the answer replaces the pending outcome, count and all;
- a request taken with a count above zero was begun by a sampler that never answered it: it
  runs alone (`Gate.alone`), so it cannot take other requests down with it;
- one begun `max_attempts` times is not run again: it fails with a `server` error that says so.
A sampler that is merely slow keeps its jobs (`in_progress`), so the count moves only when a
sampler stopped, or lost NATS for longer than `ack_wait`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec

from protocol import subjects
from protocol.errors import ServerError
from protocol.jobs import Outcome, SampleJob, decode_outcome, encode_outcome
from workers.bus import WorkerBus

_MAX_TRIES = 8  # compare-and-set rounds of one `begin` against other writers


def pending_of(job: SampleJob) -> Outcome:
    """The pending outcome the gateway writes for `job` (for a future that is gone from KV)."""
    return Outcome(
        request_id=job.request_id,
        state="pending",
        request_type="sample",
        tenant_id=job.tenant_id,
        sampling_session_id=job.sampling_session_id,
        clone_id=job.clone_id,
    )


async def begin(bus: WorkerBus, job: SampleJob) -> int | None:
    """Count one more start of `job` on its pending future: the new count, or None when the
    future is settled (cancelled, or answered) and the request must not run."""
    key = subjects.future_key(job.request_id)
    for _ in range(_MAX_TRIES):
        entry = await bus.entry(subjects.BUCKET_FUTURES, key)
        current = decode_outcome(entry[0]) if entry is not None else pending_of(job)
        if current.state != "pending":
            return None
        attempts = current.attempts + 1
        counted = msgspec.structs.replace(current, attempts=attempts)
        revision = None if entry is None else entry[1]
        if await bus.swap(subjects.BUCKET_FUTURES, key, encode_outcome(counted), revision):
            return attempts
    raise ServerError(f"could not record the start of sample {job.request_id}; retry")


def too_many_attempts(request_id: str, attempts: int) -> ServerError:
    return ServerError(
        f"sample request {request_id} was being sampled each of the {attempts} times a sampler"
        " stopped before answering it (a crash, or a request its sampler cannot survive); it"
        " was not run again"
    )


class Gate:
    """Requests share the engine, except one that must run alone: it waits for those inside
    to finish, and holds back those that come after it until it is done."""

    def __init__(self) -> None:
        self._inside = 0
        self._alone = False
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._alone)
            self._inside += 1
        try:
            yield
        finally:
            async with self._changed:
                self._inside -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._alone)
            self._alone = True
            try:
                await self._changed.wait_for(lambda: self._inside == 0)
            except BaseException:  # cancelled while waiting: the others go on
                self._alone = False
                self._changed.notify_all()
                raise
        try:
            yield
        finally:
            async with self._changed:
                self._alone = False
                self._changed.notify_all()
