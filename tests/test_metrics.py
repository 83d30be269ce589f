"""Prometheus series without a cluster: the gateway in-process over a real nats-server (`/metrics`
needs no key, requests are labelled by their route's canonical path, queue depth comes from the
worker consumers' backlog), the futures counters and the long-poll gauge, and a worker's
metrics endpoint with its series."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import nats
import pytest
from nats.js import api as js_api
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from protocol import subjects
from protocol.jobs import Outcome
from protocol.sampling import SampledSequence, SampleOutput
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.gateway.app import serve
from twinkle_async.metrics import GatewayMetrics, queue_of_consumer
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings, GatewaySettings
from workers.metrics import SamplerMetrics, TrainerMetrics, serve_metrics

API_KEY = "tml-metrics-test-key"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text page, keyed by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


@pytest.fixture
async def gateway(nats_server: NatsServer) -> AsyncIterator[str]:
    settings = GatewaySettings(
        host="127.0.0.1",
        port=0,
        api_keys={API_KEY: "tenant-a"},
        bus=BusSettings(nats_url=nats_server.url),
    )
    urls: list[str] = []
    task = asyncio.create_task(serve(settings, on_ready=urls.append))
    await eventually(lambda: bool(urls) or task.done(), timeout_s=30)
    if task.done():
        task.result()
    try:
        yield urls[0]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def scrape(client: httpx.AsyncClient, base_url: str) -> Samples:
    resp = await client.get(f"{base_url}/metrics")  # no API key
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    return samples(resp.text)


async def test_requests_are_counted_by_route_and_status(gateway: str) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{gateway}/healthz")).status_code == 200
        # no key: answered by the auth middleware, still labelled by the route it matched
        run = await client.get(f"{gateway}/api/v1/training_runs/run-secret-123")
        assert run.status_code == 401
        assert (await client.post(f"{gateway}/api/v1/forward_backward")).status_code == 401
        assert (await client.get(f"{gateway}/no/such/page")).status_code == 404
        resp = await client.get(f"{gateway}/metrics")
        found = await scrape(client, gateway)
    assert "run-secret-123" not in resp.text  # the canonical path, never the raw one
    requests = "twinkle_gateway_requests_total"
    assert value(found, requests, route="/healthz", method="GET", status="200") == 1
    run_route = "/api/v1/training_runs/{run_id}"
    assert value(found, requests, route=run_route, method="GET", status="401") == 1
    fwd = {"route": "/api/v1/forward_backward", "method": "POST", "status": "401"}
    assert value(found, requests, **fwd) == 1
    assert value(found, "twinkle_gateway_request_seconds_count", **fwd) == 1
    assert value(found, requests, route="unmatched", method="GET", status="404") == 1
    assert value(found, requests, route="/metrics", method="GET", status="200") == 1
    assert value(found, "twinkle_gateway_long_polls_waiting") == 0


async def test_queue_depth_is_each_pools_unacked_backlog(
    gateway: str, nats_server: NatsServer
) -> None:
    pool = subjects.pool_of("some/model")
    model_id = "model-1"
    shard = subjects.shard_of(model_id)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_consumer(
            subjects.STREAM_OPS,
            js_api.ConsumerConfig(
                durable_name=subjects.consumer_name(pool, shard),
                filter_subject=subjects.shard_filter(pool, shard),
                ack_policy=js_api.AckPolicy.EXPLICIT,
            ),
        )
        await js.add_consumer(
            subjects.STREAM_SAMPLE,
            js_api.ConsumerConfig(
                durable_name=subjects.sample_consumer(pool),
                filter_subject=subjects.sample_subject(pool),
                ack_policy=js_api.AckPolicy.EXPLICIT,
            ),
        )
        for _ in range(2):
            await js.publish(subjects.ops_subject(pool, model_id), b"op")
        await js.publish(subjects.sample_subject(pool), b"sample")
    finally:
        await nc.close()
    async with httpx.AsyncClient(timeout=10) as client:
        found = await scrape(client, gateway)
    assert value(found, "twinkle_gateway_queue_depth", pool=pool, queue="ops") == 2
    assert value(found, "twinkle_gateway_queue_depth", pool=pool, queue="sample") == 1


def test_consumer_names_map_back_to_their_pool() -> None:
    pool = subjects.pool_of("Qwen/Qwen3-0.6B")
    assert queue_of_consumer(subjects.consumer_name(pool, 12)) == (pool, "ops")
    assert queue_of_consumer(subjects.sample_consumer(pool)) == (pool, "sample")
    for other in ("KV_tw_futures", "ops-", "ops-pool-x", "sample-", "watcher-1"):
        assert queue_of_consumer(other) is None


async def test_futures_are_counted_and_long_polls_tracked(nats_server: NatsServer) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    metrics = GatewayMetrics()
    futures = FutureStore(bus, metrics)
    await futures.start()
    read = metrics.registry.get_sample_value
    try:
        await futures.record_pending("req-1", "optim_step", "m-1", "t")
        await futures.record_pending("req-1", "optim_step", "m-1", "t")  # a retried submit
        assert read("twinkle_gateway_futures_submitted_total", {"request_type": "optim_step"}) == 1
        waiting = asyncio.create_task(futures.wait("req-1", timeout_s=20))
        await eventually(lambda: read("twinkle_gateway_long_polls_waiting") == 1)
        await futures.resolve(
            Outcome(request_id="req-1", state="done", request_type="optim_step", tenant_id="t")
        )
        assert (await waiting).state == "done"
        assert read("twinkle_gateway_long_polls_waiting") == 0
        resolved = {"request_type": "optim_step", "state": "done"}
        await eventually(lambda: read("twinkle_gateway_futures_resolved_total", resolved) == 1)
    finally:
        await futures.stop()
        await bus.close()


def test_worker_endpoint_serves_the_processes_series(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    trainer = TrainerMetrics(registry)
    sampler = SamplerMetrics(registry)
    TrainerMetrics()  # another service's series, on a registry of its own: no collision
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/metrics")
        trainer.observe_pass(0.5, tokens=1000, tenants=3)
        trainer.observe_optim_step(0.1)
        trainer.set_slots(used=2, parked=1, total=8)
        trainer.op_finished("forward_backward", "done", None)
        trainer.op_finished("optim_step", "error", "user")
        output = SampleOutput(
            sequences=[SampledSequence(tokens=[1, 2, 3], logprobs=[0.0] * 3, stop_reason="length")]
        )
        sampler.observe_batch(0.2, [output, ValueError("failed")])
        sampler.request_finished("done", None)
        found = samples(httpx.get(server.url, timeout=10).text)
    finally:
        server.close()
    assert value(found, "twinkle_worker_tokens_total") == 1000
    assert value(found, "twinkle_worker_last_pass_tokens_per_second") == 2000
    assert value(found, "twinkle_worker_pass_tenants_sum") == 3
    assert value(found, "twinkle_worker_optim_step_seconds_count") == 1
    assert value(found, "twinkle_worker_slots_used") == 2
    assert value(found, "twinkle_worker_slots_parked") == 1
    ops = "twinkle_worker_ops_total"
    assert value(found, ops, kind="forward_backward", outcome="done") == 1
    assert value(found, ops, kind="optim_step", outcome="user_error") == 1
    assert value(found, "twinkle_sampler_generated_tokens_total") == 3
    assert value(found, "twinkle_sampler_requests_total", outcome="done") == 1
    assert value(found, "twinkle_sampler_batch_seconds_count") == 1
