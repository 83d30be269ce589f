"""The admin API, `/admin/v1/...`: tenants, keys, quotas, usage, runs, sessions, workers, queues.

Guarded by the admin key (`X-Admin-Key`, checked in the auth middleware). JSON in and out; the
`twinkle-admin` command wraps every route. An operator sees every tenant's records; nothing
here is reachable with a tenant's API key.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from protocol import api, records, rules, subjects
from protocol.errors import NotFound, UserError
from protocol.records import KeyRecord, QuotaRecord, TenantRecord, UsageRecord
from twinkle_async.gateway import rest_routes
from twinkle_async.gateway.bodies import json_response, read_body
from twinkle_async.gateway.state import BUS, KEYS, LIFECYCLE, QUOTAS, REGISTRY, SETTINGS
from twinkle_async.quotas import LIMIT_NAMES, MAX_IN_FLIGHT
from twinkle_async.registry import WORKER_STALE_S

routes = web.RouteTableDef()


class TenantCreate(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    display_name: str = ""


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str
    label: str = ""


class QuotaSet(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Limits to set; a field given as null clears that override (back to the default)."""

    max_adapters: int | None | msgspec.UnsetType = msgspec.UNSET
    max_rank: int | None | msgspec.UnsetType = msgspec.UNSET
    max_tokens_per_request: int | None | msgspec.UnsetType = msgspec.UNSET
    tokens_per_minute: int | None | msgspec.UnsetType = msgspec.UNSET
    max_concurrent_samples: int | None | msgspec.UnsetType = msgspec.UNSET
    max_checkpoint_bytes: int | None | msgspec.UnsetType = msgspec.UNSET


def _plain(obj: Any) -> Any:
    """A record as plain JSON data."""
    return msgspec.to_builtins(obj)


def _key_view(record: KeyRecord) -> dict[str, Any]:
    """What a key's listing shows: never the hash, never the key."""
    return {
        "key_id": record.key_id,
        "tenant": record.tenant_id,
        "prefix": record.prefix,
        "label": record.label,
        "created_at": record.created_at,
        "revoked_at": record.revoked_at,
        "bootstrap": False,
    }


def _bootstrap_keys(request: web.Request, tenant: str | None) -> list[dict[str, Any]]:
    """The keys given on the command line (`--api-key`, `--key-file`): listed, not revocable."""
    return [
        {
            "key_id": f"bootstrap-{index}",
            "tenant": owner,
            "prefix": key[:10],
            "label": "from --api-key / --key-file",
            "created_at": None,
            "revoked_at": None,
            "bootstrap": True,
        }
        for index, (key, owner) in enumerate(sorted(request.app[SETTINGS].api_keys.items()))
        if tenant is None or owner == tenant
    ]


async def _known_tenant(request: web.Request, name: str) -> str:
    """A tenant that exists: created through this API, or one of the bootstrap keys' tenants."""
    rules.check_tenant_name("tenant", name)
    bootstrap = set(request.app[SETTINGS].api_keys.values())
    if name not in bootstrap and await request.app[REGISTRY].tenant(name) is None:
        raise NotFound(f"tenant {name!r} not found")
    return name


def _tenant_filter(request: web.Request) -> str | None:
    name = request.query.get("tenant")
    return rules.check_tenant_name("tenant", name) if name else None


# -- tenants ------------------------------------------------------------------------------------


@routes.post("/admin/v1/tenants")
async def create_tenant(request: web.Request) -> web.Response:
    body = api.decode(await read_body(request), TenantCreate)
    rules.check_tenant_name("name", body.name)
    rules.check_label("display_name", body.display_name)
    tenant = TenantRecord(name=body.name, created_at=time.time(), display_name=body.display_name)
    bootstrap = set(request.app[SETTINGS].api_keys.values())
    if body.name in bootstrap or not await request.app[REGISTRY].create_tenant(tenant):
        raise UserError(f"name: tenant {body.name!r} already exists")
    return json_response(_plain(tenant))


@routes.get("/admin/v1/tenants")
async def list_tenants(request: web.Request) -> web.Response:
    stored = await request.app[REGISTRY].tenants()
    keys = await request.app[KEYS].list()
    names = {t.name for t in stored}
    bootstrap = sorted(set(request.app[SETTINGS].api_keys.values()) - names)
    rows = [{**_plain(t), "bootstrap": False, "keys": _live_keys(keys, t.name)} for t in stored] + [
        {"name": name, "created_at": None, "display_name": "", "bootstrap": True, "keys": 0}
        for name in bootstrap
    ]
    return json_response({"tenants": rows})


def _live_keys(keys: list[KeyRecord], tenant: str) -> int:
    return sum(1 for k in keys if k.tenant_id == tenant and k.revoked_at is None)


