"""The service spread over several hosts, on loopback: three NATS nodes with replicas 3, an S3
server (SeaweedFS), two trainer workers each with a data directory of its own and no shared
disk, and two gateways. Four tenants train through the official SDK, two through each gateway,
with pipelined steps and a `save_state` midway; the NATS node leading the ops stream is
SIGKILLed, then the worker owning the most shards. Every future resolves without an error and
every adapter ends where an undisturbed run ends; a checkpoint saved by the killed worker
resumes with its optimizer on the other; a sampler checkpoint saved through one gateway samples
through the other; both gateways' download URLs fetch the files; copies and deletes happen in
the store."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import tarfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
import safetensors.numpy
import tinker
from tinker import types

from protocol import subjects
from tests.cluster_helpers import (
    Gateway,
    checkpoint_record,
    in_store,
    node_pid,
    ops_stream,
    shard_owners,
    start_gateway,
    stored_adapter,
    worker_pids,
)
from tests.conftest import ADMIN_KEY, Cluster, start_cluster, stop_cluster
from tests.s3_server import S3Server
from tests.sdk_helpers import toy_batch

pytestmark = pytest.mark.e2e

STORE = "s3://twinkle/multi-host"
SECRET = "shared-download-secret-of-both-gateways"
STEPS = 16
MIDDLE = 4  # the step after which each tenant saves its state
TENANTS = {  # seed -> API key; the first two train through one gateway, the others the other
    41: "tml-cluster-tenant-a-0000000000",
    42: "tml-cluster-tenant-b-0000000000",
    43: "tml-cluster-tenant-c-0000000000",
    44: "tml-cluster-tenant-d-0000000000",
}


@pytest.fixture(scope="module")
def env(s3: S3Server) -> dict[str, str]:
    # a short lease: a worker's death is noticed in seconds (it still outlasts an election)
    return {**s3.env, "TWINKLE_DOWNLOAD_SECRET": SECRET, "TWINKLE_LEASE_S": "12"}


@pytest.fixture(scope="module")
def spread(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[tuple[Cluster, Gateway]]:
    running = start_cluster(
        tmp_path_factory.mktemp("multi-host") / "data",
        [tiny_model],
        *("--nats-cluster", "3", "--workers", "2", "--artifact-store", STORE),
        *("--token-budget", "512"),
        env={**env, "TWINKLE_SNAPSHOT_EVERY": "3", "TWINKLE_SNAPSHOT_MIN_S": "0"},
        keys={key: f"tenant-{seed}" for seed, key in TENANTS.items()},
    )
    try:
        other = start_gateway(running, "--nats-replicas", "3", "--artifact-store", STORE, env=env)
        try:
            yield running, other
        finally:
            other.stop()
    finally:
        stop_cluster(running)


def _train(
    client: tinker.TrainingClient,
    seed: int,
    progress: dict[int, int],
    saved: dict[int, str] | None = None,
    gate: threading.Event | None = None,
) -> str:
    """`STEPS` pipelined steps on the tenant's own data, a `save_state("middle")` after step
    `MIDDLE` when `saved` is given; then `save_state("final")`, whose path it returns. With a
    `gate`, the loop waits for it before step `STEPS - 3`, so however slowly the test gets to its
    crash, the tenant still has steps in flight and to come when it happens."""
    batch = toy_batch(n=3, seed=seed)
    previous = None
    middle = None
    for step in range(STEPS):
        if gate is not None and step == STEPS - 3:
            assert gate.wait(timeout=300), "the test never opened the gate"
        current = (
            client.forward_backward(batch, "cross_entropy"),
            client.optim_step(types.AdamParams(learning_rate=2e-2)),
        )
        if saved is not None and step == MIDDLE - 1:
            middle = client.save_state("middle")
        if previous is not None:
            previous[0].result()
            previous[1].result()
            progress[seed] = step
        previous = current
        time.sleep(0.3)
    assert previous is not None
    previous[0].result()
    previous[1].result()
    if middle is not None and saved is not None:
        saved[seed] = str(middle.result().path)
    return str(client.save_state("final").result().path)


def _in_threads(
    clients: dict[int, tinker.TrainingClient],
    progress: dict[int, int],
    saved: dict[int, str] | None = None,
    gate: threading.Event | None = None,
) -> tuple[list[threading.Thread], dict[int, str], list[BaseException]]:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            results[seed] = _train(clients[seed], seed, progress, saved, gate)
        except BaseException as err:  # reported by the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in clients]
    for thread in threads:
        thread.start()
    return threads, results, errors


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0, err_msg=key)


def _transfer(admin: httpx.Client, answer: httpx.Response) -> dict[str, Any]:
    """An admin transfer's answer once its worker is done."""
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    deadline = time.monotonic() + 300
    while body["state"] == "pending":
        assert time.monotonic() < deadline, body
        polled = admin.get(f"/admin/v1/transfers/{body['request_id']}")
        assert polled.status_code == 200, polled.text
        body = polled.json()
    return body


