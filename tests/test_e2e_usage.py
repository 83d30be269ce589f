"""Usage per day and per run, with costs at the operator's prices, against the session's
cluster: a tenant made for this test trains through the official SDK; the operator sets prices
(`PUT /admin/v1/prices`); the tenant reads `GET /api/v1/usage` and the operator
`GET /admin/v1/tenants/{name}/usage`; no other tenant sees the run. Hostile prices and windows
are each a 400. The prices are the whole cluster's: the test puts back what it found."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch
from tests.wait_helpers import wait_until

pytestmark = pytest.mark.e2e

TENANT = "usage-e2e"
PRICES = {"currency": "EUR", "train": 2.5, "forward": 0.75, "sample": 4.0}


@pytest.fixture
def admin(cluster: Cluster) -> Iterator[httpx.Client]:
    """The admin API, with the cluster's prices put back after the test."""
    with httpx.Client(
        base_url=cluster.base_url, headers={"X-Admin-Key": cluster.admin_key}, timeout=30
    ) as client:
        found = client.get("/admin/v1/prices")
        assert found.status_code == 200, found.text
        try:
            yield client
        finally:
            client.put("/admin/v1/prices", json=found.json()).raise_for_status()


def _usage(cluster: Cluster, key: str, **params: str) -> httpx.Response:
    return httpx.get(
        f"{cluster.base_url}/api/v1/usage", params=params, headers={"X-API-Key": key}, timeout=30
    )


def _refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["category"] == "user" and field in body["detail"], body
    assert response.headers["x-should-retry"] == "false"


