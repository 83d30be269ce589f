"""A replicated three-node NATS under real training: `up --nats-cluster 3` (replicas 3), tenants
training with pipelined steps through the official SDK, and the node leading the ops stream
SIGKILLed mid-run. Every future resolves without an error, every adapter ends where an
undisturbed run ends, and `up` brings the node back into the cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker

from protocol import topology
from tests.cluster_helpers import node_pid, ops_stream
from tests.conftest import Cluster, saved_adapter, start_cluster, stop_cluster
from tests.sdk_helpers import train_pipelined

pytestmark = pytest.mark.e2e

STEPS = 10
TENANTS = (21, 22, 23)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("nats-cluster") / "data", [tiny_model], "--nats-cluster", "3"
    )
    try:
        yield running
    finally:
        stop_cluster(running)


def test_the_cluster_runs_three_nodes_with_three_replicas(replicated: Cluster) -> None:
    info = json.loads((replicated.data_dir / "ready.json").read_text())
    assert sorted(info["nats_pids"]) == ["n1", "n2", "n3"]
    assert len(topology.nats_servers(replicated.nats_url)) == 3
    _, replicas, current = asyncio.run(ops_stream(replicated.nats_url))
    assert replicas == 3 and current == 2


def test_killing_the_ops_streams_leader_loses_nothing(
    replicated: Cluster, tiny_model: Path
) -> None:
    service = tinker.ServiceClient(base_url=replicated.base_url, api_key=replicated.api_key)
    try:
        reference = {}
        for seed in TENANTS:
            client = service.create_lora_training_client(
                base_model=str(tiny_model), rank=4, seed=seed
            ).result()
            reference[seed] = saved_adapter(
                replicated, train_pipelined(client, seed, STEPS, "reference", pause_s=0.3)
            )

        clients = {
            seed: service.create_lora_training_client(
                base_model=str(tiny_model), rank=4, seed=seed
            ).result()
            for seed in TENANTS
        }
        results: dict[int, str] = {}
        errors: list[BaseException] = []
        progress: dict[int, int] = {}

        def run(seed: int) -> None:
            try:
                results[seed] = train_pipelined(
                    clients[seed], seed, STEPS, "through-a-crash", progress, 0.3
                )
            except BaseException as err:  # reported below
                errors.append(err)

        threads = [threading.Thread(target=run, args=(seed,)) for seed in TENANTS]
        for thread in threads:
            thread.start()
        while min(progress.get(seed, 0) for seed in TENANTS) < 2:
            assert not errors, errors
            time.sleep(0.05)
        leader, _, _ = asyncio.run(ops_stream(replicated.nats_url))
        victim = node_pid(replicated, leader)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        assert max(progress.values()) < STEPS - 2, "killed too late to matter"
        for thread in threads:
            thread.join(timeout=180)
        assert all(not thread.is_alive() for thread in threads), "a training loop hung"
        assert not errors, errors
        for seed, path in results.items():
            got, want = saved_adapter(replicated, path), reference[seed]
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0, err_msg=key)

        # another node leads now; `up` restarted the killed one, which caught up
        deadline = time.monotonic() + 60
        while True:
            new_leader, replicas, current = asyncio.run(ops_stream(replicated.nats_url))
            if current == 2 and node_pid(replicated, leader) not in (None, victim):
                break
            assert time.monotonic() < deadline, (new_leader, current)
            time.sleep(0.5)
        assert replicas == 3
    finally:
        service.close("success").result()
