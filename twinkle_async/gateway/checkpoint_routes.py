"""One checkpoint's lifecycle on the REST API: delete, publish, unpublish, TTL, signed download
URLs, and `copy_weights`.

A checkpoint is addressed as `/training_runs/{run_id}/checkpoints/{kind}/{name}`: its
`checkpoint_id` (`weights/<name>`, `sampler_weights/<name>` or `external_weights/<name>`) holds a
slash. Who may do what:
- read (download URLs, copy): the owner, and every tenant once the checkpoint is published;
- change or delete: the owner only. Anyone else gets the 404 of an id that does not exist, a
  published checkpoint included (published means readable, never writable).
Publishing and unpublishing are idempotent (a retried call whose answer was lost succeeds again).
Files are touched only through `checkpoint_files`, under `GatewaySettings.checkpoint_root`, or
through `store_files` for a checkpoint in the artifact store (its record has a `store_key`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import time
import uuid
from email.utils import formatdate
from pathlib import Path

import msgspec
from aiohttp import web

from protocol import paths, rest_api, rules
from protocol.errors import NotFound, ServerError, UserError
from protocol.paths import TinkerPath
from protocol.records import CheckpointRecord, RunRecord
from twinkle_async import quotas
from twinkle_async.gateway import signed_urls
from twinkle_async.gateway.bodies import json_response, read_json
from twinkle_async.gateway.checkpoint_files import (
    downloadable_files,
    link_copy,
    remove_checkpoint,
)
from twinkle_async.gateway.state import ARTIFACTS, QUOTAS, REGISTRY, SETTINGS, TENANT
from twinkle_async.gateway.store_files import StoreFiles

routes = web.RouteTableDef()

CHECKPOINT = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"


def _checkpoint_path(request: web.Request) -> TinkerPath:
    info = request.match_info
    return paths.parse_path(
        f"{paths.SCHEME}{info['run_id']}/{info['kind']}/{info['name']}", "checkpoint"
    )


def checkpoint_root(request: web.Request) -> Path:
    """The checkpoint store, for the routes that need its files."""
    root = request.app[SETTINGS].checkpoint_root
    if root is None:
        raise ServerError(
            "this gateway has no checkpoint store configured (start it with --data-dir or"
            " --checkpoint-root)",
            code="no_checkpoint_store",
            status=501,
        )
    return root


def artifact_store(request: web.Request, held: CheckpointRecord | str) -> StoreFiles:
    """The artifact store holding a stored checkpoint (`store_key` set), or what `held` names."""
    store = request.app[ARTIFACTS]
    if store is None:
        what = held if isinstance(held, str) else f"checkpoint {held.path}"
        raise ServerError(
            f"{what} is in an artifact store this gateway has not been given"
            " (start it with --artifact-store)",
            code="no_checkpoint_store",
            status=501,
        )
    return store


def base_url(request: web.Request) -> str:
    """Where clients reach this gateway: the configured public URL, else the request's own."""
    public = request.app[SETTINGS].public_url
    return public.rstrip("/") if public else f"{request.scheme}://{request.host}"


@routes.delete(CHECKPOINT)
async def delete_checkpoint(request: web.Request) -> web.Response:
    path = _checkpoint_path(request)
    registry = request.app[REGISTRY]
    ckpt = await registry.owned_checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    await remove_checkpoint(
        registry, request.app[SETTINGS].checkpoint_root, request.app[ARTIFACTS], ckpt
    )
    return json_response({})


@routes.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}")
async def delete_unprefixed_checkpoint(request: web.Request) -> web.Response:
    """A checkpoint id without its kind: name the form instead of a 404 for the route."""
    shown = request.match_info["checkpoint_id"][:60]
    raise UserError(
        f"checkpoint_id: {shown!r} must start with 'weights/' or 'sampler_weights/'"
        " (as in weights/<name>)"
    )