def test_a_runs_usage_and_cost_at_the_operators_prices(
    cluster: Cluster, admin: httpx.Client, tiny_model: Path
) -> None:
    made = admin.post("/admin/v1/tenants", json={"name": TENANT})
    assert made.status_code == 200, made.text
    key = admin.post("/admin/v1/keys", json={"tenant": TENANT}).json()["key"]
    set_prices = admin.put("/admin/v1/prices", json=PRICES)
    assert set_prices.status_code == 200 and set_prices.json() == PRICES, set_prices.text
    assert admin.get("/admin/v1/prices").json() == PRICES

    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=key)
    try:
        client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
        batch = toy_batch(n=3, seed=33)
        tokens = sum(datum.model_input.length for datum in batch)
        for _ in range(3):
            client.forward_backward(batch, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        client.forward(batch, "cross_entropy").result()
        run_id = client.model_id
    finally:
        service.close("success").result()
    trained, forward = 3 * tokens, tokens
    cost = trained / 1e6 * PRICES["train"] + forward / 1e6 * PRICES["forward"]
    today = datetime.now(UTC).date().isoformat()

    answer: dict[str, Any] = {}

    def counted() -> bool:
        nonlocal answer
        got = _usage(cluster, key)
        assert got.status_code == 200, got.text
        answer = got.json()
        runs = {run["run_id"]: run for run in answer["runs"]}
        day = answer["days"][-1]
        return (
            run_id in runs
            and runs[run_id]["tokens_trained"] == trained
            and runs[run_id]["tokens_forward"] == forward
            and (day["tokens_trained"], day["tokens_forward"]) == (trained, forward)
        )

    wait_until(counted, 60, "the run's tokens in its usage, per run and per day")
    assert answer["currency"] == "EUR" and answer["tenant"] == TENANT
    assert answer["prices"] == {"train": 2.5, "forward": 0.75, "sample": 4.0}
    assert answer["runs_truncated"] is False
    [run] = answer["runs"]
    assert run["base_model"] == str(tiny_model) and run["optim_steps"] == 3
    assert run["cost"] == pytest.approx(cost, rel=1e-12)
    [run_today] = [d for d in run["days"] if d["tokens_trained"]]
    assert run_today["day"] == today and run_today["optim_steps"] == 3
    assert run_today["cost"] == pytest.approx(cost, rel=1e-12)
    assert len(answer["days"]) == 7 and answer["days"][-1]["day"] == today
    assert [d["day"] for d in answer["days"]] == sorted(d["day"] for d in answer["days"])
    assert answer["days"][-1]["sampled_tokens"] == 0
    assert answer["days"][-1]["cost"] == pytest.approx(cost, rel=1e-12)
    assert sum(d["cost"] for d in answer["days"]) == pytest.approx(cost, rel=1e-12)

    # the run's metric history carries each pass's tokens, the sum the run's usage is made of
    steps = httpx.get(
        f"{cluster.base_url}/api/v1/training_runs/{run_id}/metrics",
        headers={"X-API-Key": key},
        timeout=30,
    ).json()["steps"]
    assert sum(s["tokens"] for s in steps if s["kind"] == "forward_backward") == trained
    assert [s["tokens"] for s in steps if s["kind"] == "optim_step"] == [0, 0, 0]

    # the window: one day, two weeks
    one_day = _usage(cluster, key, days="1").json()
    assert [d["day"] for d in one_day["days"]] == [today]
    assert one_day["runs"][0]["tokens_trained"] == trained
    assert len(_usage(cluster, key, days="14").json()["days"]) == 14

    # the operator sees the same; no other tenant sees the run
    seen = admin.get(f"/admin/v1/tenants/{TENANT}/usage").json()
    assert (seen["days"], seen["runs"]) == (answer["days"], answer["runs"])
    for other in (OTHER_TENANT_KEY, cluster.api_key):
        theirs = _usage(cluster, other)
        assert theirs.status_code == 200, theirs.text
        assert run_id not in {r["run_id"] for r in theirs.json()["runs"]}
    assert admin.get("/admin/v1/tenants/no-such-tenant/usage").status_code == 404
    _refused(admin.get("/admin/v1/tenants/Not A Name/usage"), "tenant")
    assert _usage(cluster, "tml-not-a-key").status_code == 401
    no_admin = httpx.get(
        f"{cluster.base_url}/admin/v1/tenants/{TENANT}/usage", headers={"X-API-Key": key}
    )
    assert no_admin.status_code == 401

    # prices changed later cost the same tokens at the new prices
    assert admin.put("/admin/v1/prices", json={"train": 10}).json() == {**PRICES, "train": 10.0}
    repriced = _usage(cluster, key).json()
    assert repriced["runs"][0]["cost"] == pytest.approx(
        trained / 1e6 * 10 + forward / 1e6 * PRICES["forward"], rel=1e-12
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"train": -1}', "train"),
        (b'{"forward": -0.01}', "forward"),
        (b'{"sample": 1000001}', "sample"),
        (b'{"train": 1e400}', "train"),
        (b'{"train": NaN}', "malformed"),
        (b'{"train": Infinity}', "malformed"),
        (b'{"train": "NaN"}', "train"),
        (b'{"train": "inf"}', "train"),
        (b'{"train": "1"}', "train"),
        (b'{"train": null}', "train"),
        (b'{"train": true}', "train"),
        (b'{"train": {"amount": 1}}', "train"),
        (b'{"trian": 1}', "trian"),
        (b'{"currency": "usd"}', "currency"),
        (b'{"currency": ""}', "currency"),
        (b'{"currency": "DOLLARSXX"}', "currency"),
        (b'{"currency": 978}', "currency"),
        (b'{"currency": "EU\\u00a0R"}', "currency"),
        (b"[1, 2]", "PriceChange"),
        (b"prices", "PriceChange"),
    ],
)
def test_hostile_prices_are_refused_and_change_nothing(
    admin: httpx.Client, body: bytes, field: str
) -> None:
    before = admin.get("/admin/v1/prices").json()
    sent = admin.put("/admin/v1/prices", content=body, headers={"Content-Type": "application/json"})
    _refused(sent, field)
    assert admin.get("/admin/v1/prices").json() == before


@pytest.mark.parametrize("days", ["0", "15", "-1", "7.0", "abc", "", "1e1", "99999999999", "٣"])
def test_a_bad_window_is_refused(cluster: Cluster, admin: httpx.Client, days: str) -> None:
    _refused(_usage(cluster, cluster.api_key, days=days), "days")
    _refused(admin.get("/admin/v1/tenants/default/usage", params={"days": days}), "days")
