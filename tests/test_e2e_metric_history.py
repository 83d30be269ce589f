"""A training run's metric history against the session's cluster: what the SDK's
`forward_backward` and `optim_step` answered, each kept by the run, read by its tenant
(`GET /api/v1/training_runs/{run_id}/metrics`) and by the operator (`twinkle-admin runs
metrics`), and by no other tenant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from typer.testing import CliRunner

from admin_cli.app import app
from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch
from tests.wait_helpers import wait_until

pytestmark = pytest.mark.e2e


def _history(cluster: Cluster, run_id: str, key: str) -> httpx.Response:
    return httpx.get(
        f"{cluster.base_url}/api/v1/training_runs/{run_id}/metrics",
        headers={"X-API-Key": key},
        timeout=30,
    )


def test_a_runs_history_holds_every_pass_and_step_it_answered(
    cluster: Cluster, service: tinker.ServiceClient, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    batch = toy_batch(seed=21)
    answered: list[tuple[str, dict[str, float]]] = []
    for _ in range(3):
        passed = client.forward_backward(batch, "cross_entropy").result()
        stepped = client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        answered += [("forward_backward", passed.metrics), ("optim_step", stepped.metrics or {})]
    forward = client.forward(batch, "cross_entropy").result()
    answered.append(("forward", forward.metrics))
    run_id = client.model_id

    steps: list[dict[str, Any]] = []

    def complete() -> bool:
        nonlocal steps
        got = _history(cluster, run_id, cluster.api_key)
        assert got.status_code == 200, got.text
        steps = got.json()["steps"]
        return len(steps) >= len(answered)

    wait_until(complete, 30, "the run's metric history")
    assert [(s["kind"], s["metrics"]) for s in steps] == [
        (kind, pytest.approx(metrics, rel=1e-6)) for kind, metrics in answered
    ]
    assert [s["step"] for s in steps] == sorted(s["step"] for s in steps)
    assert all(s["time"] > 0 for s in steps)
    assert steps[0]["metrics"]["loss:sum"] > steps[4]["metrics"]["loss:sum"]  # it learns
    # each pass keeps its tokens (a step none): what the run's usage is summed from
    n_tokens = sum(datum.model_input.length for datum in batch)
    kinds = ("forward_backward", "optim_step", "forward")
    tokens = {kind: sum(s["tokens"] for s in steps if s["kind"] == kind) for kind in kinds}
    assert tokens == {"forward_backward": 3 * n_tokens, "optim_step": 0, "forward": n_tokens}

    # another tenant: as unknown as a run that does not exist; a malformed id is a 400
    assert _history(cluster, run_id, OTHER_TENANT_KEY).status_code == 404
    assert _history(cluster, "no-such-run", cluster.api_key).status_code == 404
    assert _history(cluster, "x" * 3000, cluster.api_key).status_code in (400, 404)

    # the operator's view, through twinkle-admin
    argv = ["--gateway", cluster.base_url, "--admin-key", cluster.admin_key]
    env: dict[str, str | None] = {"TWINKLE_GATEWAY": None, "TWINKLE_ADMIN_KEY": None}
    shown = CliRunner().invoke(app, [*argv, "--json", "runs", "metrics", run_id], env=env)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["steps"] == steps
    table = CliRunner().invoke(app, [*argv, "runs", "metrics", run_id], env=env)
    assert table.exit_code == 0 and "loss:sum" in table.stdout and "optim_step" in table.stdout
    assert "tokens" in table.stdout and str(n_tokens) in table.stdout