@routes.get("/admin/v1/tenants/{name}")
async def show_tenant(request: web.Request) -> web.Response:
    name = await _known_tenant(request, request.match_info["name"])
    stored = await request.app[REGISTRY].tenant(name)
    keys = await request.app[KEYS].list(name)
    view = (
        {**_plain(stored), "bootstrap": False}
        if stored
        else {"name": name, "created_at": None, "display_name": "", "bootstrap": True}
    )
    return json_response(
        {
            "tenant": view,
            "quotas": await _quota_view(request, name),
            "usage": await _usage_of(request, name),
            "keys": [*_bootstrap_keys(request, name), *(_key_view(k) for k in keys)],
        }
    )


# -- keys ---------------------------------------------------------------------------------------


@routes.post("/admin/v1/keys")
async def create_key(request: web.Request) -> web.Response:
    body = api.decode(await read_body(request), KeyCreate)
    tenant = await _known_tenant(request, body.tenant)
    key, record = await request.app[KEYS].create(tenant, rules.check_label("label", body.label))
    return json_response({**_key_view(record), "key": key})


@routes.get("/admin/v1/keys")
async def list_keys(request: web.Request) -> web.Response:
    tenant = _tenant_filter(request)
    keys = await request.app[KEYS].list(tenant)
    return json_response({"keys": [*_bootstrap_keys(request, tenant), *map(_key_view, keys)]})


@routes.post("/admin/v1/keys/{key_id}/revoke")
async def revoke_key(request: web.Request) -> web.Response:
    key_id = request.match_info["key_id"]
    rules.check_id("key_id", key_id)
    if key_id.startswith("bootstrap-"):
        raise UserError(
            f"key_id: {key_id!r} comes from --api-key / --key-file; restart the gateway without it"
        )
    return json_response(_key_view(await request.app[KEYS].revoke(key_id)))


# -- quotas and usage ---------------------------------------------------------------------------


async def _quota_view(request: web.Request, tenant: str) -> dict[str, Any]:
    quotas = request.app[QUOTAS]
    record = await quotas.record(tenant)
    limits = await quotas.limits(tenant)
    overrides = {n: getattr(record, n) for n in LIMIT_NAMES} if record else {}
    return {
        "tenant": tenant,
        "limits": {n: getattr(limits, n) for n in LIMIT_NAMES},
        "overrides": {n: v for n, v in overrides.items() if v is not None},
    }


@routes.get("/admin/v1/quotas/{tenant}")
async def show_quotas(request: web.Request) -> web.Response:
    tenant = await _known_tenant(request, request.match_info["tenant"])
    return json_response(await _quota_view(request, tenant))


@routes.put("/admin/v1/quotas/{tenant}")
async def set_quotas(request: web.Request) -> web.Response:
    tenant = await _known_tenant(request, request.match_info["tenant"])
    body = api.decode(await read_body(request), QuotaSet)
    quotas = request.app[QUOTAS]
    record = await quotas.record(tenant) or QuotaRecord(tenant_id=tenant)
    for name in LIMIT_NAMES:
        value = getattr(body, name)
        if value is msgspec.UNSET:
            continue
        top = MAX_IN_FLIGHT if name == "max_concurrent_samples" else 2**62
        if value is not None and not 0 <= value <= top:
            raise UserError(f"{name}: {value} is out of range 0..{top} (or null for the default)")
        setattr(record, name, value)
    await quotas.set(record)
    return json_response(await _quota_view(request, tenant))


_USAGE_COUNTS = tuple(
    f for f in UsageRecord.__struct_fields__ if f not in ("tenant_id", "worker_id", "updated_at")
)


async def _usage_of(request: web.Request, tenant: str) -> dict[str, Any]:
    """What ran for a tenant: the workers' counters summed, plus what it holds now."""
    bus = request.app[BUS]
    totals = dict.fromkeys(_USAGE_COUNTS, 0)
    for value in await bus.values(subjects.BUCKET_USAGE, f"u.{tenant}"):
        usage = records.decode(value, UsageRecord)
        for name in _USAGE_COUNTS:
            totals[name] += getattr(usage, name)
    registry = request.app[REGISTRY]
    runs = await registry.runs(tenant)
    stored = sum(c.size_bytes for c in await registry.tenant_checkpoints(tenant))
    return {
        "tenant": tenant,
        **totals,
        "active_adapters": sum(1 for run in runs if run.unloaded_at is None),
        "runs": len(runs),
        "checkpoint_bytes": stored,
    }


@routes.get("/admin/v1/usage")
async def usage(request: web.Request) -> web.Response:
    only = _tenant_filter(request)
    if only is not None:
        tenants = [await _known_tenant(request, only)]
    else:
        stored = [t.name for t in await request.app[REGISTRY].tenants()]
        tenants = sorted(set(stored) | set(request.app[SETTINGS].api_keys.values()))
    return json_response({"usage": [await _usage_of(request, t) for t in tenants]})


# -- runs and sessions --------------------------------------------------------------------------