def _assert_merged(
    merged: dict[str, np.ndarray], base: Path, adapter: dict[str, np.ndarray], config: bytes
) -> None:
    """Every adapted linear of the merged model is `W + alpha/r · B·A` of the base weight."""
    scale = json.loads(config)["lora_alpha"] / json.loads(config)["r"]
    original = safetensors.numpy.load_file(str(base / "model.safetensors"))
    checked = 0
    for key, a in adapter.items():
        if not key.endswith(".lora_A.weight") or "lm_head" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = adapter[key.replace("lora_A", "lora_B")]
        want = original[name] + scale * (b @ a)
        np.testing.assert_allclose(merged[name], want, atol=1e-5, rtol=0, err_msg=name)
        checked += 1
    assert checked


def _wait_for(
    progress: dict[int, int],
    step: int,
    errors: list[BaseException],
    seeds: list[int] | None = None,
) -> None:
    deadline = time.monotonic() + 180
    while min(progress.get(seed, 0) for seed in seeds or TENANTS) < step:
        assert not errors, errors
        assert time.monotonic() < deadline, f"training never reached step {step}: {progress}"
        time.sleep(0.05)


def test_two_gateways_two_hosts_through_a_nats_and_a_worker_crash(
    spread: tuple[Cluster, Gateway], env: dict[str, str], tiny_model: Path
) -> None:
    cluster, other = spread
    pool = subjects.pool_of(str(tiny_model))
    services = {
        seed: tinker.ServiceClient(
            base_url=cluster.base_url if index < 2 else other.base_url, api_key=key
        )
        for index, (seed, key) in enumerate(TENANTS.items())
    }

    def adapter(path: str) -> dict[str, np.ndarray]:
        return stored_adapter(STORE, env, cluster, path)

    def new_clients() -> dict[int, tinker.TrainingClient]:
        return {
            seed: service.create_lora_training_client(
                base_model=str(tiny_model), rank=4, seed=seed
            ).result()
            for seed, service in services.items()
        }

    gate = threading.Event()  # opened once both crashes have happened (or the test failed)
    try:
        deadline = time.monotonic() + 90
        while len(set(asyncio.run(shard_owners(cluster.nats_url, pool)).values())) < 2:
            assert time.monotonic() < deadline, "the two workers never shared the shards"
            time.sleep(0.5)

        # undisturbed
        threads, reference, errors = _in_threads(new_clients(), {})
        for thread in threads:
            thread.join(timeout=300)
        assert not errors, errors
        want = {seed: adapter(path) for seed, path in reference.items()}

        # the same runs through a NATS node's death, then a worker's
        clients = new_clients()
        progress: dict[int, int] = {}
        middles: dict[int, str] = {}
        threads, results, errors = _in_threads(clients, progress, middles, gate)
        _wait_for(progress, 2, errors)
        leader, _, _ = asyncio.run(ops_stream(cluster.nats_url))
        node = node_pid(cluster, leader)
        assert node is not None
        os.kill(node, signal.SIGKILL)
        # the worker training the most of these tenants (shards with no tenant on them do not
        # count), once its tenants have saved their middle state
        # (while the NATS cluster elects new leaders, renewals wait and a lease may lapse for a
        # moment before its owner renews it)
        deadline = time.monotonic() + 60
        while True:
            owners = asyncio.run(shard_owners(cluster.nats_url, pool))
            trained_on = {
                s: owners.get(subjects.shard_of(c.model_id), "") for s, c in clients.items()
            }
            if all(trained_on.values()):
                break
            assert time.monotonic() < deadline, ("a tenant's shard has no owner", trained_on)
            time.sleep(0.5)
        held = list(trained_on.values())
        victim = max(set(held), key=held.count)
        on_victim = [s for s, worker in trained_on.items() if worker == victim]
        _wait_for(progress, MIDDLE + 1, errors, on_victim)
        os.kill(worker_pids(cluster)[victim], signal.SIGKILL)
        gate.set()
        for thread in threads:
            thread.join(timeout=300)
        assert all(not thread.is_alive() for thread in threads), "a training loop hung"
        assert not errors, errors
        for seed, path in results.items():
            _close(adapter(path), want[seed])

        # a state the killed worker saved resumes with its optimizer on the other worker,
        # through the other gateway
        seed = on_victim[0]
        resumer = tinker.ServiceClient(
            base_url=other.base_url if seed in list(TENANTS)[:2] else cluster.base_url,
            api_key=TENANTS[seed],
        )
        resumed = None
        for _ in range(64):
            candidate = resumer.create_training_client_from_state_with_optimizer(
                middles[seed]
            ).result()
            owner = asyncio.run(shard_owners(cluster.nats_url, pool)).get(
                subjects.shard_of(candidate.model_id)
            )
            if owner is not None and owner != victim:
                resumed = candidate
                break
        assert resumed is not None, "no resumed model landed on the other worker"
        batch = toy_batch(n=3, seed=seed)
        for _ in range(STEPS - MIDDLE):
            resumed.forward_backward(batch, "cross_entropy").result()
            resumed.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        _close(adapter(str(resumed.save_state("resumed").result().path)), want[seed])

        # a sampler checkpoint saved through one gateway samples through the other
        first = list(TENANTS)[0]
        sampler_path = clients[first].save_weights_for_sampler("for-sampling").result().path
        there = tinker.ServiceClient(base_url=other.base_url, api_key=TENANTS[first])
        sampled = (
            there.create_sampling_client(model_path=sampler_path)
            .result()
            .sample(
                types.ModelInput.from_ints([5, 9, 13]),
                num_samples=2,
                sampling_params=types.SamplingParams(max_tokens=6, seed=3),
            )
            .result()
        )
        assert len(sampled.sequences) == 2 and all(s.tokens for s in sampled.sequences)
        resumer.close("success").result()
        there.close("success").result()
    finally:
        gate.set()
        for service in services.values():
            service.close("success").result()


