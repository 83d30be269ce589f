"""The bus calls a sequenced submit waits on, and their order.

The pending record and the job's publish do not wait on each other (one bus round trip less
per call); both are done before the client gets its request id, and a failure of either still
reaches the client after both have finished. So do the seq's note and its claim, when the
gateway already knows the note cannot refuse the seq; otherwise the note comes first. A model's next seq is noted with one
compare-and-set, without reading the key back, unless another gateway moved it; its run record
is read again only after `RUN_CACHE_S`, or at once when this gateway changed it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from protocol import records, rules, subjects
from protocol.api import LoraConfig
from protocol.errors import Gone, NotFound, Unavailable, UserError
from protocol.jobs import Job, OptimStepJob, SeqClaim, encode_job
from protocol.records import RunRecord, SessionRecord
from twinkle_async import registry as registry_module
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.gateway.sequenced import submit_sequenced
from twinkle_async.gateway.state import BUS, FUTURES, TENANT
from twinkle_async.nats_server import NatsServer
from twinkle_async.registry import Registry
from twinkle_async.settings import BusSettings

RUN = RunRecord(
    model_id="sess-1:train:0",
    tenant_id="t",
    session_id="sess-1",
    base_model="base",
    lora=LoraConfig(),
    created_at=0.0,
    last_request_time=0.0,
)


class StubFutures:
    """Each step of a submit; `record_pending` waits until the job is being published.

    `in_range`: what `seq_in_range` answers. `calls` records each step as it starts and ends;
    `note_fails` makes the note refuse the seq (as one too far ahead)."""

    def __init__(
        self, publishing: asyncio.Event, in_range: bool = False, note_fails: bool = False
    ) -> None:
        self.publishing = publishing
        self.pending: list[str] = []
        self.in_range = in_range
        self.note_fails = note_fails
        self.calls: list[str] = []

    def seq_in_range(self, model_id: str, seq_id: int) -> bool:
        return self.in_range

    async def note_seq(self, model_id: str, seq_id: int, field: str = "seq_id") -> int:
        self.calls.append("note")
        await asyncio.sleep(0.01)  # a bus round trip
        self.calls.append("noted")
        if self.note_fails:
            raise UserError(f"{field}: {seq_id} is too far ahead")
        return seq_id - 1

    async def claim(self, model_id: str, seq_id: int, claim: SeqClaim) -> SeqClaim:
        self.calls.append("claim")
        await asyncio.sleep(0.01)
        self.calls.append("claimed")
        return claim

    async def record_pending(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        await asyncio.wait_for(self.publishing.wait(), 5.0)
        self.pending.append(request_id)


class StubBus:
    def __init__(self, publishing: asyncio.Event, fail: bool = False) -> None:
        self.publishing = publishing
        self.fail = fail
        self.published: list[Job] = []

    def encode_job(self, job: Job) -> bytes:
        return encode_job(job)

    async def publish_job(self, pool: str, job: Job, data: bytes | None = None) -> None:
        self.publishing.set()
        await asyncio.sleep(0.01)
        if self.fail:
            raise Unavailable("the job bus is unavailable")
        self.published.append(job)


def _request(futures: StubFutures, bus: StubBus) -> web.Request:
    app = web.Application()
    app[FUTURES] = futures  # type: ignore[assignment]
    app[BUS] = bus  # type: ignore[assignment]
    request = make_mocked_request("POST", "/api/v1/optim_step", app=app)
    request[TENANT] = "t"
    return request


async def _build(request_id: str, first: bool) -> Job:
    return OptimStepJob(request_id=request_id, model_id=RUN.model_id, tenant_id="t", seq_id=1)


async def test_pending_record_and_publish_do_not_wait_on_each_other() -> None:
    publishing = asyncio.Event()
    futures, bus = StubFutures(publishing), StubBus(publishing)
    response = await asyncio.wait_for(
        submit_sequenced(_request(futures, bus), RUN, 1, "optim_step", b"{}", _build), 10.0
    )
    assert response.status == 200
    assert [job.request_id for job in bus.published] == futures.pending


async def test_a_failed_publish_fails_the_call_after_the_pending_record() -> None:
    publishing = asyncio.Event()
    futures, bus = StubFutures(publishing), StubBus(publishing, fail=True)
    with pytest.raises(Unavailable):
        await submit_sequenced(_request(futures, bus), RUN, 1, "optim_step", b"{}", _build)
    assert len(futures.pending) == 1 and not bus.published


async def test_a_seq_known_near_enough_is_noted_beside_its_claim() -> None:
    publishing = asyncio.Event()
    futures, bus = StubFutures(publishing, in_range=True), StubBus(publishing)
    await submit_sequenced(_request(futures, bus), RUN, 1, "optim_step", b"{}", _build)
    assert futures.calls[:2] == ["note", "claim"]  # one round trip for both
    assert len(bus.published) == 1


async def test_a_seq_not_known_near_enough_is_noted_before_anything_is_claimed() -> None:
    publishing = asyncio.Event()
    futures, bus = StubFutures(publishing), StubBus(publishing)
    await submit_sequenced(_request(futures, bus), RUN, 1, "optim_step", b"{}", _build)
    assert futures.calls == ["note", "noted", "claim", "claimed"]
    refused = StubFutures(publishing, note_fails=True)
    with pytest.raises(UserError, match="too far ahead"):
        await submit_sequenced(_request(refused, bus), RUN, 1, "optim_step", b"{}", _build)
    assert refused.calls == ["note", "noted"]  # nothing spent


async def test_a_failed_note_beside_the_claim_fails_the_call_after_both() -> None:
    publishing = asyncio.Event()
    futures = StubFutures(publishing, in_range=True, note_fails=True)
    bus = StubBus(publishing)
    with pytest.raises(UserError):
        await submit_sequenced(_request(futures, bus), RUN, 1, "optim_step", b"{}", _build)
    assert sorted(futures.calls) == ["claim", "claimed", "note", "noted"] and not bus.published


async def test_seq_in_range_follows_the_highest_seq_known(nats_server: NatsServer) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        futures = FutureStore(bus)
        assert not futures.seq_in_range("m", 1)  # nothing known yet: read first
        await futures.note_seq("m", 3)
        assert futures.seq_in_range("m", 3 + rules.MAX_SEQ_AHEAD)
        assert not futures.seq_in_range("m", 4 + rules.MAX_SEQ_AHEAD)
    finally:
        await bus.close()


class CountingBus(Bus):
    """The gateway's bus, counting the reads of `tw_runs` entries."""

    reads = 0

    async def entry(self, bucket: str, key: str) -> tuple[bytes, int] | None:
        self.reads += 1
        return await super().entry(bucket, key)


