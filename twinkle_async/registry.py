"""Sessions, training runs, checkpoints and served base models, kept in KV.

Ownership lives here: every lookup takes the caller's tenant and answers NotFound for another
tenant's id, exactly as for an id that does not exist.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.subscription import Subscription

from protocol import records, rules, subjects
from protocol.custom_loss import CustomLossRecord
from protocol.errors import Gone, NotFound, Unavailable, UserError
from protocol.records import (
    CheckpointRecord,
    RunRecord,
    SamplerRecord,
    SessionRecord,
    TenantRecord,
    WorkerRecord,
)
from twinkle_async.bus import Bus

log = logging.getLogger(__name__)

WORKER_STALE_S = 30.0
_MAX_SWAPS = 16  # compare-and-set attempts before a contended record answers "retry"
RUN_CACHE_S = 1.0  # how long `Registry.run` uses a run record again without reading it
_MAX_CACHED_RUNS = 10_000


# Up to this many runs, a tenant's checkpoints are listed run by run (one listing each).
_RUN_BY_RUN = 16


class Registry:
    """Typed reads and writes of `tw_sessions`, `tw_runs`, `tw_checkpoints`, `tw_workers`."""

    def __init__(self, bus: Bus, configured_models: tuple[str, ...] = ()) -> None:
        self.bus = bus
        self.configured_models = configured_models
        self.workers: dict[str, WorkerRecord] = {}
        self._runs: dict[str, tuple[float, RunRecord]] = {}  # model_id → (read at, record)
        self._sub: Subscription | None = None

    async def start(self) -> None:
        for data in await self.bus.values(subjects.BUCKET_WORKERS):
            self._remember_worker(data)
        self._sub = await self.bus.subscribe_kv(subjects.BUCKET_WORKERS, ">", self._on_worker)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_worker(self, key: str, data: bytes) -> None:
        if data:
            self._remember_worker(data)

    def _remember_worker(self, data: bytes) -> None:
        record = records.decode(data, WorkerRecord)
        self.workers[record.worker_id] = record

    # -- base models -------------------------------------------------------------------------

    def served_models(self) -> dict[str, WorkerRecord | None]:
        """Base models with a live worker, plus those configured (a worker may still be loading)."""
        fresh = time.time() - WORKER_STALE_S
        served: dict[str, WorkerRecord | None] = {name: None for name in self.configured_models}
        for worker in self.workers.values():
            if worker.heartbeat_at >= fresh and worker.role == "trainer":
                served[worker.base_model] = worker
        return served

    def sampler_backends(self, base_model: str) -> set[str]:
        """Sampler backends live for a base model (empty: nothing samples it)."""
        fresh = time.time() - WORKER_STALE_S
        return {
            w.sampler_backend
            for w in self.workers.values()
            if w.base_model == base_model and w.sampler_backend and w.heartbeat_at >= fresh
        }

    def longest_sample(self, base_model: str) -> int | None:
        """The longest prompt + `max_tokens` every live sampler of `base_model` plans for (a
        trainer's own sampler, a standalone one), None while none reports a plan: a request
        may reach any of them."""
        fresh = time.time() - WORKER_STALE_S
        plans = [
            w.max_sample_tokens
            for w in self.workers.values()
            if w.base_model == base_model
            and w.sampler_backend
            and w.heartbeat_at >= fresh
            and w.max_sample_tokens is not None
        ]
        return min(plans, default=None)

    def check_base_model(self, base_model: str) -> WorkerRecord | None:
        served = self.served_models()
        if base_model not in served:
            rules.check_buildable("base_model", base_model, served)
            names = ", ".join(sorted(served)) or "none"
            raise UserError(
                f"base_model {base_model!r} is not served here; served base models: {names}"
            )
        return served[base_model]

    # -- sessions ----------------------------------------------------------------------------

    async def put_session(self, session: SessionRecord) -> None:
        """Store a session: indexed under its tenant and, unfinished, marked open
        (`open_sessions`) first, so a crash between the writes leaves an index key or a mark
        without a record (skipped, dropped), never a session a listing or the sweeper misses."""
        key = subjects.tenant_index_key(session.tenant_id, session.session_id)
        await self.bus.put(subjects.BUCKET_SESSIONS, key, b"1")
        if not session.finished:
            await self._mark_open(session.session_id)
        await self.bus.put(
            subjects.BUCKET_SESSIONS, subjects.token(session.session_id), records.encode(session)
        )

    async def _mark_open(self, session_id: str) -> None:
        key = subjects.open_session_key(session_id)
        await self.bus.put(subjects.BUCKET_SESSIONS, key, repr(time.time()).encode())

    async def open_sessions(self, now: float, grace_s: float) -> list[SessionRecord]:
        """The sessions marked open (every tenant's): what the expiry sweeper reads, a listing
        of the live ones rather than of every session ever made. A finished session's mark
        is dropped; so is one without a record (a crash between the writes), once it is older
        than `grace_s`: a younger one may be a session whose record is being written."""
        keys = await self.bus.keys(subjects.BUCKET_SESSIONS, "open")
        ids = [subjects.untoken(key.split(".", 1)[1]) for key in keys]
        found = await asyncio.gather(
            *(self.bus.get(subjects.BUCKET_SESSIONS, subjects.token(sid)) for sid in ids)
        )
        sessions: list[SessionRecord] = []
        for session_id, data in zip(ids, found, strict=True):
            session = records.decode(data, SessionRecord) if data else None
            if session is not None and not session.finished:
                sessions.append(session)
            elif session is not None or await self._mark_age(session_id, now) > grace_s:
                await self.close_session_mark(session_id)
        return sessions

    async def _mark_age(self, session_id: str, now: float) -> float:
        data = await self.bus.get(subjects.BUCKET_SESSIONS, subjects.open_session_key(session_id))
        try:
            return now - float(data or b"0")
        except ValueError:  # not a time: as old as can be
            return float("inf")

    async def close_session_mark(self, session_id: str) -> None:
        """The session is finished: its open mark goes, leaving nothing a listing would see."""
        await self.bus.erase(subjects.BUCKET_SESSIONS, subjects.open_session_key(session_id))

    async def mark_open_sessions(self) -> int:
        """Index every session under its tenant and mark every unfinished one open (sessions
        stored before these existed); a full read of the bucket, once per gateway start.
        Returns how many were marked open."""
        indexed = set(await self.bus.keys(subjects.BUCKET_SESSIONS, "tenant"))
        opened = set(await self.bus.keys(subjects.BUCKET_SESSIONS, "open"))
        marked = 0
        for session in await self.sessions(None):
            key = subjects.tenant_index_key(session.tenant_id, session.session_id)
            if key not in indexed:
                await self.bus.put(subjects.BUCKET_SESSIONS, key, b"1")
            if not session.finished:
                if subjects.open_session_key(session.session_id) not in opened:
                    await self._mark_open(session.session_id)
                marked += 1
        return marked

    async def session(
        self, session_id: str, tenant_id: str, field: str = "session_id"
    ) -> SessionRecord:
        rules.check_id(field, session_id)
        data = await self.bus.get(subjects.BUCKET_SESSIONS, subjects.token(session_id))
        if data is None:
            raise NotFound(f"session {session_id!r} not found")
        session = records.decode(data, SessionRecord)
        if session.tenant_id != tenant_id:
            raise NotFound(f"session {session_id!r} not found")
        return session

    async def sessions(self, tenant_id: str | None) -> list[SessionRecord]:
        """A tenant's sessions, read through its index (every tenant's, from every record,
        for None), oldest first."""
        found = [
            records.decode(value, SessionRecord)
            for value in await self._owned_values(subjects.BUCKET_SESSIONS, tenant_id)
        ]
        mine = [s for s in found if tenant_id is None or s.tenant_id == tenant_id]
        return sorted(mine, key=lambda session: session.created_at)

    async def session_entry(self, session_id: str) -> tuple[SessionRecord, int] | None:
        """A session and its KV revision, for a compare-and-set (finishing it exactly once)."""
        entry = await self.bus.entry(subjects.BUCKET_SESSIONS, subjects.token(session_id))
        return (records.decode(entry[0], SessionRecord), entry[1]) if entry else None

    async def swap_session(self, session: SessionRecord, revision: int) -> bool:
        return await self.bus.swap(
            subjects.BUCKET_SESSIONS,
            subjects.token(session.session_id),
            records.encode(session),
            revision,
        )

    async def touch_session(self, session_id: str, tenant_id: str) -> None:
        """A heartbeat: the session's `last_heartbeat` is now, by compare-and-set, so it never
        writes back a copy read before a concurrent finish. A finished session is `Gone`."""
        await self.session(session_id, tenant_id)  # the id's checks, and the tenant's own
        while True:
            entry = await self.session_entry(session_id)
            if entry is None:
                raise NotFound(f"session {session_id!r} not found")
            session, revision = entry
            if session.finished:
                raise Gone(f"session {session_id!r} is finished")
            session.last_heartbeat = time.time()
            if await self.swap_session(session, revision):
                return

    async def session_samplers(self, session_id: str) -> list[SamplerRecord]:
        """The sampling sessions opened in a session, oldest first."""
        values = await self.bus.values(subjects.BUCKET_SESSIONS, "sampler")
        found = [records.decode(value, SamplerRecord) for value in values]
        mine = [sampler for sampler in found if sampler.session_id == session_id]
        return sorted(mine, key=lambda sampler: sampler.created_at)

    # -- custom losses (per session, in tw_sessions) -----------------------------------------

    async def create_custom_loss(self, record: CustomLossRecord) -> CustomLossRecord:
        """Store a session's custom loss unless its id exists; the record stored either way."""
        key = _custom_loss_key(record.loss.loss_id)
        if await self.bus.create(subjects.BUCKET_SESSIONS, key, records.encode(record)):
            return record
        found = await self.find_custom_loss(record.loss.loss_id)
        if found is None:  # deleted between the two calls: the caller's retry stores it
            raise Unavailable(f"custom loss {record.loss.loss_id!r} is changing; retry")
        return found

    async def find_custom_loss(self, loss_id: str) -> CustomLossRecord | None:
        """The stored loss of that id, whoever owns it (the caller checks the owner)."""
        data = await self.bus.get(subjects.BUCKET_SESSIONS, _custom_loss_key(loss_id))
        return records.decode(data, CustomLossRecord) if data else None

    async def tenant_samplers(self, tenant_id: str) -> list[SamplerRecord]:
        """The tenant's sampling sessions, oldest first."""
        values = await self.bus.values(subjects.BUCKET_SESSIONS, "sampler")
        found = [records.decode(value, SamplerRecord) for value in values]
        mine = [sampler for sampler in found if sampler.tenant_id == tenant_id]
        return sorted(mine, key=lambda sampler: sampler.created_at)

    # -- tenants -----------------------------------------------------------------------------

    async def create_tenant(self, tenant: TenantRecord) -> bool:
        """Store a new tenant; False when the name is taken."""
        return await self.bus.create(subjects.BUCKET_TENANTS, tenant.name, records.encode(tenant))

    async def tenant(self, name: str) -> TenantRecord | None:
        data = await self.bus.get(subjects.BUCKET_TENANTS, name)
        return records.decode(data, TenantRecord) if data else None

    async def tenants(self) -> list[TenantRecord]:
        found = [
            records.decode(value, TenantRecord)
            for value in await self.bus.values(subjects.BUCKET_TENANTS)
        ]
        return sorted(found, key=lambda tenant: tenant.created_at)

    # -- sampling sessions -------------------------------------------------------------------

    async def put_sampler(self, sampler: SamplerRecord) -> None:
        key = subjects.sampler_key(sampler.sampling_session_id)
        await self.bus.put(subjects.BUCKET_SESSIONS, key, records.encode(sampler))

    async def sampler(
        self, sampling_session_id: str, tenant_id: str, field: str = "sampling_session_id"
    ) -> SamplerRecord:
        rules.check_id(field, sampling_session_id)
        data = await self.bus.get(
            subjects.BUCKET_SESSIONS, subjects.sampler_key(sampling_session_id)
        )
        sampler = records.decode(data, SamplerRecord) if data else None
        if sampler is None or sampler.tenant_id != tenant_id:
            raise NotFound(f"sampling session {sampling_session_id!r} not found")
        return sampler

    # -- runs --------------------------------------------------------------------------------

    async def put_run(self, run: RunRecord) -> None:
        """Store a run, indexed under its tenant first (`tenant_index_key`), so a crash between
        the writes leaves an index key without a record (skipped), never a run its tenant's
        listings miss."""
        await self._index_run(run)
        await self.bus.put(subjects.BUCKET_RUNS, subjects.token(run.model_id), records.encode(run))
        self._remember_run(run.model_id, run)

    async def create_run(self, run: RunRecord) -> bool:
        """Store a new run; False when its model_id is taken (an import never replaces one).
        Indexed first, as `put_run` does (an index key whose record is another tenant's is
        skipped by the owner check of every listing)."""
        await self._index_run(run)
        stored = await self.bus.create(
            subjects.BUCKET_RUNS, subjects.token(run.model_id), records.encode(run)
        )
        if stored:
            self._remember_run(run.model_id, run)
        return stored

    async def _index_run(self, run: RunRecord) -> None:
        key = subjects.tenant_index_key(run.tenant_id, run.model_id)
        await self.bus.put(subjects.BUCKET_RUNS, key, b"1")

    async def delete_run(self, model_id: str) -> None:
        """A run's record, its seq count and its tenant index key."""
        await self.bus.delete(subjects.BUCKET_RUNS, subjects.highest_seq_key(model_id))
        await self.bus.delete(subjects.BUCKET_RUNS, subjects.token(model_id))
        await self.bus.erase(subjects.BUCKET_RUNS, f"tenant.*.{subjects.token(model_id)}")
        self._remember_run(model_id, None)

    async def index_runs(self) -> int:
        """Index every run under its tenant (runs stored before the index existed, or whose
        `create_run` stopped before indexing); a full read of the bucket, once per gateway
        start. Returns how many runs there are."""
        indexed = set(await self.bus.keys(subjects.BUCKET_RUNS, "tenant"))
        found = await self.runs(None)
        for run in found:
            if subjects.tenant_index_key(run.tenant_id, run.model_id) not in indexed:
                await self._index_run(run)
        return len(found)

    async def find_run(self, model_id: str) -> RunRecord | None:
        """The run's record as stored now."""
        data = await self.bus.get(subjects.BUCKET_RUNS, subjects.token(model_id))
        run = records.decode(data, RunRecord) if data else None
        self._remember_run(model_id, run)
        return run

    async def run(self, model_id: str, tenant_id: str, field: str = "model_id") -> RunRecord:
        """A run the tenant owns, else NotFound; read at most `RUN_CACHE_S` ago.

        Every call of a model looks its run up first: a record this gateway read or wrote that
        recently is used again, one bus round trip less per call. This gateway's own changes
        show at once; another gateway's (an unload) within `RUN_CACHE_S`.
        """
        rules.check_id(field, model_id)
        cached = self._runs.get(model_id)
        if cached is not None and time.monotonic() - cached[0] < RUN_CACHE_S:
            run: RunRecord | None = msgspec.structs.replace(cached[1])  # callers may change it
        else:
            run = await self.find_run(model_id)
        if run is None or run.tenant_id != tenant_id:
            raise NotFound(f"model_id {model_id!r} not found")
        return run

    def _remember_run(self, model_id: str, run: RunRecord | None) -> None:
        if run is None:
            self._runs.pop(model_id, None)
            return
        if len(self._runs) >= _MAX_CACHED_RUNS and model_id not in self._runs:
            self._runs.clear()  # only a shortcut: a run missing here is read again
        self._runs[model_id] = (time.monotonic(), msgspec.structs.replace(run))

    async def runs(self, tenant_id: str | None) -> list[RunRecord]:
        """A tenant's runs, read through its index (every tenant's, from every record, for
        None), oldest first."""
        values = await self._owned_values(subjects.BUCKET_RUNS, tenant_id)
        runs = [records.decode(value, RunRecord) for value in values]
        mine = [run for run in runs if tenant_id is None or run.tenant_id == tenant_id]
        return sorted(mine, key=lambda run: run.created_at)

    async def _owned_values(self, bucket: str, tenant_id: str | None) -> list[bytes]:
        """The records a tenant's index names (each caller checks the owner), or every record
        of the bucket for None."""
        if tenant_id is None:
            return await self._bare_values(bucket)
        prefix = subjects.tenant_index_prefix(tenant_id)
        keys = await self.bus.keys(bucket, prefix)
        found = await asyncio.gather(*(self.bus.get(bucket, k[len(prefix) + 1 :]) for k in keys))
        return [value for value in found if value]

    async def _bare_values(self, bucket: str) -> list[bytes]:
        """Values of a bucket's records keyed by a bare id token (dotted keys are indexes)."""
        keys = [key for key in await self.bus.keys(bucket) if "." not in key]
        values = await asyncio.gather(*(self.bus.get(bucket, key) for key in keys))
        return [value for value in values if value]

    # -- checkpoints -------------------------------------------------------------------------

    async def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        values = await self.bus.values(subjects.BUCKET_CHECKPOINTS, subjects.token(run_id))
        found = [records.decode(v, CheckpointRecord) for v in values]
        return sorted(found, key=lambda ckpt: ckpt.created_at)

    async def find_checkpoint(self, run_id: str, checkpoint_id: str) -> CheckpointRecord | None:
        data = await self.bus.get(
            subjects.BUCKET_CHECKPOINTS, subjects.checkpoint_key(run_id, checkpoint_id)
        )
        return records.decode(data, CheckpointRecord) if data else None

    async def checkpoint(self, run_id: str, checkpoint_id: str, tenant_id: str) -> CheckpointRecord:
        """A checkpoint the tenant may read: its own, or a public one."""
        ckpt = await self.find_checkpoint(run_id, checkpoint_id)
        if ckpt is None or (ckpt.tenant_id != tenant_id and not ckpt.public):
            raise NotFound(f"checkpoint tinker://{run_id}/{checkpoint_id} not found")
        return ckpt

    async def all_checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint record of every tenant (for the TTL sweeper)."""
        values = await self.bus.values(subjects.BUCKET_CHECKPOINTS)
        return [records.decode(value, CheckpointRecord) for value in values]

    async def tenant_checkpoints(self, tenant_id: str) -> list[CheckpointRecord]:
        """The tenant's own checkpoints across all its runs (a run goes only after its
        checkpoints), newest first: only the tenant's records are read, listed run by run for
        a few runs, from one listing of the bucket's keys for more."""
        runs = await self.runs(tenant_id)
        if len(runs) <= _RUN_BY_RUN:
            per_run = await asyncio.gather(*(self.checkpoints(run.model_id) for run in runs))
            found = [ckpt for ckpts in per_run for ckpt in ckpts]
        else:  # one key listing of the bucket, then only the tenant's records
            own = {subjects.token(run.model_id) for run in runs}
            keys = await self.bus.keys(subjects.BUCKET_CHECKPOINTS)
            mine_keys = [key for key in keys if key.split(".", 1)[0] in own]
            values = await asyncio.gather(
                *(self.bus.get(subjects.BUCKET_CHECKPOINTS, key) for key in mine_keys)
            )
            found = [records.decode(value, CheckpointRecord) for value in values if value]
        mine = [ckpt for ckpt in found if ckpt.tenant_id == tenant_id]
        return sorted(mine, key=lambda ckpt: ckpt.created_at, reverse=True)

    async def owned_checkpoint(
        self, run_id: str, checkpoint_id: str, tenant_id: str
    ) -> CheckpointRecord:
        """A checkpoint the tenant may change or delete: its own. A published checkpoint of
        another tenant answers NotFound here, exactly like one that does not exist."""
        ckpt = await self.find_checkpoint(run_id, checkpoint_id)
        if ckpt is None or ckpt.tenant_id != tenant_id:
            raise NotFound(f"checkpoint tinker://{run_id}/{checkpoint_id} not found")
        return ckpt

    async def update_checkpoint(
        self,
        run_id: str,
        checkpoint_id: str,
        tenant_id: str,
        change: Callable[[CheckpointRecord], CheckpointRecord],
    ) -> CheckpointRecord:
        """Apply `change` to the tenant's own checkpoint record, compare-and-set: two changes
        at once (publish and a TTL, say) both land."""
        key = subjects.checkpoint_key(run_id, checkpoint_id)
        for _ in range(_MAX_SWAPS):
            entry = await self.bus.entry(subjects.BUCKET_CHECKPOINTS, key)
            ckpt = records.decode(entry[0], CheckpointRecord) if entry and entry[0] else None
            if entry is None or ckpt is None or ckpt.tenant_id != tenant_id:
                raise NotFound(f"checkpoint tinker://{run_id}/{checkpoint_id} not found")
            changed = change(ckpt)
            if await self.bus.swap(
                subjects.BUCKET_CHECKPOINTS, key, records.encode(changed), entry[1]
            ):
                return changed
        raise Unavailable(f"checkpoint tinker://{run_id}/{checkpoint_id} is changing; retry")

    async def put_checkpoint(self, ckpt: CheckpointRecord) -> None:
        await self.bus.put(
            subjects.BUCKET_CHECKPOINTS,
            subjects.checkpoint_key(ckpt.run_id, ckpt.checkpoint_id),
            records.encode(ckpt),
        )

    async def delete_checkpoint_record(self, run_id: str, checkpoint_id: str) -> None:
        await self.bus.delete(
            subjects.BUCKET_CHECKPOINTS, subjects.checkpoint_key(run_id, checkpoint_id)
        )


def _custom_loss_key(loss_id: str) -> str:
    """KV key of a custom loss in `tw_sessions` (dotted: not a session record)."""
    return f"loss.{subjects.token(loss_id)}"
