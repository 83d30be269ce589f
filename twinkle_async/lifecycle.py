"""Session lifecycle: a finished session's adapters leave the worker, with their state saved.

A session finishes when its client says so (`POST /sessions/{id}/finish`) or when its
heartbeats stop for `session_timeout_s` (the SDK sends one every 10 s); a sweeper task on every
gateway looks for those. Finishing is a compare-and-set on the session record, so exactly one
gateway does it. Each of the session's loaded models then gets an `unload_model` op as its next
seq: it runs after everything the client sent, saves the adapter and optimizer state as
`tinker://<model_id>/weights/session-end` (replacing an earlier one), and frees the slot.
Later calls on the model answer 410 naming that checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time

from protocol import subjects
from protocol.jobs import UnloadModelJob
from protocol.records import RunRecord
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.registry import Registry
from twinkle_async.seq_claims import SeqTaken, claim_seq

log = logging.getLogger(__name__)

SESSION_END_CHECKPOINT = "session-end"
# The digest of a call the server makes itself: no client body can have it (a body digest is hex).
SERVER_DIGEST = "server"


class Lifecycle:
    """Finishes sessions and unloads their models; owns the expiry sweeper task."""

    def __init__(
        self,
        registry: Registry,
        futures: FutureStore,
        bus: Bus,
        *,
        session_timeout_s: float,
        sweep_interval_s: float,
    ) -> None:
        self.registry = registry
        self.futures = futures
        self.bus = bus
        self.session_timeout_s = session_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self._task: asyncio.Task[None] | None = None
        self._indexing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._sweep_loop(), name="session-sweeper")

    async def _index_older_records(self) -> None:
        """Sessions and runs stored before their indexes existed (open marks, tenant keys):
        indexed once as this gateway starts."""
        try:
            marked = await self.registry.mark_open_sessions()
            runs = await self.registry.index_runs()
        except Exception:  # the sweeper and listings still see everything indexed since
            log.exception("could not index older sessions and runs; some may not be listed")
        else:
            log.debug("%d open sessions marked, %d runs indexed", marked, runs)

    async def stop(self) -> None:
        for task in (self._task, self._indexing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _sweep_loop(self) -> None:
        indexing = asyncio.create_task(self._index_older_records(), name="index-older-records")
        self._indexing = indexing  # held: the loop's first sweeps do not wait for it
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep(time.time())
            except Exception:  # a loop boundary: one failed sweep must not end the sweeper
                log.exception("session sweep failed; retrying in %.0f s", self.sweep_interval_s)

    async def sweep(self, now: float) -> list[str]:
        """Finish every session whose heartbeats stopped; returns their ids. It reads only the
        sessions marked open, so its cost follows the live sessions, not every one ever made."""
        expired = [
            session.session_id
            for session in await self.registry.open_sessions(now, self.session_timeout_s)
            if now - session.last_heartbeat > self.session_timeout_s
        ]
        finished = [sid for sid in expired if await self.finish(sid, "expired")]
        if finished:
            log.info("finished %d sessions whose heartbeats stopped", len(finished))
        return finished

    async def finish(self, session_id: str, reason: str) -> bool:
        """Finish a session once (False if it already was) and unload its models."""
        while True:
            entry = await self.registry.session_entry(session_id)
            if entry is None or entry[0].finished:
                return False
            session, revision = entry
            session.finished = True
            session.finished_at = time.time()
            session.finish_reason = reason
            if await self.registry.swap_session(session, revision):
                break
        for run in await self.registry.runs(session.tenant_id):
            if run.session_id == session_id and run.unloaded_at is None:
                await self.unload(run)
        try:
            await self.registry.close_session_mark(session_id)
        except Exception:  # the next sweep drops the mark of a finished session
            log.exception("session %s: its open mark stays until the next sweep", session_id)
        return True

    async def unload(self, run: RunRecord, save_as: str = SESSION_END_CHECKPOINT) -> str:
        """Queue the model's unload after everything sent so far; returns its request id."""
        while True:
            seq = await self.futures.next_seq(run.model_id)
            try:
                claim, _ = await claim_seq(
                    self.futures,
                    run.model_id,
                    seq,
                    "unload_model",
                    SERVER_DIGEST,
                    named=f"model {run.model_id!r}",
                )
            except SeqTaken:
                # A client call claimed the seq between its reservation and this claim (it saw
                # the reservation as a seq already known): the unload takes the next one.
                continue
            break
        job = UnloadModelJob(
            request_id=claim.request_id,
            model_id=run.model_id,
            tenant_id=run.tenant_id,
            seq_id=seq,
            published_at=time.time(),
            save_as=save_as,
        )
        await self.futures.record_pending(
            claim.request_id, "unload_model", run.model_id, run.tenant_id
        )
        await self.bus.publish_job(subjects.pool_of(run.base_model), job)
        run.unloaded_at = time.time()
        await self.registry.put_run(run)
        log.info("unloading model %s (seq %d) of tenant %s", run.model_id, seq, run.tenant_id)
        return claim.request_id