async def test_a_models_next_seq_is_noted_without_reading_it_back(
    nats_server: NatsServer,
) -> None:
    bus = CountingBus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        futures, other = FutureStore(bus), FutureStore(bus)  # two gateways on one bus
        assert await futures.note_seq("m", 1) == 0
        reads = bus.reads
        assert await futures.note_seq("m", 2) == 1
        assert await futures.note_seq("m", 3) == 2
        assert await futures.note_seq("m", 2) == 3  # a retry of an older call
        assert bus.reads == reads  # each a compare-and-set on the revision kept, no read
        assert await other.note_seq("m", 4) == 3  # another gateway moves the key
        assert await futures.note_seq("m", 5) == 4  # read back: it was moved meanwhile
        assert bus.reads == reads + 2
        with pytest.raises(UserError, match="ahead"):
            await futures.note_seq("m", 6 + rules.MAX_SEQ_AHEAD)
        entry = await bus.entry(subjects.BUCKET_RUNS, subjects.highest_seq_key("m"))
        assert entry is not None and entry[0] == b"5"
    finally:
        await bus.close()


class CountingRunBus(Bus):
    """The gateway's bus, counting the reads of `tw_runs` keys."""

    reads = 0

    async def get(self, bucket: str, key: str) -> bytes | None:
        self.reads += bucket == subjects.BUCKET_RUNS
        return await super().get(bucket, key)


async def test_a_call_reuses_the_run_record_read_just_before(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    bus = CountingRunBus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry, other = Registry(bus), Registry(bus)  # two gateways on one bus
        await other.put_run(RUN)
        assert (await registry.run(RUN.model_id, "t")).unloaded_at is None
        reads = bus.reads
        for _ in range(3):  # the next calls of the model: no read
            run = await registry.run(RUN.model_id, "t")
        assert bus.reads == reads
        with pytest.raises(NotFound):  # still another tenant's
            await registry.run(RUN.model_id, "other")
        run.unloaded_at = 1.0  # a caller's change to its copy is not the record's
        assert (await registry.run(RUN.model_id, "t")).unloaded_at is None

        await other.put_run(msgspec.structs.replace(RUN, unloaded_at=2.0))  # another gateway
        assert (await registry.run(RUN.model_id, "t")).unloaded_at is None  # not yet seen
        monkeypatch.setattr(registry_module, "RUN_CACHE_S", 0.0)
        assert (await registry.run(RUN.model_id, "t")).unloaded_at == 2.0  # read again
        monkeypatch.undo()

        await registry.put_run(msgspec.structs.replace(RUN, unloaded_at=3.0))  # this gateway
        assert (await registry.run(RUN.model_id, "t")).unloaded_at == 3.0
        await registry.delete_run(RUN.model_id)
        with pytest.raises(NotFound):
            await registry.run(RUN.model_id, "t")
    finally:
        await bus.close()


class FinishingBus(Bus):
    """The gateway's bus; once armed, another writer finishes the session right after a
    heartbeat reads it (the race of a heartbeat with `finish` or the expiry sweeper)."""

    armed = False

    async def entry(self, bucket: str, key: str) -> tuple[bytes, int] | None:
        found = await super().entry(bucket, key)
        if self.armed and found is not None and bucket == subjects.BUCKET_SESSIONS:
            self.armed = False
            session = records.decode(found[0], SessionRecord)
            session.finished = True
            await super().put(bucket, key, records.encode(session))
        return found


async def test_a_heartbeat_racing_a_finish_does_not_reopen_the_session(
    nats_server: NatsServer,
) -> None:
    bus = FinishingBus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        registry = Registry(bus)
        await registry.put_session(
            SessionRecord(session_id="sess-1", tenant_id="t", created_at=0.0, last_heartbeat=0.0)
        )
        await registry.touch_session("sess-1", "t")
        assert (await registry.session("sess-1", "t")).last_heartbeat > 0
        with pytest.raises(NotFound):
            await registry.touch_session("sess-1", "other")
        bus.armed = True
        with pytest.raises(Gone):
            await registry.touch_session("sess-1", "t")
        assert (await registry.session("sess-1", "t")).finished
    finally:
        await bus.close()
