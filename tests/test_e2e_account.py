"""The account calls of the SDK against a real cluster: billing usage, current checkpoint storage,
the audit log and session search, each the caller's tenant's alone; training and sampling make
usage and storage grow; hostile parameters answer a 4xx naming the parameter. The pure cores
(usage history, GB-hours) are checked first, without a cluster."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from protocol import account_api, api, records
from protocol.api import LoraConfig
from protocol.records import CheckpointRecord, SessionRecord, UsageHistory, UsageRecord
from tests.conftest import ADMIN_KEY, OTHER_TENANT_KEY, Cluster, start_cluster, stop_cluster
from tests.sdk_helpers import kv_values, toy_batch, train_steps
from twinkle_async.gateway.account_views import _storage_gb_hours, search_sessions
from twinkle_async.usage_history import add_snapshot, hourly_usage

pytestmark = pytest.mark.e2e

H = 3600


def usage(ts: float, trained: int, sampled: int = 0) -> UsageRecord:
    return UsageRecord("t", "w", tokens_trained=trained, sampled_tokens=sampled, updated_at=ts)


def test_history_keeps_the_last_snapshot_of_each_hour_and_differences_them() -> None:
    history = UsageHistory("t", "w")
    assert add_snapshot(history, usage(10 * H + 5, 10))
    assert add_snapshot(history, usage(10 * H + 50, 30))
    assert not add_snapshot(history, usage(10 * H + 20, 20))  # older: a slower gateway's
    assert add_snapshot(history, usage(12 * H + 1, 35, 7))
    assert add_snapshot(history, usage(11 * H + 9, 32))  # out of order, its own hour
    got = [
        (u.hour, u.counts["tokens_trained"], u.counts["sampled_tokens"])
        for u in hourly_usage(history)
    ]
    assert got == [(10, 30, 0), (11, 2, 0), (12, 3, 7)]
    add_snapshot(history, usage(13 * H, 4))  # the worker restarted: counted from zero
    assert hourly_usage(history)[-1].counts["tokens_trained"] == 4


def test_history_is_bounded_and_keeps_a_baseline() -> None:
    history = UsageHistory("t", "w")
    for hour in range(10):
        add_snapshot(history, usage(hour * H, 100 * (hour + 1)), max_hours=3)
    assert len(history.snapshots) == 3
    assert [u.counts["tokens_trained"] for u in hourly_usage(history)] == [100, 100, 100]
    assert not add_snapshot(history, usage(2 * H, 5000), max_hours=3)  # its hour is gone


def ckpt(created: float, size: int, expires: float | None = None) -> CheckpointRecord:
    return CheckpointRecord(
        "run", "t", "weights/a", "weights", "tinker://run/weights/a", "/x", created, size,
        "base", LoraConfig(), expires_at=expires,
    )  # fmt: skip


def test_storage_gigabyte_hours_per_hour() -> None:
    held = _storage_gb_hours(
        [ckpt(10 * H + H / 2, 2 * 10**9), ckpt(11 * H, 10**9, expires=11 * H + H / 4)],
        10,
        14,
        now=13 * H + H / 2,
    )
    assert held[10, "base"] == pytest.approx(1.0)
    assert held[11, "base"] == pytest.approx(2.25)
    assert held[12, "base"] == pytest.approx(2.0)
    assert held[13, "base"] == pytest.approx(1.0)  # up to now only
    assert (14, "base") not in held


def test_search_pages_every_session_once_even_with_equal_times() -> None:
    """Keyset paging on (time in microseconds, id): ties and sub-microsecond times neither
    repeat nor skip a session across pages."""
    t0 = 1_790_000_000.1234567
    sessions = [
        SessionRecord(
            f"sess-{i:02d}", "t", t0 + (i // 3) * 1e-7, t0, user_metadata={"k": str(i % 2)}
        )
        for i in range(10)
    ]
    seen: list[str] = []
    query = account_api.SessionSearchRequest(limit=3)
    while True:
        page = search_sessions("t", query, sessions, [], [], now=t0)
        seen += [s.session_id for s in page.sessions]
        if page.next_cursor is None:
            break
        cursor = api.decode(
            api.encode(page.next_cursor), account_api.SessionSearchCursor
        )  # the wire
        query = account_api.SessionSearchRequest(limit=3, cursor=cursor)
    assert sorted(seen) == sorted(s.session_id for s in sessions) and len(seen) == 10
    odd = search_sessions(
        "t", account_api.SessionSearchRequest(user_metadata={"k": "1"}), sessions, [], [], t0
    )
    assert len(odd.sessions) == 5 and odd.next_cursor is None


# -- against a cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def account_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[Cluster]:
    running = start_cluster(tmp_path_factory.mktemp("account") / "data", [tiny_model])
    try:
        yield running
    finally:
        stop_cluster(running)


def rest_client(cluster: Cluster, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=cluster.base_url, api_key=key)


def admin_client(cluster: Cluster, key: str) -> tinker.AdminClient:
    return tinker.AdminClient(base_url=cluster.base_url, api_key=key)


def window() -> tuple[str, str]:
    """From the hour before the current one to the end of the next (no hour boundary missed)."""
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return (hour - timedelta(hours=1)).isoformat(), (hour + timedelta(hours=2)).isoformat()


def totals(response: types.BillingUsageResponse) -> dict[str, float]:
    found: dict[str, float] = {}
    for event in response.data:
        info = event.event_info
        quantity = getattr(info, "token_count", None) or getattr(info, "count", None)
        if isinstance(info, types.StorageBillingEvent):
            quantity = info.gigabyte_hours
        found[info.type] = found.get(info.type, 0) + (quantity or 0)
    return found


def search(rest: tinker.RestClient, **fields: Any) -> types.SessionSearchResponse:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rest.search_sessions(types.SessionSearchRequest(**fields)).result()


@dataclass
class Worked:
    session_id: str
    run_id: str
    state: str
    trained_tokens: int
    sampled_tokens: int
    storage_before: types.CurrentCheckpointStorageUsageResponse


@pytest.fixture(scope="module")
def worked(account_cluster: Cluster, tiny_model: Path) -> Iterator[Worked]:
    """Our tenant trains two steps, saves a state, samples; then closes its session."""
    admin = admin_client(account_cluster, account_cluster.api_key)
    before = admin.get_current_checkpoint_storage_usage().result()
    service = tinker.ServiceClient(
        base_url=account_cluster.base_url,
        api_key=account_cluster.api_key,
        user_metadata={"purpose": "account-test"},
    )
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    batch = toy_batch(n=2)
    train_steps(client, batch, 2)
    state = client.save_state("account-state").result().path
    sampler = client.save_weights_and_get_sampling_client("account-sampler").result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1, stop=[])
    result = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    run_id = client.model_id
    service.close("success").result()
    yield Worked(
        session_id=run_id.split(":train:")[0],
        run_id=run_id,
        state=state,
        trained_tokens=2 * sum(d.model_input.length for d in batch),
        sampled_tokens=sum(len(s.tokens) for s in result.sequences),
        storage_before=before,
    )


def test_billing_usage_counts_what_the_tenant_ran(account_cluster: Cluster, worked: Worked) -> None:
    admin = admin_client(account_cluster, account_cluster.api_key)
    start, end = window()
    deadline = time.monotonic() + 60  # workers flush their counters with each heartbeat (5 s)
    while True:
        response = admin.get_billing_usage(start, end).result()
        found = totals(response)
        if (
            found.get("training", 0) >= worked.trained_tokens
            and found.get("sampling_sample", 0) >= worked.sampled_tokens
            or time.monotonic() > deadline
        ):
            break
        time.sleep(1)
    assert found["training"] == worked.trained_tokens
    assert found["sampling_sample"] == worked.sampled_tokens
    listed = rest_client(account_cluster, account_cluster.api_key).list_checkpoints(worked.run_id)
    # the state, the sampler weights, and the state saved when the session finished
    assert found["checkpoint"] == len(listed.result().checkpoints) >= 2
    assert found["storage"] > 0
    for event in response.data:
        assert event.user_id == "default" and event.estimated_cost_usd is None
        assert event.bucket_end - event.bucket_start == timedelta(hours=1)
    starts = [event.bucket_start for event in response.data]
    assert starts == sorted(starts)

    other = admin_client(account_cluster, OTHER_TENANT_KEY).get_billing_usage(start, end).result()
    assert other.data == []


def test_gateway_keeps_the_hourly_history_in_kv(account_cluster: Cluster, worked: Worked) -> None:
    """Past hours are answered from the history the gateway writes, not the live counters."""

    async def histories() -> list[UsageHistory]:
        values = await kv_values(account_cluster.nats_url, "tw_usage", "hist.default")
        return [records.decode(value, UsageHistory) for value in values]

    deadline = time.monotonic() + 30
    while True:
        found = asyncio.run(histories())
        trained = sum(u.counts["tokens_trained"] for h in found for u in hourly_usage(h))
        if trained >= worked.trained_tokens or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert trained == worked.trained_tokens
    assert all(h.tenant_id == "default" and h.base_model for h in found)


def test_checkpoint_storage_grows_with_saves(account_cluster: Cluster, worked: Worked) -> None:
    rest = rest_client(account_cluster, account_cluster.api_key)
    ours = {c.tinker_path: c for c in rest.list_checkpoints(worked.run_id).result().checkpoints}
    now = admin_client(account_cluster, account_cluster.api_key)
    usage_now = now.get_current_checkpoint_storage_usage().result()
    before = worked.storage_before.data[0] if worked.storage_before.data else None
    (item,) = usage_now.data
    assert item.checkpoint_count == (before.checkpoint_count if before else 0) + len(ours)
    added = sum(c.size_bytes or 0 for c in ours.values())
    assert added > 0
    assert item.size_bytes == (before.size_bytes if before else 0) + added
    assert item.size_gigabytes == pytest.approx(item.size_bytes / 1e9)
    assert item.project_id == "default" and item.estimated_monthly_cost_usd is None
    same = now.get_current_checkpoint_storage_usage(project_id="default").result()
    assert same.data == usage_now.data
    other = admin_client(account_cluster, OTHER_TENANT_KEY)
    assert other.get_current_checkpoint_storage_usage().result().data == []


def test_audit_log_lists_the_tenants_own_events(account_cluster: Cluster, worked: Worked) -> None:
    admin = admin_client(account_cluster, account_cluster.api_key)
    entries = admin.get_audit_log().result().entries
    events = {(e.event, e.model_id, e.tinker_path) for e in entries}
    assert ("training_run_create", worked.run_id, None) in events
    assert ("checkpoint_create", worked.run_id, worked.state) in events
    finished = [e for e in entries if e.event == "session_finish"]
    assert any(e.event_details["session_id"] == worked.session_id for e in finished)
    times = [e.timestamp for e in entries]
    assert times == sorted(times)
    only = admin.get_audit_log(event_type="checkpoints").result().entries
    assert only and {e.event for e in only} == {"checkpoint_create"}
    assert admin.get_audit_log(event_type="teams").result().entries == []
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    assert all(
        e.timestamp.date() == yesterday for e in admin.get_audit_log(day=yesterday).result().entries
    )

    sampling = [e for e in entries if e.event == "sampling_session_create"]
    assert any(e.event_details["session_id"] == worked.session_id for e in sampling)
    assert all(None not in e.event_details.values() for e in entries)

    # an operator gives the other tenant a key, then revokes it: only that tenant sees it
    ops = httpx.Client(
        base_url=account_cluster.base_url, headers={"X-Admin-Key": ADMIN_KEY}, timeout=30
    )
    made = ops.post("/admin/v1/keys", json={"tenant": "other", "label": "audited"})
    assert made.status_code == 200, made.text
    key_id = made.json()["key_id"]
    assert ops.post(f"/admin/v1/keys/{key_id}/revoke").status_code == 200
    theirs = admin_client(account_cluster, OTHER_TENANT_KEY).get_audit_log().result().entries
    key_events = [e.event for e in theirs if e.event_details.get("key_id") == key_id]
    assert key_events == ["api_key_create", "api_key_revoke"]
    assert all(e.event_details.get("tenant") == "other" for e in theirs)
    assert not any(worked.run_id in str(e.model_dump()) for e in theirs)
    ours = admin.get_audit_log().result().entries
    assert not any(e.event_details.get("key_id") == key_id for e in ours)


def test_search_sessions_filters_and_pages(account_cluster: Cluster, worked: Worked) -> None:
    rest = rest_client(account_cluster, account_cluster.api_key)
    services = [
        tinker.ServiceClient(
            base_url=account_cluster.base_url,
            api_key=account_cluster.api_key,
            user_metadata={"batch": "search", "i": str(i)},
        )
        for i in range(5)
    ]
    ids = [s.holder.get_session_id() for s in services]
    try:
        found = search(rest, user_metadata={"batch": "search"}, limit=2)
        seen = [s.session_id for s in found.sessions]
        while found.next_cursor is not None:
            found = search(
                rest, user_metadata={"batch": "search"}, limit=2, cursor=found.next_cursor
            )
            seen += [s.session_id for s in found.sessions]
        assert seen == ids[::-1]  # newest first, each once
        one = search(rest, user_metadata={"batch": "search", "i": "3"}).sessions
        assert [s.session_id for s in one] == [ids[3]]
        assert one[0].status is not None and one[0].status.type == "active"

        mine = search(rest, session_id=worked.session_id).sessions
        (summary,) = mine
        assert summary.user_metadata == {"purpose": "account-test"}
        listed = rest.list_checkpoints(worked.run_id).result().checkpoints
        assert summary.checkpoints_count == len(listed)
        assert summary.checkpoint_storage_bytes == sum(c.size_bytes or 0 for c in listed)
        assert summary.status is not None and summary.status.type == "client_finished"
        assert summary.owner == "default" and summary.project_id == "default"
        done = search(
            rest, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])]
        ).sessions
        assert worked.session_id in {s.session_id for s in done}
        assert not set(ids) & {s.session_id for s in done}
        active = {
            s.session_id for s in search(rest, statuses=[types.ActiveSessionStatusQuery()]).sessions
        }
        assert set(ids) <= active and worked.session_id not in active
        assert search(rest, statuses=[types.FailedSessionStatusQuery()]).sessions == []

        other = rest_client(account_cluster, OTHER_TENANT_KEY)
        assert search(other, session_id=worked.session_id).sessions == []
        theirs = {s.session_id for s in search(other, limit=200).sessions}
        assert not theirs & {*ids, worked.session_id}
    finally:
        for service in services:
            service.close("success").result()


def test_hostile_parameters_get_a_4xx_naming_them(account_cluster: Cluster) -> None:
    http = httpx.Client(
        base_url=account_cluster.base_url,
        headers={"X-API-Key": account_cluster.api_key},
        timeout=30,
    )
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    ok = hour.isoformat()

    def refused(method: str, path: str, status: int, names: str, **kw: Any) -> None:
        resp = http.request(method, path, **kw)
        assert resp.status_code == status, (path, kw, resp.text)
        body = resp.json()
        assert body["category"] == "user" and names in body["detail"], body

    usage = "/api/v1/billing/usage/events"
    refused("GET", usage, 400, "starting_on", params={"ending_before": ok})
    for bad in (
        "0001-01-01T00:00:00+14:00",
        "yesterday",
        "2026-13-01T00:00:00Z",
        "x" * 200,
        (hour + timedelta(minutes=5)).isoformat(),
    ):
        refused("GET", usage, 400, "starting_on", params={"starting_on": bad, "ending_before": ok})
    future = (hour + timedelta(hours=2)).isoformat()
    refused(
        "GET", usage, 400, "starting_on", params={"starting_on": future, "ending_before": future}
    )
    refused("GET", usage, 400, "ending_before", params={"starting_on": ok, "ending_before": ok})
    end_of_time = "9999-12-31T23:00:00-05:00"
    refused(
        "GET", usage, 400, "ending_before", params={"starting_on": ok, "ending_before": end_of_time}
    )
    long_ago = (hour - timedelta(days=15)).isoformat()
    refused(
        "GET", usage, 400, "ending_before", params={"starting_on": long_ago, "ending_before": ok}
    )

    refused("GET", "/api/v1/audit", 400, "event_type", params={"event_type": "keys"})
    for bad_day in (
        "2026-02-30",
        "tomorrow",
        "20260101",
        (hour + timedelta(days=2)).date().isoformat(),
    ):
        refused("GET", "/api/v1/audit", 400, "day", params={"day": bad_day})

    storage = "/api/v1/billing/usage/checkpoints/current"
    refused("GET", storage, 404, "project_id", params={"project_id": "other"})
    refused("GET", storage, 400, "project_id", params={"project_id": "../etc"})

    found = "/api/v1/sessions/search"
    for body, status, names in [
        ({"limit": 0}, 400, "limit"),
        ({"limit": 201}, 400, "limit"),
        ({"limit": "many"}, 400, "limit"),
        ({"session_id": "a/b"}, 400, "session_id"),
        ({"display_name": ""}, 400, "display_name"),
        ({"project_ids": ["other"]}, 404, "project_ids"),
        ({"owner": {"type": "user", "owner_urns": ["other"]}}, 404, "owner"),
        ({"owner": {"type": "everyone"}}, 400, "owner"),
        ({"user_metadata": {str(i): "v" for i in range(100)}}, 400, "user_metadata"),
        ({"statuses": []}, 400, "statuses"),
        ({"statuses": [{"type": "client_finished", "reasons": ["bored"]}]}, 400, "statuses"),
        ({"cursor": {"last_created_at": "soon", "last_session_id": "x"}}, 400, "cursor"),
        ({"cursor": {"last_created_at": ok, "last_session_id": "../x"}}, 400, "cursor"),
    ]:
        refused("POST", found, status, names, json=body)
    assert (
        http.get(
            usage, params={"starting_on": ok, "ending_before": ok}, headers={"X-API-Key": ""}
        ).status_code
        == 401
    )


def test_whoami_needs_jwt_auth_which_this_server_does_not_issue(account_cluster: Cluster) -> None:
    """With JWT auth off the SDK answers `whoami` itself, without a request: a clear error."""
    rest = rest_client(account_cluster, account_cluster.api_key)
    with pytest.raises(RuntimeError, match="JWT"):
        rest.whoami().result()


def test_tinker_billing_commands(account_cluster: Cluster, worked: Worked) -> None:
    """`tinker billing usage` and `tinker billing checkpoint-storage` print our answers."""
    env = {
        **os.environ,
        "TINKER_BASE_URL": account_cluster.base_url,
        "TINKER_API_KEY": account_cluster.api_key,
    }
    tinker_cli = str(Path(sys.executable).with_name("tinker"))

    def run(*args: str) -> Any:
        done = subprocess.run(
            [tinker_cli, "--format", "json", "billing", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return json.loads(done.stdout)

    start, end = window()
    printed = json.dumps(run("usage", start, end))
    assert '"checkpoint"' in printed and '"storage"' in printed  # no flush lag: from records
    storage = run("checkpoint-storage")
    assert json.dumps(storage).count('"checkpoint_count"') == 1
