"""`twinkle-admin` against a running cluster: every command through `CliRunner`, its table for
people and its `--json` answer, and its failures as one line on stderr.

Tenants and keys are made with the command itself; runs and checkpoints with the official SDK.
Tenant names start with `cli-` so they never meet another test's on the shared `cluster`.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from click.testing import Result
from typer.testing import CliRunner

from admin_cli.app import app
from tests.conftest import Cluster
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e

runner = CliRunner()
NO_ENV: dict[str, str | None] = {"TWINKLE_GATEWAY": None, "TWINKLE_ADMIN_KEY": None}


def cli(cluster: Cluster, *args: str, admin_key: str | None = None) -> Result:
    """`twinkle-admin --gateway ... --admin-key ... ARGS`, the environment left out."""
    key = cluster.admin_key if admin_key is None else admin_key
    argv = ["--gateway", cluster.base_url, "--admin-key", key, *args]
    return runner.invoke(app, argv, env=NO_ENV)


def human(cluster: Cluster, *args: str) -> str:
    result = cli(cluster, *args)
    assert result.exit_code == 0, result.output
    return result.stdout


def answer(cluster: Cluster, *args: str) -> Any:
    """The `--json` answer: stdout is the JSON and nothing else."""
    result = cli(cluster, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def refused(result: Result, detail: str, exit_code: int = 1) -> None:
    """Nothing on stdout; one `error: ...` line on stderr that mentions `detail`."""
    assert result.exit_code == exit_code, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and detail in lines[0], lines


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@dataclass
class Trained:
    """A tenant made with the CLI, and a run the SDK trained one step and saved."""

    tenant: str
    key: str
    service: tinker.ServiceClient
    client: tinker.TrainingClient
    state_path: str

    @property
    def run_id(self) -> str:
        return str(self.client.model_id)


def train(cluster: Cluster, tiny_model: Path, tenant: str) -> Trained:
    human(cluster, "tenants", "create", tenant)
    key = answer(cluster, "keys", "create", "--tenant", tenant)["key"]
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=key)
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    train_steps(client, toy_batch(n=2), 1)
    path = client.save_state("cli-state").result().path
    return Trained(tenant, key, service, client, path)


@pytest.fixture(scope="module")
def trained(cluster: Cluster, tiny_model: Path) -> Iterator[Trained]:
    run = train(cluster, tiny_model, "cli-train")
    yield run
    run.service.close("success").result()


# -- help and setup -----------------------------------------------------------------------------


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"], env=NO_ENV)
    assert result.exit_code == 0
    groups = ("tenants", "keys", "quotas", "usage", "prices", "runs", "checkpoints", "sessions")
    for group in groups:
        assert group in result.stdout
    assert "workers" in result.stdout and "queues" in result.stdout
    commands = {
        "tenants": ("create", "list", "show", "usage"),
        "keys": ("create", "list", "revoke"),
        "quotas": ("show", "set"),
        "prices": ("show", "set"),
        "runs": ("list", "show", "unload", "delete"),
        "checkpoints": ("list", "delete", "publish", "unpublish", "ttl"),
        "sessions": ("list", "show"),
        "workers": ("list",),
    }
    for group, names in commands.items():
        result = runner.invoke(app, [group, "--help"], env=NO_ENV)
        assert result.exit_code == 0, result.output
        assert all(name in result.stdout for name in names), (group, result.stdout)
    module = subprocess.run(
        [sys.executable, "-m", "admin_cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "twinkle-admin" in module.stdout and "--admin-key" in module.stdout


def test_gateway_and_admin_key_come_from_the_environment(cluster: Cluster) -> None:
    env = {"TWINKLE_GATEWAY": cluster.base_url, "TWINKLE_ADMIN_KEY": cluster.admin_key}
    result = runner.invoke(app, ["--json", "tenants", "list"], env=env)
    assert result.exit_code == 0, result.output
    assert "default" in {t["name"] for t in json.loads(result.stdout)["tenants"]}


# -- errors -------------------------------------------------------------------------------------


def test_a_wrong_admin_key_is_one_line_and_exit_1(cluster: Cluster) -> None:
    for args in (["tenants", "list"], ["--json", "workers", "list"]):
        refused(cli(cluster, *args, admin_key="not-the-key"), "invalid or missing admin key")


def test_no_admin_key_is_a_usage_error(cluster: Cluster) -> None:
    result = runner.invoke(app, ["--gateway", cluster.base_url, "tenants", "list"], env=NO_ENV)
    refused(result, "no admin key", exit_code=2)
    result = runner.invoke(app, ["--admin-key", "clé", "tenants", "list"], env=NO_ENV)
    assert result.exit_code == 2 and "ASCII" in result.stderr


def test_an_unknown_tenant_is_refused(cluster: Cluster) -> None:
    for args in (
        ["tenants", "show", "cli-nobody"],
        ["quotas", "show", "cli-nobody"],
        ["usage", "cli-nobody"],
        ["tenants", "usage", "cli-nobody"],
        ["keys", "create", "--tenant", "cli-nobody"],
    ):
        refused(cli(cluster, *args), "tenant 'cli-nobody' not found")
    refused(cli(cluster, "tenants", "show", "Not A Name"), "not a valid tenant name")


def test_an_unreachable_gateway_is_one_line(cluster: Cluster) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = runner.invoke(
        app, ["--gateway", url, "--admin-key", cluster.admin_key, "tenants", "list"], env=NO_ENV
    )
    refused(result, f"cannot reach the gateway at {url}")
    bad_url = runner.invoke(app, ["--gateway", "localhost:8000", "tenants", "list"], env=NO_ENV)
    assert bad_url.exit_code == 2 and "http(s)://" in bad_url.output


# -- tenants ------------------------------------------------------------------------------------


def test_tenants_create_list_show(cluster: Cluster) -> None:
    out = human(cluster, "tenants", "create", "cli-acme", "--display-name", "Acme Corp")
    assert out.strip() == "created tenant cli-acme"
    made = answer(cluster, "tenants", "create", "cli-json")
    assert made["name"] == "cli-json" and made["created_at"] > 0
    refused(cli(cluster, "tenants", "create", "cli-acme"), "already exists")

    listed = human(cluster, "tenants", "list")
    assert "cli-acme" in listed and "Acme Corp" in listed and "default" in listed
    rows = {t["name"]: t for t in answer(cluster, "tenants", "list")["tenants"]}
    assert rows["cli-acme"]["display_name"] == "Acme Corp" and not rows["cli-acme"]["bootstrap"]
    assert rows["default"]["bootstrap"]

    shown = human(cluster, "tenants", "show", "cli-acme")
    assert "tenant cli-acme" in shown and "Acme Corp" in shown
    assert "max_adapters" in shown and "no keys" in shown
    detail = answer(cluster, "tenants", "show", "cli-acme")
    assert detail["tenant"]["name"] == "cli-acme"
    assert set(detail) == {"tenant", "quotas", "usage", "keys"} and detail["keys"] == []
    assert "default" in human(cluster, "tenants", "show", "default")  # a bootstrap tenant


# -- keys ---------------------------------------------------------------------------------------


def test_keys_create_list_revoke_and_a_revoked_key_fails(
    cluster: Cluster, tiny_model: Path
) -> None:
    human(cluster, "tenants", "create", "cli-keys")
    out = human(cluster, "keys", "create", "--tenant", "cli-keys", "--label", "laptop")
    [shown_key] = [word for word in out.split() if word.startswith("tml-")]
    assert "laptop" in out and "not shown again" in out

    made = answer(cluster, "keys", "create", "--tenant", "cli-keys", "--label", "ci")
    assert {"key_id", "key", "tenant", "prefix", "label", "created_at"} <= set(made)
    assert made["tenant"] == "cli-keys" and made["key"].startswith(made["prefix"])
    key = made["key"]

    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=key)
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    assert client.model_id
    service.close("success").result()

    listed = human(cluster, "keys", "list", "--tenant", "cli-keys")
    assert made["key_id"] in listed and made["prefix"] in listed and "laptop" in listed
    assert key not in listed and shown_key not in listed
    rows = answer(cluster, "keys", "list", "--tenant", "cli-keys")["keys"]
    assert {r["label"] for r in rows} == {"laptop", "ci"}
    assert all("key" not in r for r in rows) and key not in json.dumps(rows)
    assert made["key_id"] in {r["key_id"] for r in answer(cluster, "keys", "list")["keys"]}

    capabilities = f"{cluster.base_url}/api/v1/get_server_capabilities"
    assert httpx.get(capabilities, headers={"X-API-Key": key}).status_code == 200
    revoked = human(cluster, "keys", "revoke", made["key_id"])
    assert f"revoked key {made['key_id']}" in revoked and "cli-keys" in revoked
    assert httpx.get(capabilities, headers={"X-API-Key": key}).status_code == 401
    again = answer(cluster, "keys", "revoke", made["key_id"])
    assert again["key_id"] == made["key_id"] and again["revoked_at"] is not None
    refused(cli(cluster, "keys", "revoke", "no-such-key"), "not found")


# -- quotas and usage ---------------------------------------------------------------------------


def test_quotas_show_set_and_clear(cluster: Cluster) -> None:
    human(cluster, "tenants", "create", "cli-quota")
    shown = human(cluster, "quotas", "show", "cli-quota")
    assert "quotas of cli-quota" in shown and "max_rank" in shown and "default" in shown
    view = answer(cluster, "quotas", "show", "cli-quota")
    assert view["tenant"] == "cli-quota" and view["overrides"] == {}

    out = human(cluster, "quotas", "set", "cli-quota", "--max-rank", "4", "--max-adapters", "2")
    assert "override" in out and "max_rank" in out
    # only the limits given are sent: the earlier overrides stay
    view = answer(cluster, "quotas", "set", "cli-quota", "--tokens-per-minute", "600")
    assert view["overrides"] == {"max_rank": 4, "max_adapters": 2, "tokens_per_minute": 600}
    assert view["limits"]["max_rank"] == 4
    view = answer(
        cluster, "quotas", "set", "cli-quota", "--clear", "max_rank", "--clear", "max-adapters"
    )
    assert view["overrides"] == {"tokens_per_minute": 600}

    for args, hint in (
        ([], "nothing to change"),
        (["--clear", "max_bogus"], "not a limit"),
        (["--max-rank", "4", "--clear", "max_rank"], "both set and cleared"),
        (["--max-rank", "-1"], "--max-rank"),
    ):
        result = cli(cluster, "quotas", "set", "cli-quota", *args)
        assert result.exit_code == 2 and hint in result.stderr, (args, result.output)


def test_usage_of_every_tenant_and_of_one(cluster: Cluster, trained: Trained) -> None:
    out = human(cluster, "usage")
    assert "cli-train" in out and "default" in out and "tokens trained" in out
    [mine] = answer(cluster, "usage", "cli-train")["usage"]
    assert mine["tenant"] == "cli-train" and mine["runs"] == 1 and mine["checkpoint_bytes"] > 0
    assert {"tokens_trained", "optim_steps", "active_adapters"} <= set(mine)
    everyone = answer(cluster, "usage")["usage"]
    assert {"cli-train", "default"} <= {u["tenant"] for u in everyone}


def test_prices_show_and_set(cluster: Cluster) -> None:
    found = answer(cluster, "prices", "show")  # the cluster's: put back at the end
    try:
        out = human(cluster, "prices", "set", "--train", "1.5", "--currency", "EUR")
        assert "prices (EUR per million tokens)" in out and "1.50" in out
        # only the prices given are sent: the others keep their value
        view = answer(cluster, "prices", "set", "--forward", "0.25", "--sample", "3")
        assert view == {"currency": "EUR", "train": 1.5, "forward": 0.25, "sample": 3.0}
        assert answer(cluster, "prices", "show") == view
        shown = human(cluster, "prices", "show")
        assert "trained tokens" in shown and "0.25" in shown and "3.00" in shown

        refused(cli(cluster, "prices", "set", "--currency", "usd"), "currency")
        refused(cli(cluster, "prices", "set", "--train", "2000000"), "train")
        for args, hint in (
            ([], "nothing to change"),
            (["--train", "-1"], "--train"),
            (["--sample", "nan"], "--sample"),
            (["--forward", "inf"], "--forward"),
            (["--train", "cheap"], "--train"),
        ):
            result = cli(cluster, "prices", "set", *args)
            assert result.exit_code == 2 and hint in result.stderr, (args, result.output)
        assert answer(cluster, "prices", "show") == view
    finally:
        httpx.put(
            f"{cluster.base_url}/admin/v1/prices",
            json=found,
            headers={"X-Admin-Key": cluster.admin_key},
        ).raise_for_status()


def test_tenants_usage_per_day_and_per_run(cluster: Cluster, trained: Trained) -> None:
    tokens = sum(datum.model_input.length for datum in toy_batch(n=2))  # what `train` sent
    data = answer(cluster, "tenants", "usage", "cli-train", "--days", "3")
    assert data["tenant"] == "cli-train" and len(data["days"]) == 3
    [run] = data["runs"]
    assert run["run_id"] == trained.run_id
    assert (run["tokens_trained"], run["optim_steps"]) == (tokens, 1)
    out = human(cluster, "tenants", "usage", "cli-train")
    assert "usage of cli-train per day" in out and trained.run_id in out
    assert f"cost ({data['currency']})" in out
    result = cli(cluster, "tenants", "usage", "cli-train", "--days", "15")
    assert result.exit_code == 2 and "--days" in result.stderr


# -- runs ---------------------------------------------------------------------------------------


def test_runs_list_and_show(cluster: Cluster, trained: Trained) -> None:
    out = human(cluster, "runs", "list", "--tenant", "cli-train")
    assert trained.run_id in out and "loaded" in out and "cli-train" in out
    [run] = answer(cluster, "runs", "list", "--tenant", "cli-train")["runs"]
    assert run["model_id"] == trained.run_id and run["lora"]["rank"] == 4
    assert trained.run_id in {r["model_id"] for r in answer(cluster, "runs", "list")["runs"]}

    shown = human(cluster, "runs", "show", trained.run_id)
    assert f"run {trained.run_id}" in shown and trained.state_path in shown
    detail = answer(cluster, "runs", "show", trained.run_id)
    assert detail["run"]["tenant_id"] == "cli-train"
    assert [c["path"] for c in detail["checkpoints"]] == [trained.state_path]
    refused(cli(cluster, "runs", "show", "no-such-run"), "run 'no-such-run' not found")


def _unloaded(cluster: Cluster, run_id: str) -> bool:
    """The run left its worker: the gateway marks it at once, the worker's `session-end` save
    comes after, so both are waited for."""
    detail = answer(cluster, "runs", "show", run_id)
    saved = {c["checkpoint_id"] for c in detail["checkpoints"]}
    return detail["run"]["unloaded_at"] is not None and "weights/session-end" in saved


def test_runs_unload(cluster: Cluster, tiny_model: Path) -> None:
    run = train(cluster, tiny_model, "cli-unload")
    out = human(cluster, "runs", "unload", run.run_id)
    assert f"unloading run {run.run_id}" in out and "session-end" in out
    wait_for(lambda: _unloaded(cluster, run.run_id), 60, "the run's session-end save")
    refused(cli(cluster, "--json", "runs", "unload", run.run_id), "already unloaded")
    run.service.close("success").result()


def test_runs_delete(cluster: Cluster, tiny_model: Path) -> None:
    first = train(cluster, tiny_model, "cli-delete")
    second = first.service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    second.save_state("second").result()
    first.service.close("success").result()  # both runs leave the worker, saved as session-end
    for run_id in (first.run_id, second.model_id):
        wait_for(lambda r=run_id: _unloaded(cluster, r), 60, f"run {run_id} to unload")

    saved = len(answer(cluster, "runs", "show", first.run_id)["checkpoints"])
    out = human(cluster, "runs", "delete", first.run_id)
    assert out.strip() == f"deleted run {first.run_id} and {saved} checkpoint(s)"
    refused(cli(cluster, "runs", "show", first.run_id), "not found")
    refused(cli(cluster, "runs", "delete", first.run_id), "not found")

    saved = len(answer(cluster, "runs", "show", second.model_id)["checkpoints"])
    gone = answer(cluster, "runs", "delete", second.model_id)
    assert gone == {"deleted": second.model_id, "checkpoints": saved}
    assert answer(cluster, "runs", "list", "--tenant", "cli-delete")["runs"] == []


# -- checkpoints --------------------------------------------------------------------------------

CHECKPOINT_FIELDS = {
    "run_id",
    "tenant_id",
    "checkpoint_id",
    "kind",
    "path",
    "size_bytes",
    "created_at",
    "public",
    "expires_at",
}


def test_checkpoints_list(cluster: Cluster, trained: Trained) -> None:
    out = human(cluster, "checkpoints", "list", "--tenant", "cli-train")
    assert trained.state_path in out and "cli-train" in out
    rows = answer(cluster, "checkpoints", "list", "--run", trained.run_id)["checkpoints"]
    [record] = [r for r in rows if r["path"] == trained.state_path]
    assert CHECKPOINT_FIELDS <= set(record)
    assert record["run_id"] == trained.run_id and record["kind"] == "weights"
    assert record["size_bytes"] > 0 and record["public"] is False
    everyone = answer(cluster, "checkpoints", "list")["checkpoints"]
    assert trained.state_path in {r["path"] for r in everyone}
    nobody = answer(cluster, "checkpoints", "list", "--tenant", "default", "--run", trained.run_id)
    assert nobody["checkpoints"] == []


def test_checkpoints_publish_and_unpublish(cluster: Cluster, trained: Trained) -> None:
    out = human(cluster, "checkpoints", "publish", trained.state_path)
    assert trained.state_path in out and "yes" in out
    record = answer(cluster, "checkpoints", "publish", trained.state_path)
    assert record["path"] == trained.state_path and record["public"] is True
    record = answer(cluster, "checkpoints", "unpublish", trained.state_path)
    assert record["public"] is False
    out = human(cluster, "checkpoints", "unpublish", trained.state_path)
    assert trained.state_path in out and "no" in out
    missing = f"tinker://{trained.run_id}/weights/no-such-checkpoint"
    refused(cli(cluster, "checkpoints", "publish", missing), "not found")


def test_checkpoints_ttl(cluster: Cluster, trained: Trained) -> None:
    before = time.time()
    record = answer(cluster, "checkpoints", "ttl", trained.state_path, "3600")
    assert record["path"] == trained.state_path
    assert before + 3600 - 5 <= record["expires_at"] <= time.time() + 3600 + 5
    out = human(cluster, "checkpoints", "ttl", trained.state_path, "7200")
    assert trained.state_path in out and "expires" in out
    record = answer(cluster, "checkpoints", "ttl", trained.state_path, "none")
    assert record["expires_at"] is None
    assert "never" in human(cluster, "checkpoints", "ttl", trained.state_path, "none")
    bad = cli(cluster, "checkpoints", "ttl", trained.state_path, "soon")
    assert bad.exit_code == 2 and "none" in bad.stderr


def test_checkpoints_delete(cluster: Cluster, trained: Trained) -> None:
    doomed = trained.client.save_state("cli-doomed").result().path
    doomed_json = trained.client.save_state("cli-doomed-json").result().path
    assert human(cluster, "checkpoints", "delete", doomed).strip() == f"deleted {doomed}"
    assert answer(cluster, "checkpoints", "delete", doomed_json) == {"deleted": doomed_json}
    left = answer(cluster, "checkpoints", "list", "--run", trained.run_id)["checkpoints"]
    assert {doomed, doomed_json}.isdisjoint(r["path"] for r in left)
    assert trained.state_path in {r["path"] for r in left}
    refused(cli(cluster, "checkpoints", "delete", doomed), "not found")


# -- sessions, workers, queues ------------------------------------------------------------------


def test_sessions_list_and_show(cluster: Cluster, trained: Trained) -> None:
    [session] = answer(cluster, "sessions", "list", "--tenant", "cli-train")["sessions"]
    session_id = session["session_id"]
    assert session["tenant_id"] == "cli-train" and not session["finished"]
    out = human(cluster, "sessions", "list", "--tenant", "cli-train")
    assert session_id in out and "active" in out
    assert session_id in {s["session_id"] for s in answer(cluster, "sessions", "list")["sessions"]}

    shown = human(cluster, "sessions", "show", session_id)
    assert f"session {session_id}" in shown and trained.run_id in shown
    detail = answer(cluster, "sessions", "show", session_id)
    assert detail["session"]["session_id"] == session_id
    assert [r["model_id"] for r in detail["runs"]] == [trained.run_id]
    refused(cli(cluster, "sessions", "show", "no-such-session"), "not found")


def test_workers_list(cluster: Cluster) -> None:
    rows = answer(cluster, "workers", "list")["workers"]
    assert {w["base_model"] for w in rows} >= set(cluster.base_models)
    for w in rows:
        assert {"pool", "role", "slots_used", "slots_total", "queue_depth", "heartbeat_at"} <= set(
            w
        )
        assert w["stale"] is False
    out = human(cluster, "workers", "list")
    first = rows[0]
    assert first["worker_id"] in out and first["pool"] in out and "s ago" in out
    assert f"/{first['slots_total']}" in out and "trainer" in out


def test_queues(cluster: Cluster) -> None:
    data = answer(cluster, "queues")
    assert {s["stream"] for s in data["streams"]} == {"TW_OPS", "TW_SAMPLE"}
    assert data["consumers"] and {"pools", "consumers"} <= set(data)
    out = human(cluster, "queues")
    assert "TW_OPS" in out and "TW_SAMPLE" in out and data["consumers"][0]["consumer"] in out
