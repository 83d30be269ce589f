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
from dataclasses import dataclass

import msgspec

from protocol import subjects
from protocol.errors import ServerError
from protocol.jobs import Outcome, SampleJob, decode_outcome, encode_outcome
from workers.bus import WorkerBus

_MAX_TRIES = 8  # compare-and-set rounds of one write against other writers


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


@dataclass(frozen=True)
class Pending:
    """A job's pending future as last read or written: the next compare-and-set starts from
    it without reading the key again."""

    outcome: Outcome
    revision: int | None  # None: no such key (an expired future); a write creates it


async def read_pending(bus: WorkerBus, job: SampleJob) -> Pending | None:
    """The job's future while it is pending; None once it is settled (cancelled, answered)."""
    entry = await bus.entry(subjects.BUCKET_FUTURES, subjects.future_key(job.request_id))
    if entry is None:
        return Pending(pending_of(job), None)
    outcome = decode_outcome(entry[0])
    return Pending(outcome, entry[1]) if outcome.state == "pending" else None


async def begin(bus: WorkerBus, job: SampleJob, seen: Pending) -> Pending | None:
    """Count one more start of `job` on its pending future: the future as written, or None
    when it is settled and the request must not run."""
    key = subjects.future_key(job.request_id)
    current: Pending | None = seen
    for _ in range(_MAX_TRIES):
        if current is None:
            return None
        counted = msgspec.structs.replace(current.outcome, attempts=current.outcome.attempts + 1)
        encoded = encode_outcome(counted)
        revision = await bus.swap_revision(subjects.BUCKET_FUTURES, key, encoded, current.revision)
        if revision is not None:
            return Pending(counted, revision)
        current = await read_pending(bus, job)
    raise ServerError(f"could not record the start of sample {job.request_id}; retry")


async def write_answer(
    bus: WorkerBus, job: SampleJob, encoded: bytes, seen: Pending | None
) -> bool:
    """Write an answer over the job's pending future only (compare-and-set, as the gateway's
    cancel is); False when the future was settled first."""
    key = subjects.future_key(job.request_id)
    current = seen if seen is not None else await read_pending(bus, job)
    for _ in range(_MAX_TRIES):
        if current is None:
            return False
        if await bus.swap(subjects.BUCKET_FUTURES, key, encoded, current.revision):
            return True
        current = await read_pending(bus, job)
    raise ServerError(f"could not write the answer of sample {job.request_id}; retry")


def too_many_attempts(request_id: str, attempts: int) -> ServerError:
    return ServerError(
        f"sample request {request_id} was being sampled each of the {attempts} times a sampler"
        " stopped before answering it (a crash, a request its sampler cannot survive, or one"
        " sampling past the sampler's time limit, --sample-timeout-s); it was not run again"
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
