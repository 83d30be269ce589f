"""Crash transparency with real processes: `up --workers 2` runs two trainer workers per base
model (a dense one and a MoE one) that share the model's pool through shard leases; one is SIGKILLed mid-run, the other takes its models over from their
state snapshots and the ops log, and `up` restarts the killed one under its id. Every future
resolves and every adapter ends where an uninterrupted run ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
import pytest
import tinker

from protocol import records, subjects
from protocol.records import LeaseRecord
from tests.conftest import Cluster, saved_adapter, start_cluster, stop_cluster
from tests.sdk_helpers import train_pipelined

pytestmark = pytest.mark.e2e

FAST_TAKEOVER = {
    "TWINKLE_LEASE_S": "3",
    "TWINKLE_SNAPSHOT_EVERY": "3",
    "TWINKLE_SNAPSHOT_MIN_S": "0",
}
STEPS = 12


@pytest.fixture(scope="module")
def pool_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tiny_model_moe: Path
) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("recovery") / "data",
        [tiny_model, tiny_model_moe],
        "--workers",
        "2",
        env=FAST_TAKEOVER,
    )
    try:
        yield running
    finally:
        stop_cluster(running)


def _workers(cluster: Cluster, base_model: Path) -> dict[str, int]:
    """The trainer workers `up` runs for one base model: worker id -> pid (from their command
    lines)."""
    found = {}
    for children in Path(f"/proc/{cluster.process.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "workers" in argv and "--worker-id" in argv and str(base_model) in argv:
                found[argv[argv.index("--worker-id") + 1]] = int(pid)
    return found


async def _leases(nats_url: str, pool: str) -> dict[int, str]:
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(subjects.BUCKET_LEASES)
        owners = {}
        for shard in range(subjects.DEFAULT_SHARDS):
            try:
                entry = await kv.get(subjects.lease_key(pool, shard))
            except Exception:
                continue
            if entry.value:
                lease = records.decode(entry.value, LeaseRecord)
                if lease.expires_at > time.time():
                    owners[shard] = lease.worker_id
        return owners
    finally:
        await nc.close()


def _history(cluster: Cluster, run_id: str) -> list[dict[str, Any]]:
    """The run's metric history once it holds all `STEPS` passes and steps (its entries are
    written as the worker answers)."""
    url = f"{cluster.base_url}/api/v1/training_runs/{run_id}/metrics"
    deadline = time.monotonic() + 30
    while True:
        got = httpx.get(url, headers={"X-API-Key": cluster.api_key}, timeout=30)
        assert got.status_code == 200, got.text
        steps: list[dict[str, Any]] = got.json()["steps"]
        if len(steps) >= 2 * STEPS or time.monotonic() > deadline:
            return steps
        time.sleep(0.5)


@pytest.mark.parametrize("model", ["tiny_model", "tiny_model_moe"])
def test_a_killed_worker_loses_nothing(
    pool_cluster: Cluster, model: str, request: pytest.FixtureRequest
) -> None:
    """For a dense model and a MoE model (expert LoRA in the snapshots and the replay)."""
    cluster = pool_cluster
    tiny_model: Path = request.getfixturevalue(model)
    pool = subjects.pool_of(str(tiny_model))
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        deadline = time.monotonic() + 60
        while len(set(asyncio.run(_leases(cluster.nats_url, pool)).values())) < 2:
            assert time.monotonic() < deadline, "the two workers never shared the shards"
            time.sleep(0.5)
        owners = asyncio.run(_leases(cluster.nats_url, pool))
        workers = _workers(cluster, tiny_model)
        assert set(owners.values()) == set(workers), (owners, workers)
        second_id = sorted(workers)[1]

        # four tenants, at least one trained by the worker about to die
        clients: dict[int, tinker.TrainingClient] = {}
        for seed in range(11, 60):
            client = service.create_lora_training_client(
                base_model=str(tiny_model), rank=4, seed=seed
            ).result()
            on_victim = owners.get(subjects.shard_of(client.model_id)) == second_id
            victims = sum(
                owners.get(subjects.shard_of(c.model_id)) == second_id for c in clients.values()
            )
            if len(clients) < 3 or on_victim or victims:
                clients[seed] = client
            if len(clients) == 4 and victims + on_victim >= 1:
                break
        assert len(clients) == 4

        # the uninterrupted runs of the same seeds and data
        reference = {}
        reference_runs = {}
        for seed in clients:
            client = service.create_lora_training_client(
                base_model=str(tiny_model), rank=4, seed=seed
            ).result()
            reference[seed] = saved_adapter(
                cluster, train_pipelined(client, seed, STEPS, "reference")
            )
            reference_runs[seed] = client.model_id

        results: dict[int, str] = {}
        errors: list[BaseException] = []
        progress: dict[int, int] = {}

        def run(seed: int) -> None:
            try:
                results[seed] = train_pipelined(clients[seed], seed, STEPS, "after-crash", progress)
            except BaseException as err:  # reported below
                errors.append(err)

        threads = [threading.Thread(target=run, args=(seed,)) for seed in clients]
        for thread in threads:
            thread.start()
        # kill mid-run: every tenant some steps in (snapshots taken), steps in flight
        while min(progress.get(seed, 0) for seed in clients) < STEPS // 2:
            assert not errors, errors
            time.sleep(0.05)
        assert max(progress.values()) < STEPS - 1
        os.kill(workers[second_id], signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(timeout=240)
        assert all(not thread.is_alive() for thread in threads), "a training loop hung"
        assert not errors, errors
        assert time.monotonic() - killed_at < 180
        for seed, path in results.items():
            got, want = saved_adapter(cluster, path), reference[seed]
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0, err_msg=key)
        # each run's metric history: every request's entry once, as the uninterrupted run's
        for seed, client in clients.items():
            got, want = _history(cluster, client.model_id), _history(cluster, reference_runs[seed])
            assert [(s["step"], s["kind"]) for s in got] == [(s["step"], s["kind"]) for s in want]
            assert len(got) == 2 * STEPS
            for mine, theirs in zip(got, want, strict=True):
                assert mine["metrics"].keys() == theirs["metrics"].keys()
                for name, value in theirs["metrics"].items():
                    assert mine["metrics"][name] == pytest.approx(value, rel=1e-3), name
        # `up` restarted the killed worker under its id
        restarted = _workers(cluster, tiny_model)
        assert second_id in restarted and restarted[second_id] != workers[second_id]
    finally:
        service.close("success").result()
