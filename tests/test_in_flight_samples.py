"""`max_concurrent_samples` counted for the whole cluster: gateways on one real nats-server.

Two gateways behind one address once each admitted up to the limit. Now every gateway updates
the tenant's `inflight.<tenant>` entry in `tw_usage` with a compare-and-set, so the last slot
goes to one of them only. Two in-process gateway apps show it through HTTP; two bus
connections race admits for it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from protocol import records, subjects
from protocol.errors import RateLimited
from protocol.jobs import Outcome, encode_outcome
from protocol.records import InFlightSamples, QuotaRecord, SamplerRecord, WorkerRecord
from twinkle_async.bus import Bus
from twinkle_async.gateway.app import build_app
from twinkle_async.gateway.state import BUS, REGISTRY
from twinkle_async.nats_server import NatsServer
from twinkle_async.quotas import InFlight, Quotas, in_flight_key
from twinkle_async.settings import BusSettings, GatewaySettings, Limits

API_KEY = "tml-in-flight-test-key"
TENANT = "t"
SAMPLER_ID = "sess-flight:sample:0"

Client = TestClient[Any, Any]


def _gateway(nats_server: NatsServer, limit: int) -> Client:
    settings = GatewaySettings(
        api_keys={API_KEY: TENANT},
        bus=BusSettings(nats_url=nats_server.url),
        quota_defaults=Limits(max_concurrent_samples=limit),
    )
    return TestClient(TestServer(build_app(settings)))


@pytest.fixture
async def gateways(nats_server: NatsServer) -> AsyncIterator[tuple[Client, Client]]:
    """Two gateways of one cluster, a sampler worker they both see, and a sampling session."""
    async with _gateway(nats_server, 2) as a, _gateway(nats_server, 2) as b:
        await _serve_samples(a, b)
        yield a, b


async def _serve_samples(a: Client, b: Client) -> None:
    worker = WorkerRecord(
        worker_id="w",
        pool=subjects.pool_of("base"),
        base_model="base",
        arch="qwen3",
        vocab_size=16,
        max_context=4096,
        max_rank=8,
        slots_total=1,
        slots_used=0,
        heartbeat_at=time.time() + 60,
        sampler_backend="torch",
    )
    await a.app[BUS].put(subjects.BUCKET_WORKERS, "w", records.encode(worker))
    deadline = time.monotonic() + 10
    while not all(g.app[REGISTRY].sampler_backends("base") for g in (a, b)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    sampler = SamplerRecord(
        sampling_session_id=SAMPLER_ID,
        tenant_id=TENANT,
        session_id="sess-flight",
        base_model="base",
        model_path=None,
        created_at=time.time(),
    )
    await a.app[REGISTRY].put_sampler(sampler)


async def _asample(client: Client, seq_id: int) -> tuple[int, dict[str, Any]]:
    body = {
        "type": "sample",
        "sampling_session_id": SAMPLER_ID,
        "seq_id": seq_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 1},
    }
    resp = await client.post(
        "/api/v1/asample",
        data=json.dumps(body),
        headers={"X-API-Key": API_KEY, "Content-Type": "application/json"},
    )
    return resp.status, await resp.json()


async def test_two_gateways_share_one_limit(gateways: tuple[Client, Client]) -> None:
    """Limit 2: one sample on each gateway fills it, a third on either is a 429; the result of
    the first fetched through its gateway frees the slot for the other."""
    a, b = gateways
    status, first = await _asample(a, 1)
    assert status == 200, first
    status, second = await _asample(b, 2)
    assert status == 200, second
    for gateway, seq_id in [(a, 3), (b, 4)]:
        status, refused = await _asample(gateway, seq_id)
        assert status == 429, refused
        assert refused["detail"].startswith("quota max_concurrent_samples: 2 sample requests")
    status, again = await _asample(b, 2)  # a retried submit is admitted at the limit
    assert (status, again["request_id"]) == (200, second["request_id"])

    finished = Outcome(
        request_id=first["request_id"],
        state="done",
        request_type="sample",
        payload=b'{"sequences": []}',
        finished_at=time.time(),
        tenant_id=TENANT,
        sampling_session_id=SAMPLER_ID,
    )
    bus = a.app[BUS]
    await bus.put(
        subjects.BUCKET_FUTURES, subjects.future_key(first["request_id"]), encode_outcome(finished)
    )
    resp = await a.post(
        "/api/v1/retrieve_future",
        json={"request_id": first["request_id"]},
        headers={"X-API-Key": API_KEY},
    )
    assert resp.status == 200, await resp.text()
    status, third = await _asample(b, 4)  # the refused seq id, retried: its slot is free now
    assert status == 200, third
    entry = await bus.get(subjects.BUCKET_USAGE, in_flight_key(TENANT))
    assert entry is not None
    started = records.decode(entry, InFlightSamples).started
    assert set(started) == {second["request_id"], third["request_id"]}


@pytest.fixture
async def buses(nats_server: NatsServer) -> AsyncIterator[tuple[Bus, Bus]]:
    """Two connections, as two gateways hold."""
    pair = Bus(BusSettings(nats_url=nats_server.url)), Bus(BusSettings(nats_url=nats_server.url))
    for bus in pair:
        await bus.connect()
    try:
        yield pair
    finally:
        for bus in pair:
            await bus.close()


def _in_flight(bus: Bus, limit: int | None) -> InFlight:
    return InFlight(bus, Quotas(bus, Limits(max_concurrent_samples=limit)))


async def test_concurrent_admits_from_two_gateways_take_exactly_the_limit(
    buses: tuple[Bus, Bus],
) -> None:
    limit, n = 5, 40
    gateways = [_in_flight(bus, limit) for bus in buses]
    now = time.time()
    results = await asyncio.gather(
        *(gateways[i % 2].admit(TENANT, f"req-{i}", limit, now) for i in range(n)),
        return_exceptions=True,
    )
    admitted = [f"req-{i}" for i, result in enumerate(results) if result is None]
    assert len(admitted) == limit
    assert all(isinstance(r, RateLimited) for r in results if r is not None)
    entry = await buses[0].get(subjects.BUCKET_USAGE, in_flight_key(TENANT))
    assert entry is not None
    assert sorted(records.decode(entry, InFlightSamples).started) == sorted(admitted)

    # released on either gateway, admitted on the other
    await gateways[1].done(TENANT, admitted[0])
    await gateways[0].admit(TENANT, "req-next", limit, time.time())
    with pytest.raises(RateLimited):
        await gateways[1].admit(TENANT, "req-over", limit, time.time())


async def test_the_count_costs_nothing_without_the_limit_and_expires(
    buses: tuple[Bus, Bus],
) -> None:
    """A tenant without the limit never touches its entry; a release of what is not counted
    writes nothing; a request admitted longer than `ttl_s` ago no longer counts."""
    bus = buses[0]
    quotas = Quotas(bus, Limits())
    await quotas.set(QuotaRecord(tenant_id=TENANT, max_concurrent_samples=1))
    in_flight = InFlight(bus, quotas, ttl_s=600.0)
    free = "free"

    await in_flight.admit(free, "req-free", None, time.time())
    await in_flight.done(free, "req-free")
    await in_flight.done(TENANT, "req-never")  # no entry yet: nothing is created
    assert await bus.entry(subjects.BUCKET_USAGE, in_flight_key(free)) is None
    assert await bus.entry(subjects.BUCKET_USAGE, in_flight_key(TENANT)) is None

    await in_flight.admit(TENANT, "req-old", 1, time.time() - 601.0)  # never fetched
    first = await bus.entry(subjects.BUCKET_USAGE, in_flight_key(TENANT))
    await in_flight.done(TENANT, "req-unknown")
    assert await bus.entry(subjects.BUCKET_USAGE, in_flight_key(TENANT)) == first  # unwritten
    await in_flight.admit(TENANT, "req-new", 1, time.time())  # the old one expired
    entry = await bus.get(subjects.BUCKET_USAGE, in_flight_key(TENANT))
    assert entry is not None
    assert list(records.decode(entry, InFlightSamples).started) == ["req-new"]
