"""Tenants, keys, quotas and session lifecycle on a real cluster, through the admin API and
the official SDK: another tenant can touch nothing, a revoked key fails at once, quotas refuse
or queue, and a finished session's adapters leave the worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from typer.testing import CliRunner

from admin_cli.app import app as admin_app
from tests.conftest import ADMIN_KEY, Cluster, start_cluster, stop_cluster
from tests.sdk_helpers import toy_batch, train_steps
from tests.wire import Wire

pytestmark = pytest.mark.e2e

SESSION_TIMEOUT_S = 12.0


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    """A cluster with an admin key, a short session timeout and a one-second rate burst."""
    running = start_cluster(
        tmp_path_factory.mktemp("ops") / "data",
        [tiny_model],
        "--session-timeout-s",
        str(SESSION_TIMEOUT_S),
        "--sweep-interval-s",
        "1",
        "--rate-burst-s",
        "1",
        "--long-poll-s",
        "1",
        "--max-slots",
        "4",
    )
    try:
        yield running
    finally:
        stop_cluster(running)


class Admin:
    def __init__(self, cluster: Cluster) -> None:
        self.http = httpx.Client(
            base_url=cluster.base_url, headers={"X-Admin-Key": ADMIN_KEY}, timeout=30.0
        )

    def call(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        resp = self.http.request(method, f"/admin/v1/{path}", json=body)
        assert resp.status_code == status, resp.text
        return resp.json()

    def tenant_key(self, name: str) -> str:
        self.call("POST", "tenants", {"name": name})
        return str(self.call("POST", "keys", {"tenant": name, "label": f"{name} tests"})["key"])


@pytest.fixture
def admin(ops: Cluster) -> Iterator[Admin]:
    client = Admin(ops)
    yield client
    client.http.close()


def _service(cluster: Cluster, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=cluster.base_url, api_key=key)


# -- keys ---------------------------------------------------------------------------------------


def test_keys_from_the_admin_api_work_and_a_revoked_key_fails_at_once(
    ops: Cluster, admin: Admin, tiny_model: Path
) -> None:
    assert httpx.get(f"{ops.base_url}/admin/v1/tenants").status_code == 401
    wrong = httpx.get(f"{ops.base_url}/admin/v1/tenants", headers={"X-Admin-Key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["category"] == "user"
    admin.call("POST", "keys", {"tenant": "nobody"}, status=404)
    key = admin.tenant_key("acme")
    admin.call("POST", "tenants", {"name": "acme"}, status=400)
    admin.call("POST", "tenants", {"name": "Not A Name"}, status=400)

    service = _service(ops, key)
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    assert len(train_steps(client, toy_batch(n=2), 1)) == 1
    service.close("success").result()

    listed = admin.call("GET", "keys?tenant=acme")["keys"]
    [row] = listed
    assert key.startswith(row["prefix"]) and row["label"] == "acme tests" and "key" not in row
    assert key not in str(listed)
    admin.call("POST", f"keys/{row['key_id']}/revoke")
    wire = Wire(ops.base_url, key)
    resp = wire.post("get_info", {"model_id": client.model_id, "type": "get_info"})
    assert resp.status_code == 401, resp.text
    wire.close()
    assert admin.call("GET", "tenants/acme")["keys"][0]["revoked_at"] is not None


# -- isolation ----------------------------------------------------------------------------------


def test_another_tenant_can_touch_nothing(ops: Cluster, admin: Admin, tiny_model: Path) -> None:
    service = _service(ops, ops.api_key)
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    train_steps(client, toy_batch(n=2), 1)
    state = client.save_state("mine").result().path
    sampler_path = client.save_weights_for_sampler("mine-s").result().path
    own = Wire(ops.base_url, ops.api_key)
    session_id = own.session()
    sampling = own.post(
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": sampler_path},
    ).json()["sampling_session_id"]
    sample = own.post(
        "asample",
        {
            "sampling_session_id": sampling,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
            "sampling_params": {"max_tokens": 1},
        },
    ).json()["request_id"]
    own.result(sample)
    model_id = client.model_id

    checkpoint = f"/api/v1/training_runs/{model_id}/checkpoints/{state.split('/', 3)[3]}"
    other = Wire(ops.base_url, admin.tenant_key("intruder"))
    other_session = other.session()
    attempts = {
        "get_info": other.post("get_info", {"model_id": model_id}),
        "forward_backward": other.forward_backward(other.fwdbwd_body(model_id, 50, toy_batch(1))),
        "optim_step": other.post(
            "optim_step", {"model_id": model_id, "seq_id": 50, "adam_params": {}}
        ),
        "save_weights": other.post(
            "save_weights", {"model_id": model_id, "seq_id": 50, "path": "x"}
        ),
        "load_weights (into theirs)": other.post(
            "load_weights", {"model_id": model_id, "seq_id": 50, "path": state}
        ),
        "load_weights (create from ours)": other.post(
            "load_weights",
            {"session_id": other_session, "model_seq_id": 0, "path": state},
        ),
        "create_sampling_session": other.post(
            "create_sampling_session",
            {"session_id": other_session, "sampling_session_seq_id": 0, "model_path": sampler_path},
        ),
        "asample": other.post(
            "asample",
            {
                "sampling_session_id": sampling,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3]}]},
                "sampling_params": {"max_tokens": 1},
            },
        ),
        "retrieve_future": other.post("retrieve_future", {"request_id": sample}),
        "weights_info": other.post("weights_info", {"tinker_path": state}),
        "training run": other.http.get(f"/api/v1/training_runs/{model_id}"),
        "run checkpoints": other.http.get(f"/api/v1/training_runs/{model_id}/checkpoints"),
        "sampler": other.http.get(f"/api/v1/samplers/{sampling}"),
        "heartbeat": other.post("session_heartbeat", {"session_id": session_id}),
        "finish": other.post(f"sessions/{session_id}/finish", {"reason": {"type": "success"}}),
        "session": other.http.get(f"/api/v1/sessions/{session_id}"),
        "delete checkpoint": other.http.delete(f"{checkpoint}"),
        "publish checkpoint": other.http.post(f"{checkpoint}/publish"),
        "checkpoint ttl": other.http.put(f"{checkpoint}/ttl", json={"ttl_seconds": 5}),
        "download urls": other.http.get(f"{checkpoint}/external_weights_urls"),
        "copy_weights": other.post("copy_weights", {"source_path": state}),
    }
    for what, resp in attempts.items():
        assert resp.status_code == 404, f"{what}: {resp.status_code} {resp.text}"
    runs = other.http.get("/api/v1/training_runs").json()["training_runs"]
    assert all(run["training_run_id"] != model_id for run in runs)
    listed = other.http.get("/api/v1/checkpoints").json()["checkpoints"]
    assert all(not c["tinker_path"].startswith(f"tinker://{model_id}/") for c in listed)
    assert session_id not in other.http.get("/api/v1/sessions").json()["sessions"]

    # and ours still works, untouched
    assert own.post("session_heartbeat", {"session_id": session_id}).status_code == 200
    assert len(train_steps(client, toy_batch(n=2), 1)) == 1
    own.close()
    other.close()
    service.close("success").result()


# -- quotas -------------------------------------------------------------------------------------


def test_hard_caps_refuse_naming_the_limit(ops: Cluster, admin: Admin, tiny_model: Path) -> None:
    key = admin.tenant_key("capped")
    view = admin.call("PUT", "quotas/capped", {"max_adapters": 1, "max_rank": 4})
    assert view["limits"]["max_adapters"] == 1 and view["overrides"] == {
        "max_adapters": 1,
        "max_rank": 4,
    }
    service = _service(ops, key)
    with pytest.raises(tinker.APIStatusError) as too_big:
        service.create_lora_training_client(base_model=str(tiny_model), rank=8).result()
    assert too_big.value.status_code == 403 and "max_rank" in str(too_big.value)
    service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    with pytest.raises(tinker.APIStatusError) as too_many:
        service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    assert too_many.value.status_code == 403
    assert "max_adapters" in str(too_many.value) and "1 in use" in str(too_many.value)
    # a concurrency limit above what the cluster-wide count can hold is refused, not capped
    # silently
    refused = admin.call("PUT", "quotas/capped", {"max_concurrent_samples": 4097}, status=400)
    assert "max_concurrent_samples: 4097 is out of range 0..4096" in str(refused)
    # clearing the override restores the default (unlimited here)
    admin.call("PUT", "quotas/capped", {"max_adapters": None})
    service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    service.close("success").result()


def test_over_its_token_rate_a_tenant_queues_then_completes(
    ops: Cluster, admin: Admin, tiny_model: Path
) -> None:
    key = admin.tenant_key("slow")
    admin.call("PUT", "quotas/slow", {"tokens_per_minute": 1200})  # 20 tokens/s, 20 of burst
    wire = Wire(ops.base_url, key)
    model_id = wire.create_model(wire.session(), str(tiny_model), rank=4)
    batch = toy_batch(n=2)  # 25 tokens a request
    started = time.monotonic()
    ids = [
        wire.forward_backward(wire.fwdbwd_body(model_id, seq, batch)).json()["request_id"]
        for seq in (1, 2, 3, 4)
    ]
    queued = wire.post("retrieve_future", {"request_id": ids[-1]}).json()
    assert queued["type"] == "try_again" and queued["queue_state"] == "paused_rate_limit"
    assert "tokens per minute" in queued["queue_state_reason"]
    for request_id in ids:
        wire.fwdbwd_output(wire.result(request_id))
    elapsed = time.monotonic() - started
    assert elapsed >= 3.0, f"4 x 25 tokens at 20 tokens/s after a 20-token burst took {elapsed} s"

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        [usage] = admin.call("GET", "usage?tenant=slow")["usage"]
        if usage["tokens_trained"] >= 100:
            break
        time.sleep(0.5)
    assert usage["tokens_trained"] == 100 and usage["forward_backward_requests"] == 4
    shown = CliRunner().invoke(
        admin_app,
        ["--gateway", ops.base_url, "--admin-key", ADMIN_KEY, "--json", "usage", "slow"],
    )
    assert shown.exit_code == 0, shown.output
    [row] = json.loads(shown.stdout)["usage"]
    assert row["tokens_trained"] == 100 and row["tenant"] == "slow"
    wire.close()


# -- lifecycle ----------------------------------------------------------------------------------


def _worker_pid(cluster: Cluster) -> int:
    for children in Path(f"/proc/{cluster.process.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"workers" in cmdline:
                return int(pid)
    raise AssertionError("no worker process")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _slots_used(admin: Admin) -> int:
    return sum(w["slots_used"] for w in admin.call("GET", "workers")["workers"])


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_finished_sessions_leave_the_worker_and_memory_returns(
    ops: Cluster, admin: Admin, tiny_model: Path
) -> None:
    key = admin.tenant_key("churn")
    pid = _worker_pid(ops)
    batch = toy_batch(n=2)

    def session(_: int) -> str:
        service = _service(ops, key)
        client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        service.close("success").result()
        return str(client.model_id)

    session(0)
    _wait(lambda: _slots_used(admin) == 0, 30, "the first session's adapter to leave")
    rss = [_rss_mib(pid)]
    # 49 more, as many at once as the worker has slots
    with ThreadPoolExecutor(4) as pool:
        last_model = list(pool.map(session, range(49)))[-1]
    _wait(lambda: _slots_used(admin) == 0, 60, "every session's adapter to leave")
    rss.append(_rss_mib(pid))
    assert rss[1] <= rss[0] * 1.10, (
        f"worker RSS {rss[0]:.0f} MiB after 1 session, {rss[1]:.0f} after 50"
    )

    # the slot is freed before the worker's save is recorded: the record follows within seconds
    def saved() -> bool:
        run = admin.call("GET", f"runs/{last_model}")
        return run["run"]["unloaded_at"] is not None and any(
            c["checkpoint_id"] == "weights/session-end" for c in run["checkpoints"]
        )

    _wait(saved, 30, "the last session's session-end checkpoint")
    # the saved state resumes
    service = _service(ops, key)
    resumed = service.create_training_client_from_state_with_optimizer(
        f"tinker://{last_model}/weights/session-end"
    ).result()
    resumed.forward_backward(batch, "cross_entropy").result()
    service.close("success").result()


def test_a_session_whose_heartbeats_stop_is_finished(
    ops: Cluster, admin: Admin, tiny_model: Path
) -> None:
    wire = Wire(ops.base_url, admin.tenant_key("silent"))
    session_id = wire.session()  # raw HTTP: no heartbeats follow
    model_id = wire.create_model(session_id, str(tiny_model), rank=4)
    first = wire.forward_backward(wire.fwdbwd_body(model_id, 1, toy_batch(n=1)))
    wire.result(first.json()["request_id"])

    def unloaded() -> bool:
        return admin.call("GET", f"runs/{model_id}")["run"]["unloaded_at"] is not None

    _wait(unloaded, SESSION_TIMEOUT_S + 15, "the silent session to expire")
    session = admin.call("GET", f"sessions/{session_id}")["session"]
    assert session["finished"] and session["finish_reason"] == "expired"
    gone = wire.forward_backward(wire.fwdbwd_body(model_id, 2, toy_batch(n=1)))
    assert gone.status_code == 410 and "session-end" in gone.json()["detail"]
    assert wire.post("session_heartbeat", {"session_id": session_id}).status_code == 410
    wire.close()
