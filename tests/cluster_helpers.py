"""What the end-to-end tests read of a running cluster and kill: KV records, shard owners, the
pids of the processes `up` runs (workers, gateway, NATS nodes), the ops stream's leader, a
checkpoint's adapter in the store, the Prometheus series of a `/metrics` endpoint, and a second
gateway over the same cluster."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import numpy as np
import safetensors.numpy
from prometheus_client.parser import text_string_to_metric_families

from protocol import records, subjects, topology
from protocol.records import CheckpointRecord, LeaseRecord
from tests.conftest import API_KEY, Cluster


async def kv_get(nats_url: str, bucket: str, key: str, within_s: float = 60.0) -> bytes | None:
    """A KV value; retried while the cluster elects a leader (a node was just killed)."""
    deadline = time.monotonic() + within_s
    nc = await nats.connect(servers=topology.nats_servers(nats_url))
    try:
        while True:
            try:
                kv = await nc.jetstream(timeout=5).key_value(bucket)
                return (await kv.get(key)).value
            except nats.js.errors.KeyNotFoundError:
                return None
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.js.errors.ServiceUnavailableError,
                nats.js.errors.NoStreamResponseError,
            ):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def shard_owners(nats_url: str, pool: str) -> dict[int, str]:
    """Shard -> the worker holding its live lease."""
    owners = {}
    for shard in range(subjects.DEFAULT_SHARDS):
        value = await kv_get(nats_url, subjects.BUCKET_LEASES, subjects.lease_key(pool, shard))
        if value:
            lease = records.decode(value, LeaseRecord)
            if lease.expires_at > time.time():
                owners[shard] = lease.worker_id
    return owners


def _children(cluster: Cluster) -> list[tuple[int, list[str]]]:
    found = []
    for children in Path(f"/proc/{cluster.process.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except FileNotFoundError:
                continue
            found.append((int(pid), argv))
    return found


def worker_pids(cluster: Cluster) -> dict[str, int]:
    """Worker id -> pid of each trainer `up` runs now."""
    return {
        argv[argv.index("--worker-id") + 1]: pid
        for pid, argv in _children(cluster)
        if "workers" in argv and "--worker-id" in argv
    }


def children_of(parent: int) -> dict[int, str]:
    """Live child processes of `parent` (a zombie nobody reaped counts as gone): pid -> command
    line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found[int(entry.name)] = cmdline
    return found


def pids_of(cluster: Cluster) -> dict[str, set[int]]:
    """`up`'s children by kind: nats-server, gateway, worker."""
    kinds: dict[str, set[int]] = {"nats": set(), "gateway": set(), "worker": set()}
    for pid, cmdline in children_of(cluster.process.pid).items():
        if "nats-server" in cmdline:
            kinds["nats"].add(pid)
        elif "twinkle_async gateway" in cmdline:
            kinds["gateway"].add(pid)
        elif "-m workers" in cmdline:
            kinds["worker"].add(pid)
    return kinds


def node_pid(cluster: Cluster, server_name: str) -> int | None:
    """The pid of a NATS node `up` runs now (its config lives in `nats/<name>/`), None if none."""
    conf = str(cluster.data_dir / "nats" / server_name / "nats.conf")
    return next((pid for pid, argv in _children(cluster) if conf in argv), None)


async def ops_stream(nats_url: str) -> tuple[str, int, int]:
    """(leader, replicas, peers current) of the ops stream."""
    nc = await nats.connect(servers=topology.nats_servers(nats_url))
    try:
        info = await nc.jetstream(timeout=10).stream_info(subjects.STREAM_OPS)
        assert info.cluster is not None and info.cluster.leader
        current = sum(bool(peer.current) for peer in info.cluster.replicas or [])
        return info.cluster.leader, info.config.num_replicas or 1, current
    finally:
        await nc.close()


def checkpoint_record(cluster: Cluster, path: str) -> CheckpointRecord:
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    key = subjects.checkpoint_key(run_id, f"{kind}/{name}")
    value = asyncio.run(kv_get(cluster.nats_url, subjects.BUCKET_CHECKPOINTS, key))
    assert value is not None, path
    return records.decode(value, CheckpointRecord)


def stored_adapter(
    store_url: str, env: dict[str, str], cluster: Cluster, path: str
) -> dict[str, np.ndarray]:
    """A checkpoint's adapter, read back from the artifact store (through a fresh cache)."""
    from workers.artifacts import ArtifactStore

    record = checkpoint_record(cluster, path)
    assert record.store_key and not record.directory and record.sha256
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        store = ArtifactStore(store_url, cluster.data_dir / f"test-cache-{time.time_ns()}")
        directory = store.download(record.store_key)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return safetensors.numpy.load_file(str(directory / "adapter_model.safetensors"))


def in_store(store_url: str, env: dict[str, str], cluster: Cluster, prefix: str) -> bool:
    """Whether any object of the artifact store lies under `prefix/`."""
    from workers.artifacts import ArtifactStore

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return ArtifactStore(store_url, cluster.data_dir / "test-cache").exists(prefix)
    finally:
        os.environ.clear()
        os.environ.update(saved)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus text endpoint (a gateway's or a worker's `/metrics`)."""
    resp = httpx.get(url, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def reader(found: Samples) -> Callable[..., float]:
    """`value(name, **labels)` of the scraped samples; 0.0 for a series not there."""

    def value(name: str, **labels: str) -> float:
        return found.get((name, frozenset(labels.items())), 0.0)

    return value


@dataclass
class Gateway:
    base_url: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_gateway(
    cluster: Cluster, *extra: str, env: dict[str, str], timeout_s: float = 90.0
) -> Gateway:
    """Another gateway over the cluster's NATS, with its key file (the same tenants); `env`
    should hold the `TWINKLE_DOWNLOAD_SECRET` the cluster's gateway was given."""
    ready = cluster.data_dir / f"gateway-{time.time_ns()}.json"
    log = open(ready.with_suffix(".log"), "wb")  # noqa: SIM115 - closed by the child's exit
    cmd = [
        *(sys.executable, "-m", "twinkle_async", "gateway"),
        *("--nats-url", cluster.nats_url, "--host", "127.0.0.1", "--port", "0"),
        *("--ready-file", str(ready), "--api-key", API_KEY),
        *("--key-file", str(cluster.data_dir / "keys.txt"), "--checkpoint-sweep-s", "0"),
        *extra,
    ]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"gateway failed to start:\n{Path(log.name).read_text()[-4000:]}")
        time.sleep(0.05)
    return Gateway(json.loads(ready.read_text())["base_url"], process)
