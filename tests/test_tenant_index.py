"""A tenant's runs and checkpoints are read through its own index, against a real nats-server:
the storage-quota check of every save, `max_adapters`, a finishing session and the listings
then cost what the tenant owns, not what every tenant ever stored."""

from __future__ import annotations

from protocol import records, subjects
from protocol.api import LoraConfig
from protocol.records import CheckpointRecord, RunRecord, SessionRecord
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsServer
from twinkle_async.registry import Registry
from twinkle_async.settings import BusSettings


class CountingBus(Bus):
    """The gateway's bus, counting record reads in `tw_runs` and `tw_checkpoints`."""

    reads = 0

    async def get(self, bucket: str, key: str) -> bytes | None:
        self.reads += bucket in (subjects.BUCKET_RUNS, subjects.BUCKET_CHECKPOINTS)
        return await super().get(bucket, key)


def run(tenant_id: str, model_id: str) -> RunRecord:
    return RunRecord(
        model_id=model_id,
        tenant_id=tenant_id,
        session_id="sess",
        base_model="base",
        lora=LoraConfig(),
        created_at=float(len(model_id)),
        last_request_time=0.0,
    )


def checkpoint(tenant_id: str, run_id: str, name: str) -> CheckpointRecord:
    return CheckpointRecord(
        run_id=run_id,
        tenant_id=tenant_id,
        checkpoint_id=f"weights/{name}",
        kind="weights",
        path=f"tinker://{run_id}/weights/{name}",
        directory="/nowhere",
        created_at=0.0,
        size_bytes=100,
        base_model="base",
        lora=LoraConfig(),
    )


async def test_a_tenants_runs_and_checkpoints_cost_what_it_owns(nats_server: NatsServer) -> None:
    bus = CountingBus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry = Registry(bus)
        for n in range(30):  # another tenant's history
            await registry.put_run(run("big", f"big-run-{n}"))
            key = subjects.checkpoint_key(f"big-run-{n}", "weights/w")
            ckpt = checkpoint("big", f"big-run-{n}", "w")
            await bus.put(subjects.BUCKET_CHECKPOINTS, key, records.encode(ckpt))
        await registry.put_run(run("small", "small-a"))
        assert await registry.create_run(run("small", "small-bb"))
        for name in ("x", "y"):
            ckpt = checkpoint("small", "small-a", name)
            key = subjects.checkpoint_key("small-a", ckpt.checkpoint_id)
            await bus.put(subjects.BUCKET_CHECKPOINTS, key, records.encode(ckpt))

        bus.reads = 0
        assert [r.model_id for r in await registry.runs("small")] == ["small-a", "small-bb"]
        assert bus.reads == 2
        bus.reads = 0
        assert sum(c.size_bytes for c in await registry.tenant_checkpoints("small")) == 200
        assert bus.reads == 4  # its 2 runs, then its 2 checkpoints
        assert len(await registry.runs(None)) == 32

        # a run stored before the index existed: listed once a gateway start indexes it
        legacy = run("small", "small-legacy")
        await bus.put(subjects.BUCKET_RUNS, subjects.token(legacy.model_id), records.encode(legacy))
        assert len(await registry.runs("small")) == 2
        assert await registry.index_runs() == 33
        assert len(await registry.runs("small")) == 3

        await registry.delete_run("small-bb")  # its index key goes too, leaving no marker
        assert [r.model_id for r in await registry.runs("small")] == ["small-a", "small-legacy"]
        keys = await bus.keys(subjects.BUCKET_RUNS, subjects.tenant_index_prefix("small"))
        assert keys == sorted(
            subjects.tenant_index_key("small", m) for m in ("small-a", "small-legacy")
        )
    finally:
        await bus.close()


async def test_a_tenants_sessions_cost_what_it_owns(nats_server: NatsServer) -> None:
    bus = CountingSessionBus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry = Registry(bus)
        for n in range(30):
            await registry.put_session(session("big", f"sess-big-{n}", finished=True))
        await registry.put_session(session("small", "sess-small-1"))
        legacy = session("small", "sess-small-0", finished=True)  # stored before the index
        await bus.put(
            subjects.BUCKET_SESSIONS, subjects.token(legacy.session_id), records.encode(legacy)
        )
        bus.reads = 0
        assert [s.session_id for s in await registry.sessions("small")] == ["sess-small-1"]
        assert bus.reads == 1
        await registry.mark_open_sessions()  # as a gateway starts
        assert [s.session_id for s in await registry.sessions("small")] == [
            "sess-small-0",
            "sess-small-1",
        ]
        assert len(await registry.sessions(None)) == 32
    finally:
        await bus.close()


class CountingSessionBus(Bus):
    reads = 0

    async def get(self, bucket: str, key: str) -> bytes | None:
        self.reads += bucket == subjects.BUCKET_SESSIONS and "." not in key
        return await super().get(bucket, key)


def session(tenant_id: str, session_id: str, finished: bool = False) -> SessionRecord:
    return SessionRecord(
        session_id=session_id,
        tenant_id=tenant_id,
        created_at=float(session_id[-1]),
        last_heartbeat=0.0,
        finished=finished,
    )


async def test_a_tenant_with_many_runs_reads_only_its_checkpoints(nats_server: NatsServer) -> None:
    """Past a few runs the checkpoints come from one key listing of the bucket, not one listing
    per run; still only the tenant's records are read."""
    bus = CountingBus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry = Registry(bus)
        for tenant_id, n_runs in (("many", 20), ("other", 10)):
            for n in range(n_runs):
                run_id = f"{tenant_id}-run-{n}"
                await registry.put_run(run(tenant_id, run_id))
                ckpt = checkpoint(tenant_id, run_id, "w")
                key = subjects.checkpoint_key(run_id, ckpt.checkpoint_id)
                await bus.put(subjects.BUCKET_CHECKPOINTS, key, records.encode(ckpt))
        bus.reads = 0
        found = await registry.tenant_checkpoints("many")
        assert len(found) == 20 and {c.tenant_id for c in found} == {"many"}
        assert bus.reads == 40  # its 20 runs, then its 20 checkpoints
    finally:
        await bus.close()