async def _any_run(request: web.Request) -> Any:
    run_id = request.match_info["run_id"]
    rules.check_id("run_id", run_id)
    run = await request.app[REGISTRY].find_run(run_id)
    if run is None:
        raise NotFound(f"run {run_id!r} not found")
    return run


@routes.get("/admin/v1/runs")
async def list_runs(request: web.Request) -> web.Response:
    runs = await request.app[REGISTRY].runs(_tenant_filter(request))
    return json_response({"runs": [_plain(run) for run in runs]})


@routes.get("/admin/v1/runs/{run_id}")
async def show_run(request: web.Request) -> web.Response:
    run = await _any_run(request)
    ckpts = await request.app[REGISTRY].checkpoints(run.model_id)
    return json_response({"run": _plain(run), "checkpoints": [_plain(c) for c in ckpts]})


@routes.get("/admin/v1/runs/{run_id}/metrics")
async def run_metrics(request: web.Request) -> web.Response:
    run = await _any_run(request)
    return json_response({"steps": await rest_routes.metric_steps(request, run.model_id)})


@routes.post("/admin/v1/runs/{run_id}/unload")
async def unload_run(request: web.Request) -> web.Response:
    """Take a run's adapter off the worker now, its state saved as `session-end`."""
    run = await _any_run(request)
    if run.unloaded_at is not None:
        raise UserError(f"run {run.model_id!r} is already unloaded")
    request_id = await request.app[LIFECYCLE].unload(run)
    return json_response({"run_id": run.model_id, "request_id": request_id})


@routes.get("/admin/v1/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    sessions = await request.app[REGISTRY].sessions(_tenant_filter(request))
    return json_response({"sessions": [_plain(s) for s in sessions]})


@routes.get("/admin/v1/sessions/{session_id}")
async def show_session(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    rules.check_id("session_id", session_id)
    entry = await request.app[REGISTRY].session_entry(session_id)
    if entry is None:
        raise NotFound(f"session {session_id!r} not found")
    session = entry[0]
    runs = [
        _plain(r)
        for r in await request.app[REGISTRY].runs(session.tenant_id)
        if r.session_id == session_id
    ]
    return json_response({"session": _plain(session), "runs": runs})


# -- workers and queues -------------------------------------------------------------------------


@routes.get("/admin/v1/workers")
async def list_workers(request: web.Request) -> web.Response:
    now = time.time()
    depth = {c["pool"]: c for c in await consumer_depths(request) if c["pool"]}
    rows = []
    for worker in sorted(request.app[REGISTRY].workers.values(), key=lambda w: w.worker_id):
        row = _plain(worker)
        row["stale"] = now - worker.heartbeat_at > WORKER_STALE_S
        row["queue_depth"] = depth.get(worker.pool, {}).get("backlog", 0)
        rows.append(row)
    return json_response({"workers": rows})


async def consumer_depths(request: web.Request) -> list[dict[str, Any]]:
    """Every consumer of the ops and sample streams, and each pool's `backlog`: the jobs its
    consumers have not finished (pending delivery plus delivered and not yet acked)."""
    js = request.app[BUS].js
    assert js is not None
    pools: dict[str, dict[str, Any]] = {}
    rows = []
    for stream in (subjects.STREAM_OPS, subjects.STREAM_SAMPLE):
        for info in await js.consumers_info(stream):
            name = info.name or ""
            rows.append(
                {
                    "stream": stream,
                    "consumer": name,
                    "num_pending": info.num_pending or 0,
                    "num_ack_pending": info.num_ack_pending or 0,
                    "num_redelivered": info.num_redelivered or 0,
                }
            )
            pool = _pool_of_consumer(name)
            if pool:
                summed = pools.setdefault(pool, {"pool": pool, "backlog": 0})
                summed["backlog"] += (info.num_pending or 0) + (info.num_ack_pending or 0)
    return [*pools.values(), *({"pool": "", **row} for row in rows)]


def _pool_of_consumer(name: str) -> str:
    """`ops-<pool>-<shard>` and `sample-<pool>` → `<pool>`."""
    if name.startswith("ops-"):
        return name[len("ops-") :].rpartition("-")[0]
    if name.startswith("sample-"):
        return name[len("sample-") :]
    return ""


@routes.get("/admin/v1/queues")
async def queues(request: web.Request) -> web.Response:
    js = request.app[BUS].js
    assert js is not None
    streams = []
    for stream in (subjects.STREAM_OPS, subjects.STREAM_SAMPLE):
        info = await js.stream_info(stream)
        streams.append(
            {
                "stream": stream,
                "messages": info.state.messages,
                "bytes": info.state.bytes,
                "consumers": info.state.consumer_count,
            }
        )
    rows = await consumer_depths(request)
    return json_response(
        {
            "streams": streams,
            "pools": [r for r in rows if r["pool"] and "consumer" not in r],
            "consumers": [
                {k: v for k, v in r.items() if k != "pool"} for r in rows if "consumer" in r
            ],
        }
    )
