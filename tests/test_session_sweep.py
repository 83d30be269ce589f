"""The session expiry sweeper against a real nats-server: it reads the sessions marked open,
not every session ever made (finished ones pile up: one per SDK client), finishes the ones
whose heartbeats stopped, and still sees sessions stored before marks existed."""

from __future__ import annotations

import time

import pytest

from protocol import records, subjects
from protocol.records import SessionRecord
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.lifecycle import Lifecycle
from twinkle_async.nats_server import NatsServer
from twinkle_async.registry import Registry
from twinkle_async.settings import BusSettings

TIMEOUT_S = 120.0


class CountingBus(Bus):
    """The gateway's bus, counting reads of session records (bare keys of `tw_sessions`)."""

    session_reads = 0

    async def get(self, bucket: str, key: str) -> bytes | None:
        self.session_reads += bucket == subjects.BUCKET_SESSIONS and "." not in key
        return await super().get(bucket, key)


def session(session_id: str, heartbeat_at: float, finished: bool = False) -> SessionRecord:
    return SessionRecord(
        session_id=session_id,
        tenant_id="t",
        created_at=0.0,
        last_heartbeat=heartbeat_at,
        finished=finished,
    )


def lifecycle_on(bus: Bus) -> tuple[Registry, Lifecycle]:
    registry = Registry(bus)
    lifecycle = Lifecycle(
        registry, FutureStore(bus), bus, session_timeout_s=TIMEOUT_S, sweep_interval_s=60
    )
    return registry, lifecycle


async def test_the_sweeper_reads_open_sessions_only(nats_server: NatsServer) -> None:
    bus = CountingBus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry, lifecycle = lifecycle_on(bus)
        now = 10_000.0
        for n in range(40):  # the history: finished sessions
            await registry.put_session(session(f"sess-done-{n}", 0.0, finished=True))
        await registry.put_session(session("sess-stale", now - TIMEOUT_S - 1))
        await registry.put_session(session("sess-live", now - 1))
        # a mark whose record never came (a crash between the two writes)
        await bus.put(subjects.BUCKET_SESSIONS, subjects.open_session_key("sess-ghost"), b"1")

        bus.session_reads = 0
        assert await lifecycle.sweep(now) == ["sess-stale"]
        assert bus.session_reads <= 6, bus.session_reads  # 3 marks read, the finish's own reads
        stale = await registry.session("sess-stale", "t")
        assert stale.finished and stale.finish_reason == "expired"
        assert [s.session_id for s in await registry.open_sessions(now, TIMEOUT_S)] == ["sess-live"]
        assert await bus.keys(subjects.BUCKET_SESSIONS, "open") == [
            subjects.open_session_key("sess-live")
        ]

        # a session stored before marks existed: marked when a sweeper starts, then expired
        legacy = session("sess-legacy", now - TIMEOUT_S - 1)
        await bus.put(
            subjects.BUCKET_SESSIONS, subjects.token(legacy.session_id), records.encode(legacy)
        )
        assert await lifecycle.sweep(now) == []
        assert await registry.mark_open_sessions() == 2  # the live one and the legacy one
        assert await lifecycle.sweep(now) == ["sess-legacy"]
    finally:
        await bus.close()


@pytest.mark.parametrize("finished", [False, True])
async def test_a_finished_session_loses_its_mark(nats_server: NatsServer, finished: bool) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry, lifecycle = lifecycle_on(bus)
        await registry.put_session(session("sess-a", 0.0, finished=finished))
        marks = await bus.keys(subjects.BUCKET_SESSIONS, "open")
        assert marks == ([] if finished else [subjects.open_session_key("sess-a")])
        assert await lifecycle.finish("sess-a", "success") is not finished
        assert await bus.keys(subjects.BUCKET_SESSIONS, "open") == []
    finally:
        await bus.close()


async def test_a_mark_whose_record_is_still_coming_is_kept(nats_server: NatsServer) -> None:
    """`put_session` marks a session open before writing its record: a sweep between the two
    must not drop the mark, or the session would never expire."""
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry, _ = lifecycle_on(bus)
        await registry._mark_open("sess-new")  # the record is not written yet
        now = time.time()
        assert await registry.open_sessions(now, TIMEOUT_S) == []
        mark = subjects.open_session_key("sess-new")
        assert await bus.keys(subjects.BUCKET_SESSIONS, "open") == [mark]
        await registry.open_sessions(now + TIMEOUT_S + 1, TIMEOUT_S)  # it never came
        assert await bus.keys(subjects.BUCKET_SESSIONS, "open") == []
    finally:
        await bus.close()
