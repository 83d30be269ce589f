"""Failover figures of the multi-host setup, on loopback: what a tenant's steps cost while a NATS
node dies, and what the artifact store costs a checkpoint.

Starts `twinkle-async up --nats-cluster 3 --workers 2 --artifact-store s3://...` (three NATS
nodes with replicas 3, two trainers with data directories of their own) against a real S3
server (SeaweedFS), and a tiny random Qwen3. Tenants train with one step (forward_backward +
optim_step, results awaited) after another; each phase prints the p50 and p99 step latency and
the longest stall:
1. `quiet`: nothing happens;
2. `nats-sigkill`: the node leading the ops stream is SIGKILLed mid-phase (`up` restarts it);
3. `nats-sigterm`: the same with SIGTERM (a node stopped on purpose);
4. `worker-sigkill`: the worker owning the most shards is SIGKILLed; its tenants' longest stall
   is the takeover time with the store (lease expiry + snapshot from S3 + replay).
Then, in process, checkpoint files of `--checkpoint-mb` (100 MB by default): save and load MB/s
to a local directory (write + fsync, read) against the S3 store (upload, download through a
cold cache), median of three.

    .venv/bin/python bench/failover.py [--tenants 3] [--steps 30] [--lease-s 12]

Figures are printed, not asserted; they depend on the machine (say which when quoting them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test harnesses: the S3 server and the cluster helpers

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from protocol import subjects  # noqa: E402
from tests.cluster_helpers import node_pid, ops_stream, shard_owners, worker_pids  # noqa: E402
from tests.conftest import Cluster, build_model, start_cluster, stop_cluster  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402

STORE = "s3://twinkle/bench"


def _batch(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 200, size=33).tolist()
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32},
        )
    ]


def _phase(
    name: str,
    clients: dict[int, tinker.TrainingClient],
    steps: int,
    action: Callable[[], None] | None = None,
) -> dict[int, list[tuple[float, float]]]:
    """Each tenant's (start, latency) of `steps` steps; `action()` runs once every tenant has
    done a third of them."""
    done: dict[int, list[tuple[float, float]]] = {seed: [] for seed in clients}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        batch = _batch(seed)
        try:
            for _ in range(steps):
                start = time.monotonic()
                client = clients[seed]
                fwd = client.forward_backward(batch, "cross_entropy")
                opt = client.optim_step(types.AdamParams(learning_rate=1e-3))
                fwd.result()
                opt.result()
                done[seed].append((start, time.monotonic() - start))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in clients]
    for thread in threads:
        thread.start()
    if action is not None:
        while min(len(d) for d in done.values()) < steps // 3 and not errors:
            time.sleep(0.02)
        action()
    for thread in threads:
        thread.join()
    if errors:
        raise SystemExit(f"{name}: a step failed: {errors[0]!r}")
    return done


def _report(name: str, done: dict[int, list[tuple[float, float]]], seeds: list[int]) -> None:
    latencies = sorted(lat for seed in seeds for _, lat in done[seed])
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(
        f"{name:15s} steps {len(latencies):4d}  p50 {p50 * 1000:7.0f} ms  p99 {p99 * 1000:7.0f} ms"
        f"  longest stall {max(latencies):6.2f} s",
        flush=True,
    )


def _settled(cluster: Cluster) -> None:
    """Wait until all three nodes run and both followers of the ops stream are current."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            _, _, current = asyncio.run(ops_stream(cluster.nats_url))
        except Exception:
            current = 0
        if current == 2 and all(node_pid(cluster, f"n{i}") for i in (1, 2, 3)):
            return
        time.sleep(0.5)
    raise SystemExit("the NATS cluster did not settle")


def _kill_leader(cluster: Cluster, sig: signal.Signals) -> None:
    leader, _, _ = asyncio.run(ops_stream(cluster.nats_url))
    pid = node_pid(cluster, leader)
    assert pid is not None
    os.kill(pid, sig)