async def _set_public(request: web.Request, public: bool) -> web.Response:
    path = _checkpoint_path(request)
    await request.app[REGISTRY].update_checkpoint(
        path.run_id,
        path.checkpoint_id,
        request[TENANT],
        lambda ckpt: msgspec.structs.replace(ckpt, public=public),
    )
    return json_response({})


@routes.post(f"{CHECKPOINT}/publish")
async def publish_checkpoint(request: web.Request) -> web.Response:
    return await _set_public(request, True)


@routes.delete(f"{CHECKPOINT}/publish")
async def unpublish_checkpoint(request: web.Request) -> web.Response:
    return await _set_public(request, False)


@routes.put(f"{CHECKPOINT}/ttl")
async def set_checkpoint_ttl(request: web.Request) -> web.Response:
    """`ttl_seconds` from now, or null: never expires."""
    path = _checkpoint_path(request)
    body = await read_json(request, rest_api.CheckpointTtlRequest)
    ttl_s = rules.check_ttl_seconds("ttl_seconds", body.ttl_seconds)
    expires_at = time.time() + ttl_s if ttl_s is not None else None
    await request.app[REGISTRY].update_checkpoint(
        path.run_id,
        path.checkpoint_id,
        request[TENANT],
        lambda ckpt: msgspec.structs.replace(ckpt, expires_at=expires_at),
    )
    return json_response({})


async def _readable(request: web.Request) -> tuple[TinkerPath, CheckpointRecord]:
    path = _checkpoint_path(request)
    ckpt = await request.app[REGISTRY].checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    return path, ckpt


@routes.get(f"{CHECKPOINT}/external_weights_urls")
async def external_weights_urls(request: web.Request) -> web.Response:
    """A signed URL per file (what `tinker checkpoint download` fetches), for any kind."""
    path, ckpt = await _readable(request)
    settings = request.app[SETTINGS]
    expires = int(time.time() + settings.download_url_ttl_s)
    if ckpt.store_key:  # presigned URLs of the store: the bytes never pass through a gateway
        store = artifact_store(request, ckpt)
        stored = await store.files(ckpt.store_key)
        if not stored:
            raise NotFound(f"checkpoint {ckpt.path} has no files in the store")
        ttl_s = settings.download_url_ttl_s
        urls = {f.name: await store.sign(ckpt.store_key, f.name, ttl_s) for f in stored}
    else:
        directory = paths.checkpoint_dir(checkpoint_root(request), path)
        files = await asyncio.to_thread(downloadable_files, directory)
        if not files:
            raise NotFound(f"checkpoint {ckpt.path} has no files in the store")
        base = base_url(request)
        urls = {
            f.name: signed_urls.file_url(
                base, settings.download_secret, path, f.name, ckpt.content_id, expires
            )
            for f in files
        }
    return json_response(
        rest_api.ExternalWeightsUrlsResponse(
            urls=urls, expires=dt.datetime.fromtimestamp(expires, dt.UTC)
        )
    )


@routes.get(f"{CHECKPOINT}/archive")
async def checkpoint_archive(request: web.Request) -> web.Response:
    """Older SDKs: a 302 to a signed tar of the checkpoint's files, `Expires` when it lapses."""
    path, ckpt = await _readable(request)
    url, expires = archive_location(request, path, ckpt)
    return web.Response(
        status=302, headers={"Location": url, "Expires": formatdate(expires, usegmt=True)}
    )


def archive_location(
    request: web.Request, path: TinkerPath, ckpt: CheckpointRecord
) -> tuple[str, int]:
    """A signed URL of a tar of the checkpoint's files, and when it lapses (Unix seconds)."""
    # no link to a download this gateway could not serve
    if ckpt.store_key:
        artifact_store(request, ckpt)
    else:
        checkpoint_root(request)
    settings = request.app[SETTINGS]
    expires = int(time.time() + settings.download_url_ttl_s)
    url = signed_urls.archive_url(
        base_url(request), settings.download_secret, path, ckpt.content_id, expires
    )
    return url, expires


# -- copy_weights ---------------------------------------------------------------------------

_MAX_CLIENT_SEQ = 2**31 - 1


