"""The admin API's stored data: every tenant's checkpoints (list, delete, publish, unpublish,
TTL) and deleting a run with its checkpoints.

Guarded by the admin key like the rest of `/admin/v1`. A checkpoint is named by its `tinker://`
path in the JSON body (its id holds a slash). Files are removed through `checkpoint_files`, as
the tenants' own REST calls do; records change with a compare-and-set, so an operator's change
and a tenant's never overwrite each other.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from protocol import api, paths, rules
from protocol.errors import NotFound, UserError
from protocol.records import CheckpointRecord
from twinkle_async.gateway.bodies import json_response, read_body
from twinkle_async.gateway.checkpoint_files import remove_checkpoint
from twinkle_async.gateway.state import ARTIFACTS, REGISTRY, SETTINGS

routes = web.RouteTableDef()


class CheckpointRef(msgspec.Struct, forbid_unknown_fields=True):
    path: str


class CheckpointTtl(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    ttl_seconds: int | None


async def _checkpoint(request: web.Request, tinker_path: str) -> CheckpointRecord:
    path = paths.parse_path(tinker_path)
    ckpt = await request.app[REGISTRY].find_checkpoint(path.run_id, path.checkpoint_id)
    if ckpt is None:
        raise NotFound(f"checkpoint {tinker_path!r} not found")
    return ckpt


@routes.get("/admin/v1/checkpoints")
async def list_checkpoints(request: web.Request) -> web.Response:
    """Every tenant's checkpoints, newest first; `tenant` and `run_id` narrow it (both: AND)."""
    registry = request.app[REGISTRY]
    tenant = request.query.get("tenant")
    run_id = request.query.get("run_id")
    if run_id:
        found = await registry.checkpoints(rules.check_id("run_id", run_id))
    else:
        found = await registry.all_checkpoints()
    if tenant:
        rules.check_tenant_name("tenant", tenant)
        found = [c for c in found if c.tenant_id == tenant]
    found.sort(key=lambda c: c.created_at, reverse=True)
    return json_response({"checkpoints": [msgspec.to_builtins(c) for c in found]})


@routes.post("/admin/v1/checkpoints/delete")
async def delete_checkpoint(request: web.Request) -> web.Response:
    body = api.decode(await read_body(request), CheckpointRef)
    ckpt = await _checkpoint(request, body.path)
    await remove_checkpoint(
        request.app[REGISTRY], request.app[SETTINGS].checkpoint_root, request.app[ARTIFACTS], ckpt
    )
    return json_response({"deleted": ckpt.path})


async def _change(request: web.Request, tinker_path: str, **fields: Any) -> web.Response:
    ckpt = await _checkpoint(request, tinker_path)
    changed = await request.app[REGISTRY].update_checkpoint(
        ckpt.run_id,
        ckpt.checkpoint_id,
        ckpt.tenant_id,
        lambda current: msgspec.structs.replace(current, **fields),
    )
    return json_response(msgspec.to_builtins(changed))


@routes.post("/admin/v1/checkpoints/publish")
async def publish_checkpoint(request: web.Request) -> web.Response:
    body = api.decode(await read_body(request), CheckpointRef)
    return await _change(request, body.path, public=True)


@routes.post("/admin/v1/checkpoints/unpublish")
async def unpublish_checkpoint(request: web.Request) -> web.Response:
    body = api.decode(await read_body(request), CheckpointRef)
    return await _change(request, body.path, public=False)


@routes.post("/admin/v1/checkpoints/ttl")
async def set_checkpoint_ttl(request: web.Request) -> web.Response:
    """`ttl_seconds` from now, or null: never expires."""
    body = api.decode(await read_body(request), CheckpointTtl)
    ttl_s = rules.check_ttl_seconds("ttl_seconds", body.ttl_seconds)
    expires_at = time.time() + ttl_s if ttl_s is not None else None
    return await _change(request, body.path, expires_at=expires_at)


@routes.delete("/admin/v1/runs/{run_id}")
async def delete_run(request: web.Request) -> web.Response:
    """A run's record and every checkpoint of it; its adapter must have left the worker."""
    run_id = rules.check_id("run_id", request.match_info["run_id"])
    registry = request.app[REGISTRY]
    run = await registry.find_run(run_id)
    if run is None:
        raise NotFound(f"run {run_id!r} not found")
    if run.unloaded_at is None:
        raise UserError(
            f"run {run_id!r} is still loaded on a worker; unload it first (twinkle-admin runs"
            " unload), which also saves its state"
        )
    ckpts = await registry.checkpoints(run_id)
    root = request.app[SETTINGS].checkpoint_root
    for ckpt in ckpts:
        await remove_checkpoint(registry, root, request.app[ARTIFACTS], ckpt)
    await registry.delete_run(run_id)
    return json_response({"deleted": run_id, "checkpoints": len(ckpts)})