def _files_mb_s(tmp: Path, megabytes: int) -> None:
    from workers.artifacts import ArtifactStore

    source = tmp / "adapter"
    source.mkdir()
    payload = np.random.default_rng(0).bytes(megabytes * 1024 * 1024)
    (source / "adapter_model.safetensors").write_bytes(payload)
    (source / "adapter_config.json").write_text('{"r": 64}')
    size_mb = megabytes + 1e-6
    rows: dict[str, list[float]] = {
        k: [] for k in ("local save", "local load", "s3 save", "s3 load")
    }
    for run in range(3):
        target = tmp / f"local-{run}"
        start = time.perf_counter()
        target.mkdir()
        for entry in source.iterdir():
            with open(target / entry.name, "wb") as out:
                out.write(entry.read_bytes())
                out.flush()
                os.fsync(out.fileno())
        rows["local save"].append(size_mb / (time.perf_counter() - start))
        os.sync()
        start = time.perf_counter()
        total = sum(len(entry.read_bytes()) for entry in target.iterdir())
        rows["local load"].append(total / 2**20 / (time.perf_counter() - start))
        store = ArtifactStore(STORE, tmp / f"cache-{run}")
        start = time.perf_counter()
        store.upload(f"bench/weights/big/{run}", source)
        rows["s3 save"].append(size_mb / (time.perf_counter() - start))
        start = time.perf_counter()
        store.download(f"bench/weights/big/{run}")
        rows["s3 load"].append(size_mb / (time.perf_counter() - start))
        shutil.rmtree(target)
    print(
        f"checkpoint files of {megabytes} MB (median of 3; local reads come from the page cache):"
    )
    for name, values in rows.items():
        print(f"  {name:11s} {statistics.median(values):8.0f} MB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lease-s", type=float, default=12.0)
    parser.add_argument("--checkpoint-mb", type=int, default=100)
    parser.add_argument("--keep", action="store_true", help="keep the data and logs")
    parser.add_argument("--phases", default="quiet,nats-sigkill,nats-sigterm,worker-sigkill,files")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", TINKER_TELEMETRY="0")
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-failover-"))
    s3 = S3Server(tmp / "s3")
    s3.start()
    cluster = None
    phases = set(args.phases.split(","))
    failed = True
    try:
        os.environ.update(s3.env)
        model = build_model(tmp / "tiny", "qwen3")
        cluster = start_cluster(
            tmp / "data",
            [model],
            *("--nats-cluster", "3", "--workers", "2", "--artifact-store", STORE),
            env={**s3.env, "TWINKLE_LEASE_S": str(args.lease_s)},
        )
        pool = subjects.pool_of(str(model))
        while len(set(asyncio.run(shard_owners(cluster.nats_url, pool)).values())) < 2:
            time.sleep(0.5)
        service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
        clients = {
            seed: service.create_lora_training_client(base_model=str(model), rank=8).result()
            for seed in range(args.tenants)
        }
        seeds = list(clients)
        print(
            f"{args.tenants} tenants, {args.steps} steps a phase, lease {args.lease_s:.0f} s,"
            f" {os.cpu_count()} CPUs",
            flush=True,
        )
        if "quiet" in phases:
            _report("quiet", _phase("quiet", clients, args.steps), seeds)
        for name, sig in (("nats-sigkill", signal.SIGKILL), ("nats-sigterm", signal.SIGTERM)):
            if name not in phases:
                continue
            _settled(cluster)
            done = _phase(
                name, clients, args.steps, action=lambda s=sig, c=cluster: _kill_leader(c, s)
            )
            _report(name, done, seeds)
        _settled(cluster)
        if "worker-sigkill" not in phases:
            service.close("success").result()
            if "files" in phases:
                _files_mb_s(tmp, args.checkpoint_mb)
            failed = False
            return
        owners = asyncio.run(shard_owners(cluster.nats_url, pool))
        counts = {w: list(owners.values()).count(w) for w in set(owners.values())}
        victim = max(counts, key=lambda w: counts[w])
        on_victim = [
            s for s, c in clients.items() if owners.get(subjects.shard_of(c.model_id)) == victim
        ]
        pid = worker_pids(cluster)[victim]
        done = _phase(
            "worker-sigkill", clients, args.steps, action=lambda: os.kill(pid, signal.SIGKILL)
        )
        _report("worker-sigkill", done, seeds)
        if on_victim:
            _report("  its tenants", done, on_victim)
        service.close("success").result()
        if "files" in phases:
            _files_mb_s(tmp, args.checkpoint_mb)
        failed = False
    finally:
        if cluster is not None:
            stop_cluster(cluster)
        s3.stop()
        if failed or args.keep:
            print(f"kept {tmp} (the cluster's log: {tmp / 'data.log'})", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
