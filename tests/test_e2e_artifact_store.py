"""Checkpoints and snapshots in an S3 object store, no shared disk: `up --workers 2
--artifact-store s3://...` against a real S3 server (SeaweedFS on loopback), each trainer with a
data directory of its own. A checkpoint saved on one worker resumes with its optimizer state on
the other; a worker SIGKILLed mid-run is replaced from the snapshot in the store; no checkpoint
or snapshot file lies on a worker's disk."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from protocol import records, subjects
from protocol.records import SnapshotRecord
from tests.cluster_helpers import kv_get, shard_owners, stored_adapter, worker_pids
from tests.conftest import Cluster, start_cluster, stop_cluster
from tests.s3_server import S3Server
from tests.sdk_helpers import toy_batch

pytestmark = pytest.mark.e2e

STORE = "s3://twinkle/cluster"


@pytest.fixture(scope="module")
def stored(
    s3: S3Server, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[Cluster]:
    env = {
        **s3.env,
        "TWINKLE_LEASE_S": "3",
        "TWINKLE_SNAPSHOT_EVERY": "3",
        "TWINKLE_SNAPSHOT_MIN_S": "0",
    }
    running = start_cluster(
        tmp_path_factory.mktemp("stored") / "data",
        [tiny_model],
        "--workers",
        "2",
        "--artifact-store",
        STORE,
        "--token-budget",
        "512",
        env=env,
    )
    try:
        yield running
    finally:
        stop_cluster(running)


def _steps(client: tinker.TrainingClient, seed: int, steps: int) -> None:
    batch = toy_batch(n=3, seed=seed)
    for _ in range(steps):
        fwd = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=2e-2))
        fwd.result()
        opt.result()


def _adapter(s3: S3Server, cluster: Cluster, path: str) -> dict[str, np.ndarray]:
    return stored_adapter(STORE, s3.env, cluster, path)


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0, err_msg=key)


def test_no_shared_disk_checkpoints_and_takeover(
    s3: S3Server, stored: Cluster, tiny_model: Path
) -> None:
    pool = subjects.pool_of(str(tiny_model))
    service = tinker.ServiceClient(base_url=stored.base_url, api_key=stored.api_key)
    try:
        deadline = time.monotonic() + 90
        while len(set(asyncio.run(shard_owners(stored.nats_url, pool)).values())) < 2:
            assert time.monotonic() < deadline, "the two workers never shared the shards"
            time.sleep(0.5)
        owners = asyncio.run(shard_owners(stored.nats_url, pool))

        def client_on(
            worker: str | None, seed: int, avoid: str | None = None
        ) -> tinker.TrainingClient:
            for _ in range(64):
                client = service.create_lora_training_client(
                    base_model=str(tiny_model), rank=4, seed=seed
                ).result()
                owner = owners.get(subjects.shard_of(client.model_id))
                if (worker is None or owner == worker) and owner != avoid:
                    return client
            raise AssertionError("no model landed on the wanted worker")

        # 1. saved on one worker, resumed with its optimizer on the other
        first = client_on(None, 31)
        saver = owners[subjects.shard_of(first.model_id)]
        _steps(first, 31, 3)
        middle = str(first.save_state("middle").result().path)
        _steps(first, 31, 2)
        straight = str(first.save_state("straight").result().path)
        resumed = None
        for _ in range(64):
            candidate = service.create_training_client_from_state_with_optimizer(middle).result()
            if owners.get(subjects.shard_of(candidate.model_id)) != saver:
                resumed = candidate
                break
        assert resumed is not None, "no resumed model landed on the other worker"
        _steps(resumed, 31, 2)
        _close(
            _adapter(s3, stored, str(resumed.save_state("resumed").result().path)),
            _adapter(s3, stored, straight),
        )

        # 2. a worker killed mid-run: its model carries on from the snapshot in the store
        reference = client_on(None, 32)
        _steps(reference, 32, 6)
        want = _adapter(s3, stored, str(reference.save_state("reference").result().path))
        victim_client = client_on(None, 32)
        victim = owners[subjects.shard_of(victim_client.model_id)]
        _steps(victim_client, 32, 4)  # a snapshot after step 3
        key = subjects.snapshot_key(victim_client.model_id)
        snapshot = asyncio.run(kv_get(stored.nats_url, subjects.BUCKET_RUNS, key))
        assert snapshot is not None
        record = records.decode(snapshot, SnapshotRecord)
        assert record.store_key and not record.directory and record.step >= 3
        os.kill(worker_pids(stored)[victim], signal.SIGKILL)
        _steps(victim_client, 32, 2)
        _close(_adapter(s3, stored, str(victim_client.save_state("after").result().path)), want)

        # nothing of it on any worker's disk
        hosts = stored.data_dir / "hosts"
        assert len(list(hosts.iterdir())) == 2
        for host in hosts.iterdir():
            assert (
                not list((host / "checkpoints").rglob("*.safetensors"))
                if (host / "checkpoints").exists()
                else True
            )
            assert not list(host.glob("artifact-staging/*/*"))
    finally:
        service.close("success").result()