def test_both_gateways_serve_downloads_copies_and_deletes_from_the_store(
    spread: tuple[Cluster, Gateway], env: dict[str, str], tiny_model: Path
) -> None:
    cluster, other = spread
    key = TENANTS[41]
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=key)
    try:
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=4, seed=7
        ).result()
        batch = toy_batch(n=2, seed=7)
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        path = str(client.save_state("shared").result().path)
        export = str(client.save_weights_external("shared-export").result().path)
        record = checkpoint_record(cluster, path)
        saved = stored_adapter(STORE, env, cluster, path)

        for base_url in (cluster.base_url, other.base_url):
            rest = tinker.RestClient(base_url=base_url, api_key=key)
            urls = rest.get_external_weights_urls(export).result().urls
            assert set(urls) == {"adapter_config.json", "adapter_model.safetensors"}
            # presigned by the store: fetched without a key, not through a gateway
            assert all(url.startswith(env["AWS_ENDPOINT_URL"]) for url in urls.values())
            with urllib.request.urlopen(urls["adapter_model.safetensors"], timeout=30) as got:
                weights = got.read()
            _close(safetensors.numpy.load(weights), saved)
            run = quote(client.model_id, safe=":")
            with httpx.Client(base_url=base_url, headers={"X-API-Key": key}) as http:
                redirect = http.get(
                    f"/api/v1/training_runs/{run}/checkpoints/weights/shared/archive"
                )
            assert redirect.status_code == 302, redirect.text
            # a gateway's signed URL, honoured by the other gateway too (one shared secret)
            swapped = redirect.headers["Location"].replace(
                base_url, other.base_url if base_url == cluster.base_url else cluster.base_url
            )
            for location in (redirect.headers["Location"], swapped):
                archive = httpx.get(location, timeout=30)
                assert archive.status_code == 200, archive.text
                with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
                    assert set(urls) <= set(tar.getnames())  # and the optimizer state
                    member = tar.extractfile("adapter_model.safetensors")
                    assert member is not None
                    _close(safetensors.numpy.load(member.read()), saved)

        # an operator's adapter export: presigned URLs of the store; what needs a worker (a
        # merged export, an import) goes through the store too: the worker reads the
        # checkpoint from it and puts its files there, and the gateway presigns them
        with httpx.Client(
            base_url=cluster.base_url, headers={"X-Admin-Key": ADMIN_KEY}, timeout=60
        ) as admin:
            exported = admin.post("/admin/v1/checkpoints/export", json={"path": path}).json()
            assert exported["state"] == "done", exported
            by_name = {f["name"]: f for f in exported["files"]}
            fetched = httpx.get(by_name["adapter_model.safetensors"]["url"]).content
            assert by_name["adapter_model.safetensors"]["size"] == len(fetched)
            _close(safetensors.numpy.load(fetched), saved)
            adapter_config = httpx.get(by_name["adapter_config.json"]["url"]).content

            merged = _transfer(
                admin,
                admin.post("/admin/v1/checkpoints/export", json={"path": path, "merged": True}),
            )
            assert merged["kind"] == "merged", merged
            files = {f["name"]: f for f in merged["files"]}
            assert {"config.json", "model.safetensors"} <= set(files)
            assert all(f["url"].startswith(env["AWS_ENDPOINT_URL"]) for f in files.values())
            weights = httpx.get(files["model.safetensors"]["url"]).content
            assert len(weights) == files["model.safetensors"]["size"]
            _assert_merged(safetensors.numpy.load(weights), tiny_model, saved, adapter_config)
            assert in_store(STORE, env, cluster, f".exports/{merged['export_id']}")
            assert admin.delete(f"/admin/v1/exports/{merged['export_id']}").status_code == 200
            assert not in_store(STORE, env, cluster, f".exports/{merged['export_id']}")
            assert admin.delete(f"/admin/v1/exports/{merged['export_id']}").status_code == 404

            imported = _transfer(
                admin,
                admin.post(
                    "/admin/v1/checkpoints/import",
                    params={"tenant": "tenant-41", "name": "imported"},
                    files={
                        "adapter_config.json": adapter_config,
                        "adapter_model.safetensors": fetched,
                    },
                ),
            )
            assert imported["kind"] == "import", imported
            _close(stored_adapter(STORE, env, cluster, imported["path"]), saved)
            assert not in_store(STORE, env, cluster, ".imports")  # the staged upload is gone

            # an upload the worker refuses, and one over the tenant's room, leave nothing
            # staged in the store
            def upload(name: str, weights: bytes) -> httpx.Response:
                return admin.post(
                    "/admin/v1/checkpoints/import",
                    params={"tenant": "tenant-41", "name": name},
                    files={
                        "adapter_config.json": adapter_config,
                        "adapter_model.safetensors": weights,
                    },
                )

            corrupt = upload("corrupt", b"\x10\x00\x00\x00not safetensors")
            if corrupt.status_code == 200:  # still pending at the first answer
                corrupt = admin.get(f"/admin/v1/transfers/{corrupt.json()['request_id']}")
            assert corrupt.status_code == 400 and "adapter_model" in corrupt.text, corrupt.text
            usage = admin.get("/admin/v1/usage", params={"tenant": "tenant-41"}).json()
            room = usage["usage"][0]["checkpoint_bytes"] + 1000
            quota = {"max_checkpoint_bytes": room}
            assert admin.put("/admin/v1/quotas/tenant-41", json=quota).status_code == 200
            too_big = upload("too-big", fetched)
            assert too_big.status_code == 413 and "over 1000 bytes" in too_big.text, too_big.text
            quota = {"max_checkpoint_bytes": None}
            assert admin.put("/admin/v1/quotas/tenant-41", json=quota).status_code == 200
            assert not in_store(STORE, env, cluster, ".imports")
        # the imported checkpoint trains on, wherever its run lands
        from_import = service.create_training_client_from_state(imported["path"]).result()
        from_import.forward_backward(batch, "cross_entropy").result()

        # a copy is a server-side copy in the store, under a key of its own
        rest = tinker.RestClient(base_url=other.base_url, api_key=key)
        copy = rest.copy_weights(path, "elsewhere").result()
        copied = checkpoint_record(cluster, copy)
        assert copied.store_key and copied.store_key != record.store_key and not copied.directory
        _close(stored_adapter(STORE, env, cluster, copy), saved)

        # deleting removes the objects (the name can be saved again), not the copy
        rest.delete_checkpoint_from_tinker_path(path).result()
        assert str(client.save_state("shared").result().path) == path  # no overwrite needed
        resumed = service.create_training_client_from_state(copy).result()
        _close(
            stored_adapter(STORE, env, cluster, str(resumed.save_state("from-copy").result().path)),
            saved,
        )
    finally:
        service.close("success").result()
