"""An artifact store outage, end to end: `up --artifact-store s3://...` against a real S3 server
(SeaweedFS on loopback), two tenants training through the official SDK, the server SIGKILLed
(then restarted on its ports) and SIGSTOPped (then SIGCONTed).

While the store is away both tenants' training steps go on, none of them waiting out the
store's bound and no model failed for a snapshot it could not write; a save, and a load, fail
within the bound (`TWINKLE_ARTIFACT_STORE_WAIT_S`) with a `server` error that names the store,
the save or load and says a retry is safe. Once the store is back the retried save succeeds,
loads back bit for bit, and the model's snapshot is written again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from protocol import records, subjects
from protocol.records import SnapshotRecord
from tests.cluster_helpers import kv_get, stored_adapter
from tests.conftest import OTHER_TENANT_KEY, Cluster, start_cluster, stop_cluster
from tests.s3_server import S3Server
from tests.sdk_helpers import toy_batch

pytestmark = pytest.mark.e2e

STORE = "s3://twinkle/outage"
WAIT_S = 5.0  # the workers' artifact_store_wait_s here (30 s by default)
# SDK polling and a save's own work on top of the bound (2 cores shared with other tests)
SLACK_S = 6.0
# a step here takes ~20 ms; a snapshot's upload holds the cycles 1 s at most
# (`workers.trainer.snapshots`), a frozen store's request would hold them WAIT_S; on a loaded
# 2-core machine a few steps with one such hold took up to 3 s
STEP_S = 4.0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A server of this module's own: it is killed and frozen here."""
    server = S3Server(tmp_path_factory.mktemp("s3-outage"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stored(
    store: S3Server, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[Cluster]:
    env = {
        **store.env,
        "TWINKLE_ARTIFACT_STORE_WAIT_S": str(WAIT_S),
        "TWINKLE_SNAPSHOT_EVERY": "2",
        "TWINKLE_SNAPSHOT_MIN_S": "0",
    }
    running = start_cluster(
        tmp_path_factory.mktemp("outage") / "data",
        [tiny_model],
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


def _steps(client: tinker.TrainingClient, seed: int, steps: int) -> float:
    """`steps` training steps; the longest one's seconds."""
    batch = toy_batch(n=3, seed=seed)
    longest_s = 0.0
    for _ in range(steps):
        started = time.monotonic()
        fwd = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=2e-2))
        fwd.result()
        opt.result()
        longest_s = max(longest_s, time.monotonic() - started)
    return longest_s


def _refused(call: object, what: str) -> str:
    """The message of the failure `call()` raises: within the bound, retryable, naming it."""
    assert callable(call)
    started = time.monotonic()
    with pytest.raises(tinker.RequestFailedError) as raised:
        call()
    elapsed_s = time.monotonic() - started
    assert elapsed_s < WAIT_S + SLACK_S, f"{what} failed after {elapsed_s:.1f} s"
    err = raised.value
    assert err.category == types.RequestErrorCategory.Server  # ours, not the user's input
    message = str(err)
    assert f"the artifact store {STORE} is unreachable" in message, message
    assert what in message and "retrying the request is safe" in message, message
    return message


def _snapshot(cluster: Cluster, model_id: str) -> SnapshotRecord | None:
    key = subjects.snapshot_key(model_id)
    value = asyncio.run(kv_get(cluster.nats_url, subjects.BUCKET_RUNS, key))
    return None if value is None else records.decode(value, SnapshotRecord)


@pytest.mark.parametrize("outage", ["killed", "frozen"])
def test_training_goes_on_and_saves_fail_retryably_while_the_store_is_away(
    store: S3Server, stored: Cluster, tiny_model: Path, outage: str
) -> None:
    mine = tinker.ServiceClient(base_url=stored.base_url, api_key=stored.api_key)
    theirs = tinker.ServiceClient(base_url=stored.base_url, api_key=OTHER_TENANT_KEY)
    try:
        a = mine.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=41).result()
        b = theirs.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=42).result()
        _steps(a, 41, 2)
        _steps(b, 42, 2)
        before = str(a.save_state(f"before-{outage}").result().path)
        # the save's snapshot goes up and is recorded beside the model's next ops
        deadline = time.monotonic() + 10
        while _snapshot(stored, a.model_id) is None:
            assert time.monotonic() < deadline, "no snapshot after the save"
            time.sleep(0.1)

        if outage == "killed":
            store.kill()
        else:
            store.freeze()
        try:
            # training goes on for both tenants: no step waits for the store, and the
            # snapshots due (every 2nd step) fail no model
            assert _steps(a, 41, 3) < STEP_S
            assert _steps(b, 42, 3) < STEP_S
            message = _refused(lambda: a.save_state(f"during-{outage}").result(), "save")
            assert f"checkpoint tinker://{a.model_id}/weights/during-{outage}" in message
            _refused(lambda: mine.create_training_client_from_state(before).result(), "load")
            assert _steps(a, 41, 1) < STEP_S  # a failed save fails no model either
            # none written meanwhile: the record stands at a state of before the outage (the
            # snapshot after the save may have gone up as the store went away)
            during = _snapshot(stored, a.model_id)
            assert during is not None and during.step <= 2
        finally:
            if outage == "killed":
                store.start()
            else:
                store.thaw()

        # the same save, retried, succeeds and loads back bit for bit
        after = str(a.save_state(f"during-{outage}").result().path)
        loaded = mine.create_training_client_from_state(after).result()
        again = str(loaded.save_state(f"again-{outage}").result().path)
        want = stored_adapter(STORE, store.env, stored, after)
        got = stored_adapter(STORE, store.env, stored, again)
        assert want.keys() == got.keys()
        for key in want:
            assert np.array_equal(want[key], got[key]), key
        # the snapshot is written again (after the save: its upload may still be going), and
        # training goes on
        deadline = time.monotonic() + 10
        while (written := _snapshot(stored, a.model_id)) is None or written.step < 6:
            assert time.monotonic() < deadline, f"no snapshot after the outage: {written}"
            time.sleep(0.2)
        assert written.store_key
        _steps(a, 41, 1)
        _steps(b, 42, 1)
    finally:
        mine.close("success").result()
        theirs.close("success").result()
