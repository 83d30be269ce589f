"""Kill a process, lose nothing: `twinkle-async up` as a child, real processes killed for real,
the official SDK training through it.

- a SIGKILLed worker is restarted (new pid, a fresh heartbeat), and the cluster trains again;
- a SIGKILLed gateway comes back on the same port while an SDK loop runs; the loop finishes
  with exactly the numbers of an uninterrupted run (nothing applied twice);
- NATS down for 20 s under `up --nats-url`: every process stays up, the loop finishes with the
  uninterrupted run's numbers, and the only 5xx the gateway answered is 503;
- a SIGKILLed `up` leaves no child behind.

The worker-state side (an in-flight model surviving a worker kill) is tested elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from protocol import records, subjects
from protocol.records import WorkerRecord
from tests.cluster_helpers import pids_of
from tests.conftest import Cluster, start_cluster, stop_cluster
from tests.sdk_helpers import kv_values, n_targets, toy_batch
from tests.wait_helpers import wait_until
from twinkle_async.nats_server import NatsServer

pytestmark = pytest.mark.e2e


# -- processes, as /proc shows them ----------------------------------------------------------


def _alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# -- training --------------------------------------------------------------------------------


def train(
    client: tinker.TrainingClient,
    batch: list[types.Datum],
    steps: int,
    after_step: Callable[[int], None] = lambda step: None,
) -> tuple[list[float], list[np.ndarray]]:
    """`sdk_helpers.train_steps` (pipelined: step i+1 is sent before step i is read) with a
    hook after each step's results are read; then the trained model's logprobs on `batch`."""
    n = n_targets(batch)
    pending: list[tuple[object, object]] = []
    losses: list[float] = []

    def read(fwd: object, opt: object) -> None:
        losses.append(fwd.result().metrics["loss:sum"] / n)  # type: ignore[attr-defined]
        opt.result()  # type: ignore[attr-defined]
        after_step(len(losses))

    for _ in range(steps):
        fwd = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=1e-2))
        pending.append((fwd, opt))
        if len(pending) > 1:
            read(*pending.pop(0))
    for fwd, opt in pending:
        read(fwd, opt)
    out = client.forward(batch, "cross_entropy").result()
    logprobs = [np.asarray(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]
    return losses, logprobs


def assert_same_run(
    a: tuple[list[float], list[np.ndarray]], b: tuple[list[float], list[np.ndarray]]
) -> None:
    assert len(a[0]) == len(b[0])
    assert max(abs(x - y) for x, y in zip(a[0], b[0], strict=True)) <= 1e-5, (a[0], b[0])
    for x, y in zip(a[1], b[1], strict=True):
        assert np.max(np.abs(x - y)) <= 1e-5


def new_client(
    cluster: Cluster, tiny_model: Path, seed: int
) -> tuple[tinker.ServiceClient, tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=seed
    ).result()
    return service, client


# -- one supervised cluster (its own nats-server) for the kill tests ---------------------------


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    running = start_cluster(tmp_path_factory.mktemp("supervised") / "data", [tiny_model])
    try:
        yield running
    finally:
        stop_cluster(running)


def test_a_killed_gateway_returns_on_its_port_and_the_loop_finishes_exactly(
    supervised: Cluster, tiny_model: Path
) -> None:
    batch = toy_batch(seed=11)
    service, client = new_client(supervised, tiny_model, seed=21)
    reference = train(client, batch, 10)
    service.close("success").result()

    (gateway,) = pids_of(supervised)["gateway"]

    def kill_gateway(step: int) -> None:
        if step == 3:  # the next step's requests are already in flight
            os.kill(gateway, signal.SIGKILL)

    service, client = new_client(supervised, tiny_model, seed=21)
    interrupted = train(client, batch, 10, after_step=kill_gateway)
    service.close("success").result()

    assert not _alive(gateway)
    (restarted,) = pids_of(supervised)["gateway"]
    assert restarted != gateway
    assert httpx.get(f"{supervised.base_url}/healthz").status_code == 200  # the same base URL
    assert_same_run(reference, interrupted)
    # the run's metric history, read through the new gateway: every pass and step once
    history = httpx.get(
        f"{supervised.base_url}/api/v1/training_runs/{client.model_id}/metrics",
        headers={"X-API-Key": supervised.api_key},
        timeout=30,
    )
    assert history.status_code == 200, history.text
    steps = history.json()["steps"]
    passes = [
        s["metrics"]["loss:sum"] / n_targets(batch)
        for s in steps
        if s["kind"] == "forward_backward"
    ]
    assert passes == pytest.approx(interrupted[0], abs=1e-6)
    assert sum(s["kind"] == "optim_step" for s in steps) == 10
    assert len({s["step"] for s in steps}) == len(steps)


async def _fresh_heartbeat(nats_url: str, worker_ids: set[str], since: float) -> bool:
    """A heartbeat written after `since` by one of `worker_ids` (a restarted trainer keeps its
    id: `up` gives each a stable one)."""
    for value in await kv_values(nats_url, subjects.BUCKET_WORKERS):
        record = records.decode(value, WorkerRecord)
        if record.worker_id in worker_ids and record.heartbeat_at > since:
            return True
    return False


async def _worker_ids(nats_url: str) -> set[str]:
    return {
        records.decode(value, WorkerRecord).worker_id
        for value in await kv_values(nats_url, subjects.BUCKET_WORKERS)
    }


async def test_a_killed_worker_is_restarted_and_the_cluster_trains(
    supervised: Cluster, tiny_model: Path
) -> None:
    (worker,) = pids_of(supervised)["worker"]
    old_ids = await _worker_ids(supervised.nats_url)
    killed_at = time.time()
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not await _fresh_heartbeat(supervised.nats_url, old_ids, killed_at):
        assert time.monotonic() < deadline, "no heartbeat from the restarted worker"
        await asyncio.sleep(0.2)
    (restarted,) = pids_of(supervised)["worker"]
    assert restarted != worker and not _alive(worker)

    def train_anew() -> list[float]:
        assert httpx.get(f"{supervised.base_url}/healthz").status_code == 200
        service, client = new_client(supervised, tiny_model, seed=5)
        try:
            return train(client, toy_batch(n=2), 3)[0]
        finally:
            service.close("success").result()

    losses = await asyncio.to_thread(train_anew)
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_a_killed_up_takes_every_child_with_it(supervised: Cluster) -> None:
    kinds = pids_of(supervised)
    assert all(len(pids) == 1 for pids in kinds.values()), kinds
    supervised.process.kill()
    supervised.process.wait()
    left = {pid for pids in kinds.values() for pid in pids}
    wait_until(lambda: not any(_alive(pid) for pid in left), 5.0, "every child gone")


# -- NATS away for 20 s, under `up --nats-url` ---------------------------------------------------


def _gateway_statuses(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "twinkle_gateway_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                status = sample.labels["status"]
                counts[status] = counts.get(status, 0.0) + sample.value
    return counts


def test_a_20_s_nats_outage_loses_nothing(tmp_path: Path, tiny_model: Path) -> None:
    nats_server = NatsServer(tmp_path / "nats")
    nats_server.start()  # the port it picked is pinned: the restart below listens there too
    cluster = None
    try:
        cluster = start_cluster(tmp_path / "data", [tiny_model], "--nats-url", nats_server.url)
        assert pids_of(cluster)["nats"] == set()
        batch = toy_batch(seed=12)
        service, client = new_client(cluster, tiny_model, seed=22)
        reference = train(client, batch, 10)
        service.close("success").result()

        before = pids_of(cluster)
        outage: list[threading.Timer] = []

        def take_nats_away(step: int) -> None:
            if step == 3:
                nats_server.kill()
                outage.append(threading.Timer(20.0, nats_server.start))
                outage[0].start()

        service, client = new_client(cluster, tiny_model, seed=22)
        interrupted = train(client, batch, 10, after_step=take_nats_away)
        service.close("success").result()
        outage[0].join()

        assert cluster.process.poll() is None
        assert pids_of(cluster) == before  # nothing died, nothing was restarted
        assert_same_run(reference, interrupted)
        statuses = _gateway_statuses(cluster.base_url)
        assert {s for s in statuses if s.startswith("5")} <= {"503"}, statuses
        assert statuses.get("503", 0) >= 1, statuses  # the outage was seen, and answered 503
    finally:
        if cluster is not None:
            stop_cluster(cluster)
        nats_server.stop()
