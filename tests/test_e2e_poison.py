"""A poison op against a real cluster: a request whose pass runs past the watchdog's limit stops
the worker each time it runs; after `max_attempts` it fails alone with a clear `server` error,
while the tenants training beside it finish unharmed and the worker keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.conftest import Cluster, start_cluster, stop_cluster
from tests.sdk_helpers import toy_batch
from tests.wire import Wire

pytestmark = pytest.mark.e2e

# A normal pass of the tiny model takes ~20 ms; the poison request ~10 s on one CPU thread.
WATCHDOG = {"TWINKLE_PASS_TIMEOUT_S": "2", "TWINKLE_MAX_ATTEMPTS": "2", "TWINKLE_LEASE_S": "3"}


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    running = start_cluster(tmp_path_factory.mktemp("poison") / "data", [tiny_model], env=WATCHDOG)
    try:
        yield running
    finally:
        stop_cluster(running)


def _worker_pids(cluster: Cluster) -> set[int]:
    pids = set()
    for children in Path(f"/proc/{cluster.process.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"workers" in argv:
                pids.add(int(pid))
    return pids


def _poison(length: int = 4096, datums: int = 16) -> list[types.Datum]:
    tokens = [3 + (i % 200) for i in range(length + 1)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
    )
    return [datum] * datums


def test_a_poison_op_fails_alone_and_the_worker_keeps_serving(
    watched: Cluster, tiny_model: Path
) -> None:
    service = tinker.ServiceClient(base_url=watched.base_url, api_key=watched.api_key)
    bystanders = [
        service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=seed).result()
        for seed in (1, 2)
    ]
    wire = Wire(watched.base_url, watched.api_key)
    poisoned_model = wire.create_model(wire.session(), str(tiny_model), rank=4)
    first_pids = _worker_pids(watched)

    errors: list[BaseException] = []
    losses: dict[int, list[float]] = {}

    def train(index: int) -> None:
        client = bystanders[index]
        batch = toy_batch(n=2, seed=index)
        try:
            seen = []
            for _ in range(8):
                out = client.forward_backward(batch, "cross_entropy")
                client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                seen.append(out.result().metrics["loss:sum"])
                time.sleep(0.3)
            losses[index] = seen
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(bystanders))]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    poison = wire.forward_backward(wire.fwdbwd_body(poisoned_model, 1, _poison()))
    assert poison.status_code == 200, poison.text
    result = wire.result(poison.json()["request_id"], timeout_s=240).json()
    assert result["category"] == "server", result
    assert "not applied" in result["error"] and "2 times" in result["error"], result

    for thread in threads:
        thread.join(timeout=240)
    assert not errors, errors
    assert all(len(seen) == 8 and seen[-1] < seen[0] for seen in losses.values()), losses
    assert _worker_pids(watched) - first_pids, "the worker was never restarted"
    # the poisoned tenant's model carries on with its next request
    after = wire.forward_backward(wire.fwdbwd_body(poisoned_model, 2, toy_batch(n=1)))
    assert after.status_code == 200
    wire.fwdbwd_output(wire.result(after.json()["request_id"], timeout_s=60))
    wire.close()
    service.close("success").result()
