"""A worker group with real processes: `up --devices 2` runs one trainer worker over two CPU
ranks (gloo, loopback) on a tiny Qwen3-MoE whose experts are split between them. Through the
official SDK, tenants train there as they train on one device (the session's single-device
cluster, same weights: adapters ≤ 1e-4 apart), the group's torch sampler draws the tokens one
device draws for a seeded request, a sampler checkpoint samples, and a SIGKILL of rank 1
mid-run stops the group as one: `up`
restarts it, its models come back from their snapshots and the ops log, every future resolves
and every adapter ends where an undisturbed run ends. Models move between the group and a
one-device worker of the same pool both ways, through snapshots in one device's layout.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from protocol import subjects
from tests.cluster_helpers import children_of, pids_of, shard_owners
from tests.conftest import Cluster, cluster_log, saved_adapter, start_cluster, stop_cluster
from tests.sdk_helpers import toy_batch, train_pipelined

pytestmark = pytest.mark.e2e

FAST_TAKEOVER = {
    "TWINKLE_LEASE_S": "3",
    "TWINKLE_SNAPSHOT_EVERY": "3",
    "TWINKLE_SNAPSHOT_MIN_S": "0",
}
STEPS = 10
AGAIN = 2  # steps after the group is back


@pytest.fixture(scope="module")
def group_model(tmp_path_factory: pytest.TempPathFactory, tiny_model_moe: Path) -> Path:
    """The session's tiny MoE model under another path: a pool of its own, the same weights."""
    copy = tmp_path_factory.mktemp("group-models") / "tiny-qwen3_moe-group"
    shutil.copytree(tiny_model_moe, copy)
    return copy


@pytest.fixture(scope="module")
def group_cluster(tmp_path_factory: pytest.TempPathFactory, group_model: Path) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("group") / "data",
        [group_model],
        "--devices",
        "2",
        env=FAST_TAKEOVER,
    )
    try:
        yield running
    finally:
        stop_cluster(running)


def _ranks(cluster: Cluster) -> list[int]:
    """Pids of this cluster's group ranks past rank 0: children of its trainer worker (another
    test module's group may run beside it)."""
    return [
        pid
        for worker in pids_of(cluster)["worker"]
        for pid, cmdline in children_of(worker).items()
        if "workers.group.follower" in cmdline
    ]


def _train(cluster: Cluster, base_model: Path, seed: int, rank: int, name: str) -> str:
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    client = service.create_lora_training_client(
        base_model=str(base_model), rank=rank, seed=seed
    ).result()
    return train_pipelined(client, seed, STEPS, name, pause_s=0.0)


def _assert_same(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float = 1e-4
) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=0, err_msg=key)


def test_tenants_train_through_a_group_as_on_one_device(
    group_cluster: Cluster, group_model: Path, cluster: Cluster, tiny_model_moe: Path
) -> None:
    """Two tenants of different ranks, concurrently (shared passes and fused steps over the
    two ranks), against the same seeds and data on one device."""
    tenants = {31: 4, 32: 8}
    paths: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            paths[seed] = _train(group_cluster, group_model, seed, tenants[seed], "group")
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in tenants]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for seed, rank in tenants.items():
        alone = _train(cluster, tiny_model_moe, seed, rank, "one-device")
        _assert_same(saved_adapter(group_cluster, paths[seed]), saved_adapter(cluster, alone))

    # the group samples with its own model (its torch sampler steps on both ranks): a seeded
    # request draws the tokens one device draws, and a sampler checkpoint samples
    prompt = types.ModelInput.from_ints(toy_batch(n=1, seed=31)[0].model_input.to_ints()[:5])
    params = types.SamplingParams(max_tokens=6, seed=5)

    def base_tokens(on: Cluster, model: Path) -> list[list[int]]:
        service = tinker.ServiceClient(base_url=on.base_url, api_key=on.api_key)
        client = service.create_sampling_client(base_model=str(model)).result()
        sampled = client.sample(prompt, num_samples=2, sampling_params=params).result()
        return [list(s.tokens) for s in sampled.sequences]

    assert base_tokens(group_cluster, group_model) == base_tokens(cluster, tiny_model_moe)
    service = tinker.ServiceClient(base_url=group_cluster.base_url, api_key=group_cluster.api_key)
    client = service.create_training_client_from_state(paths[31]).result()
    sampler = client.save_weights_and_get_sampling_client("group-sampler").result()
    sampled = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert [len(s.tokens) for s in sampled.sequences] == [6, 6]


