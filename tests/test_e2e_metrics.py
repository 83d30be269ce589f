"""Prometheus metrics of a real cluster, moved by the official SDK: one training step and one
sample, then the gateway's `/metrics` (no API key) and the trainer worker's (its URL read from
the worker's `tw_workers` heartbeat) must show every named series, each one moved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tinker
from tinker import types

from protocol import records, subjects
from protocol.records import WorkerRecord
from tests.cluster_helpers import reader, scrape
from tests.conftest import Cluster
from tests.sdk_helpers import kv_values, toy_batch

pytestmark = pytest.mark.e2e


async def _trainer_record(nats_url: str, base_model: str) -> WorkerRecord:
    for value in await kv_values(nats_url, subjects.BUCKET_WORKERS):
        record = records.decode(value, WorkerRecord)
        if record.base_model == base_model and record.role == "trainer":
            return record
    raise AssertionError(f"no trainer heartbeat for {base_model}")


def test_training_and_sampling_move_every_series(cluster: Cluster, tiny_model: Path) -> None:
    worker = asyncio.run(_trainer_record(cluster.nats_url, str(tiny_model)))
    assert worker.metrics_url.startswith("http://127.0.0.1:"), worker.metrics_url
    gateway_url = f"{cluster.base_url}/metrics"
    gateway_before = reader(scrape(gateway_url))
    worker_before = reader(scrape(worker.metrics_url))

    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
        batch = toy_batch(seed=11)
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = client.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[])
        sample = sampler.sample(
            types.ModelInput.from_ints([7, 19, 23, 42]), num_samples=1, sampling_params=params
        ).result()
        assert sample.sequences and sample.sequences[0].tokens
        slots_while_training = reader(scrape(worker.metrics_url))("twinkle_worker_slots_used")
    finally:
        service.close("success").result()

    gateway_after = reader(scrape(gateway_url))
    worker_after = reader(scrape(worker.metrics_url))

    def gateway_moved(name: str, **labels: str) -> float:
        return gateway_after(name, **labels) - gateway_before(name, **labels)

    def worker_moved(name: str, **labels: str) -> float:
        return worker_after(name, **labels) - worker_before(name, **labels)

    for route in ("/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/asample"):
        labels = {"route": route, "method": "POST", "status": "200"}
        assert gateway_moved("twinkle_gateway_requests_total", **labels) >= 1, route
        assert gateway_moved("twinkle_gateway_request_seconds_count", **labels) >= 1, route
    retrieve = {"route": "/api/v1/retrieve_future", "method": "POST", "status": "200"}
    assert gateway_moved("twinkle_gateway_requests_total", **retrieve) >= 1
    for request_type in ("forward_backward", "optim_step", "sample"):
        submitted = "twinkle_gateway_futures_submitted_total"
        assert gateway_moved(submitted, request_type=request_type) >= 1, request_type
        resolved = "twinkle_gateway_futures_resolved_total"
        assert gateway_moved(resolved, request_type=request_type, state="done") >= 1
    pool = subjects.pool_of(str(tiny_model))
    depth = ("twinkle_gateway_queue_depth", frozenset({("pool", pool), ("queue", "ops")}))
    assert depth in scrape(gateway_url)

    assert worker_moved("twinkle_worker_pass_seconds_count") >= 1
    assert worker_moved("twinkle_worker_pass_tenants_count") >= 1
    assert worker_moved("twinkle_worker_tokens_total") >= sum(
        len(datum.model_input.to_ints()) for datum in batch
    )
    assert worker_after("twinkle_worker_last_pass_tokens_per_second") > 0
    assert worker_moved("twinkle_worker_optim_step_seconds_count") >= 1
    assert worker_moved("twinkle_worker_cycle_seconds_count") >= 1
    assert slots_while_training >= 1
    assert worker_after("twinkle_worker_slots_total") == 48  # the cluster's --max-slots
    ops = "twinkle_worker_ops_total"
    assert worker_moved(ops, kind="forward_backward", outcome="done") >= 1
    assert worker_moved(ops, kind="optim_step", outcome="done") >= 1
    assert worker_moved("twinkle_sampler_requests_total", outcome="done") >= 1
    assert worker_moved("twinkle_sampler_generated_tokens_total") > 0
    assert worker_moved("twinkle_sampler_batch_seconds_count") >= 1