def _copy_run_id(request: web.Request, body: rest_api.CopyWeightsRequest) -> str:
    """The run that holds the copy: `<session>:train:<model_seq_id>` in a session, else one
    derived from the SDK's idempotency key, so a retried copy finds the copy it made."""
    if body.session_id is not None or body.model_seq_id is not None:
        if body.session_id is None or body.model_seq_id is None:
            raise UserError("copy_weights: session_id and model_seq_id must be given together")
        if not 0 <= body.model_seq_id <= _MAX_CLIENT_SEQ:
            raise UserError(
                f"model_seq_id: {body.model_seq_id} is out of range 0..{_MAX_CLIENT_SEQ}"
            )
        return f"{body.session_id}:train:{body.model_seq_id}"
    if not body.destination_project_id:
        raise UserError("copy_weights needs destination_project_id, or session_id and model_seq_id")
    key = request.headers.get("X-Idempotency-Key") or uuid.uuid4().hex
    digest = hashlib.sha256(f"{request[TENANT]}\n{key}".encode()).hexdigest()[:24]
    return f"copy-{digest}"


@routes.post("/api/v1/copy_weights")
async def copy_weights(request: web.Request) -> web.Response:
    """Copy a readable checkpoint (own or published) into a new run of the caller's that is
    never trained: same kind and name, files hard-linked, its own TTL (the source's is not
    inherited). Projects do not exist here: `destination_project_id` only selects this form."""
    body = await read_json(request, rest_api.CopyWeightsRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    source = paths.parse_path(body.source_path, "source_path")
    ckpt = await registry.checkpoint(source.run_id, source.checkpoint_id, tenant)
    ttl_s = rules.check_ttl_seconds("ttl_seconds", body.ttl_seconds)
    if body.session_id is not None:
        await registry.session(body.session_id, tenant)
    run_id = rules.check_id("model_id", _copy_run_id(request, body))
    target = TinkerPath(run_id=run_id, kind=source.kind, name=source.name)
    existing = await registry.find_run(run_id)
    if existing is not None:
        if existing.tenant_id == tenant and existing.copied_from == str(source):
            return json_response(rest_api.CopyWeightsResponse(tinker_path=str(target)))  # a retry
        raise UserError(f"model_seq_id: training run {run_id!r} already exists")
    limit = (await request.app[QUOTAS].limits(tenant)).max_checkpoint_bytes
    if limit is not None:  # the copy counts as the caller's, as a save does
        used = sum(c.size_bytes for c in await registry.tenant_checkpoints(tenant))
        quotas.check_cap("max_checkpoint_bytes", used, ckpt.size_bytes, limit)
    target_dir = store_key = ""
    try:
        if ckpt.store_key:  # a server-side copy into the target's own, never-shared prefix
            store_key = paths.checkpoint_key(target, ckpt.content_id or uuid.uuid4().hex[:16])
            await artifact_store(request, ckpt).copy(ckpt.store_key, store_key)
        else:
            root = checkpoint_root(request)
            target_dir = str(paths.checkpoint_dir(root, target))
            await asyncio.to_thread(link_copy, paths.checkpoint_dir(root, source), Path(target_dir))
    except FileNotFoundError:
        raise NotFound(f"source_path: {body.source_path!r} has no files in the store") from None
    now = time.time()
    await registry.put_checkpoint(
        msgspec.structs.replace(
            ckpt,
            run_id=run_id,
            tenant_id=tenant,
            path=str(target),
            directory=target_dir,
            store_key=store_key,
            created_at=now,
            public=False,
            expires_at=now + ttl_s if ttl_s is not None else None,
        )
    )
    # the run record last: it marks the copy complete for a retry
    await registry.put_run(
        RunRecord(
            model_id=run_id,
            tenant_id=tenant,
            session_id=body.session_id or "",
            base_model=ckpt.base_model,
            lora=ckpt.lora,
            created_at=now,
            last_request_time=now,
            copied_from=str(source),
        )
    )
    return json_response(rest_api.CopyWeightsResponse(tinker_path=str(target)))
