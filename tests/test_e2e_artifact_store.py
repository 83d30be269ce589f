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

import nats
import numpy as np
import pytest
import safetensors.numpy
import tinker
from tinker import types

from protocol import records, subjects
from protocol.records import CheckpointRecord, LeaseRecord, SnapshotRecord
from tests.conftest import Cluster, start_cluster, stop_cluster
from tests.s3_server import S3Server
from tests.sdk_helpers import toy_batch

pytestmark = pytest.mark.e2e

STORE = "s3://twinkle/cluster"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stored(
    s3: S3Server, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[Cluster]:
    env = {**s3.env, "TWINKLE_LEASE_S": "3", "TWINKLE_SNAPSHOT_EVERY": "3"}
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


async def _kv(nats_url: str, bucket: str, key: str) -> bytes | None:
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(bucket)
        try:
            return (await kv.get(key)).value
        except nats.js.errors.KeyNotFoundError:
            return None
    finally:
        await nc.close()


async def _owners(nats_url: str, pool: str) -> dict[int, str]:
    owners = {}
    for shard in range(subjects.DEFAULT_SHARDS):
        value = await _kv(nats_url, subjects.BUCKET_LEASES, subjects.lease_key(pool, shard))
        if value:
            lease = records.decode(value, LeaseRecord)
            if lease.expires_at > time.time():
                owners[shard] = lease.worker_id
    return owners


def _worker_pids(cluster: Cluster) -> dict[str, int]:
    found = {}
    for children in Path(f"/proc/{cluster.process.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "workers" in argv and "--worker-id" in argv:
                found[argv[argv.index("--worker-id") + 1]] = int(pid)
    return found


def _steps(client: tinker.TrainingClient, seed: int, steps: int) -> None:
    batch = toy_batch(n=3, seed=seed)
    for _ in range(steps):
        fwd = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=2e-2))
        fwd.result()
        opt.result()


def _record(cluster: Cluster, path: str) -> CheckpointRecord:
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    key = subjects.checkpoint_key(run_id, f"{kind}/{name}")
    value = asyncio.run(_kv(cluster.nats_url, subjects.BUCKET_CHECKPOINTS, key))
    assert value is not None, path
    return records.decode(value, CheckpointRecord)


def _adapter(s3: S3Server, cluster: Cluster, path: str) -> dict[str, np.ndarray]:
    """The checkpoint's adapter, read back from the store (through a fresh cache)."""
    from workers.artifacts import ArtifactStore

    record = _record(cluster, path)
    assert record.store_key and not record.directory and record.sha256
    with s3.client_env():
        store = ArtifactStore(STORE, cluster.data_dir / f"test-cache-{time.time_ns()}")
        directory = store.download(record.store_key)
    return safetensors.numpy.load_file(str(directory / "adapter_model.safetensors"))


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
        while len(set(asyncio.run(_owners(stored.nats_url, pool)).values())) < 2:
            assert time.monotonic() < deadline, "the two workers never shared the shards"
            time.sleep(0.5)
        owners = asyncio.run(_owners(stored.nats_url, pool))

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
        snapshot = asyncio.run(_kv(stored.nats_url, subjects.BUCKET_RUNS, key))
        assert snapshot is not None
        record = records.decode(snapshot, SnapshotRecord)
        assert record.store_key and not record.directory and record.step >= 3
        os.kill(_worker_pids(stored)[victim], signal.SIGKILL)
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