def test_a_long_datum_is_split_over_the_group_and_trains_as_on_one_device(
    group_cluster: Cluster, group_model: Path, cluster: Cluster, tiny_model_moe: Path
) -> None:
    """A datum longer than the pass token budget and `SPLIT_FLOOR` runs split by position over
    the group's two ranks (`workers/engine/context_parallel.py`; rank 0 logs it), and its
    logprobs, loss and trained adapter equal one device's."""
    pattern = np.resize(np.arange(3, 190), 4096 + 1).astype(np.int64)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(pattern[:-1].tolist()),
        loss_fn_inputs={"target_tokens": pattern[1:].tolist(), "weights": [1e-3] * 4096},
    )
    results = {}
    for name, on, model in (
        ("group", group_cluster, group_model),
        ("one", cluster, tiny_model_moe),
    ):
        service = tinker.ServiceClient(base_url=on.base_url, api_key=on.api_key)
        client = service.create_lora_training_client(base_model=str(model), rank=4, seed=3)
        trainer = client.result()
        out = trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = str(trainer.save_state("long").result().path)
        results[name] = (out, saved_adapter(on, path))
        service.close("success").result()
    (group, group_adapter), (one, one_adapter) = results["group"], results["one"]
    assert group.metrics["loss:sum"] == pytest.approx(one.metrics["loss:sum"], rel=1e-5)
    np.testing.assert_allclose(
        group.loss_fn_outputs[0]["logprobs"].tolist(),
        one.loss_fn_outputs[0]["logprobs"].tolist(),
        atol=1e-4,
    )
    _assert_same(group_adapter, one_adapter)
    log = cluster_log(group_cluster).read_text()
    assert "a pass of 1 x 4096 positions split over 2 ranks (2048 each)" in log


def _kill_rank_1_mid_run(
    cluster: Cluster, clients: dict[int, tinker.TrainingClient], name: str
) -> tuple[dict[int, str], int]:
    """Each tenant trains `STEPS` pipelined steps in a thread of its own, and rank 1 of the
    group is SIGKILLed once each is half-way; every loop ends without an error. The saved
    paths, and the pid killed."""
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    progress: dict[int, int] = {}

    def run(seed: int) -> None:
        try:
            results[seed] = train_pipelined(clients[seed], seed, STEPS, name, progress)
        except BaseException as error:  # reported below
            errors.append(error)

    [rank_1] = _ranks(cluster)
    threads = [threading.Thread(target=run, args=(seed,)) for seed in clients]
    for thread in threads:
        thread.start()
    while min(progress.get(seed, 0) for seed in clients) < STEPS // 2:
        assert not errors, errors
        time.sleep(0.05)
    assert max(progress.values()) < STEPS - 1
    os.kill(rank_1, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert all(not thread.is_alive() for thread in threads), "a training loop hung"
    assert not errors, errors
    return results, rank_1


def test_a_killed_rank_stops_its_group_and_loses_nothing(
    group_cluster: Cluster, group_model: Path
) -> None:
    seeds = (41, 42, 43)
    reference = {
        seed: saved_adapter(group_cluster, _train(group_cluster, group_model, seed, 4, "ref"))
        for seed in seeds
    }
    service = tinker.ServiceClient(base_url=group_cluster.base_url, api_key=group_cluster.api_key)
    clients = {
        seed: service.create_lora_training_client(
            base_model=str(group_model), rank=4, seed=seed
        ).result()
        for seed in seeds
    }
    results, rank_1 = _kill_rank_1_mid_run(group_cluster, clients, "after-kill")
    for seed in seeds:
        _assert_same(saved_adapter(group_cluster, results[seed]), reference[seed])
    # `up` started the group again: a new rank 1
    deadline = time.monotonic() + 60
    while (restarted := _ranks(group_cluster)) in ([], [rank_1]):
        assert time.monotonic() < deadline, "the group was not restarted"
        time.sleep(0.5)
    assert len(restarted) == 1


def test_models_move_between_a_group_and_a_single_device_worker(
    group_cluster: Cluster, group_model: Path, tmp_path: Path
) -> None:
    """A one-device worker joins the group's pool and takes half its shards. When the group
    dies (rank 1 SIGKILLed) the one-device worker takes its models over from the snapshots the
    group wrote, and when `up` has started the group again it takes shards back, with models the
    one-device worker snapshotted: the snapshots hold one device's layout either way. Every
    future resolves, every adapter ends where an undisturbed run ends."""
    pool = subjects.pool_of(str(group_model))
    log_file = tmp_path / "single.log"
    single = subprocess.Popen(
        [
            *(sys.executable, "-m", "workers", "--base-model", str(group_model)),
            *("--nats-url", group_cluster.nats_url, "--data-dir", str(group_cluster.data_dir)),
            *("--max-slots", "48", "--max-rank", "16", "--threads", "1", "--sampler", "none"),
            *("--worker-id", "single-device", "--token-budget", "4096"),
        ],
        stdout=log_file.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **FAST_TAKEOVER},
    )
    try:
        deadline = time.monotonic() + 120
        while (
            "single-device" not in asyncio.run(shard_owners(group_cluster.nats_url, pool)).values()
        ):
            assert single.poll() is None, log_file.read_text()[-3000:]
            assert time.monotonic() < deadline, "the one-device worker never took a shard"
            time.sleep(0.5)
        owners = asyncio.run(shard_owners(group_cluster.nats_url, pool))
        service = tinker.ServiceClient(
            base_url=group_cluster.base_url, api_key=group_cluster.api_key
        )
        clients: dict[int, tinker.TrainingClient] = {}
        for seed in range(51, 90):  # two tenants on each worker
            client = service.create_lora_training_client(
                base_model=str(group_model), rank=4, seed=seed
            ).result()
            owner = owners.get(subjects.shard_of(client.model_id))
            if (
                sum(owners.get(subjects.shard_of(c.model_id)) == owner for c in clients.values())
                < 2
            ):
                clients[seed] = client
            if len(clients) == 4:
                break
        assert len(clients) == 4
        reference = {}
        for seed in clients:  # the same two rounds, undisturbed
            client = service.create_lora_training_client(
                base_model=str(group_model), rank=4, seed=seed
            ).result()
            train_pipelined(client, seed, STEPS, f"ref-a-{seed}", pause_s=0.0)
            path = train_pipelined(client, seed, AGAIN, f"ref-b-{seed}", pause_s=0.0)
            reference[seed] = saved_adapter(group_cluster, path)
        group_id = next(owner for owner in owners.values() if owner != "single-device")
        results, _ = _kill_rank_1_mid_run(group_cluster, clients, "moved")
        # round two once the restarted group holds shards again
        deadline = time.monotonic() + 180
        while group_id not in asyncio.run(shard_owners(group_cluster.nats_url, pool)).values():
            assert time.monotonic() < deadline, "the restarted group took no shard back"
            time.sleep(0.5)
        for seed in clients:
            results[seed] = train_pipelined(clients[seed], seed, AGAIN, "again", pause_s=0.0)
        for seed in clients:
            # A model trained partly on each layout rounds differently from one trained on
            # one (on this model: 7e-5 apart after 10 steps, 2e-3 after 20, measured), so
            # the bound is looser than 1e-4; a lost moment or step count would put it about
            # one learning rate (2e-2) off.
            _assert_same(saved_adapter(group_cluster, results[seed]), reference[seed], 1e-3)
        # the one-device worker took the group's models over, and the restarted group took
        # some back from the one-device worker's snapshots
        assert "took model" in log_file.read_text()
        group_log = (
            group_cluster.data_dir.parent / f"{group_cluster.data_dir.name}.log"
        ).read_text()
        restarted = group_log.split("rank 1 of the worker group exited")[-1]
        assert "took model" in restarted
    finally:
        single.send_signal(signal.SIGTERM)
        try:
            single.wait(timeout=30)
        except subprocess.TimeoutExpired:
            single.kill()
