"""Adapters out and in, for operators: export a checkpoint as a PEFT folder or a merged model,
import a PEFT adapter trained elsewhere as a tenant's training checkpoint.

Guarded by the admin key like the rest of `/admin/v1` (the operator may move any tenant's
checkpoint); `twinkle-admin checkpoints export|import` wraps these routes over HTTP alone.

1. `POST /admin/v1/checkpoints/export {"path", "merged", "layout"}`: an adapter export answers
   at once with signed URLs of the checkpoint's two PEFT files when they are in the `layout`
   asked for (always, for an adapter without fused MoE experts). A merged export, or a MoE
   adapter in another layout (`protocol.jobs.AdapterLayout`), needs torch, so it is an
   `ExportMergedJob` for a worker of the base model, which writes the whole model or the
   adapter folder under `<root>/.exports/<export_id>/` (with an artifact store: under
   `.exports/<export_id>/` in the store); the answer is `{"state": "pending", "request_id"}`
   until it is done, then the files' signed URLs (`GET /files/v1/exports/<id>/<file>`, or
   presigned URLs of the store).
2. `POST /admin/v1/checkpoints/import?tenant=&name=[&base_model=]`, multipart with the parts
   `adapter_config.json` and `adapter_model.safetensors`: streamed to `<root>/.imports/<id>/`
   (with an artifact store: to `.imports/<id>/` in the store, a manifest last)
   within `MAX_UPLOAD_BYTES` (and the tenant's `max_checkpoint_bytes`), checked here as far as
   JSON allows (peft type, rank against the worker's cap and the tenant's quota, base model),
   then an `ImportAdapterJob` on a new, never-trained run of the tenant checks the tensors
   against the model and writes `tinker://<run>/weights/<name>` with fresh optimizer state.
3. `GET /admin/v1/transfers/<request_id>`: a pending job's answer, long-polled (`WAIT_S`, under
   the CLI's timeout). Every await on a worker is bounded by it.

Invariants: the gateway never opens a tensor; an upload costs at most its bound in disk and
nothing in memory beyond one chunk; a refused import leaves no run, file or record behind.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import msgspec
from aiohttp import BodyPartReader, web

from protocol import api, paths, rules, subjects
from protocol.api import LoraConfig
from protocol.errors import NotFound, PayloadTooLarge, ServerError, UserError
from protocol.jobs import (
    EXPORTS_DIR,
    AdapterLayout,
    ExportMergedJob,
    ImportAdapterJob,
    Job,
    Outcome,
    import_staging_dir,
    import_staging_key,
    merged_export_dir,
    merged_export_key,
)
from protocol.paths import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from protocol.records import CheckpointRecord, RunRecord
from twinkle_async.futures import new_request_id
from twinkle_async.gateway import signed_urls
from twinkle_async.gateway.admin_routes import _known_tenant
from twinkle_async.gateway.bodies import json_response, read_body
from twinkle_async.gateway.checkpoint_files import downloadable_files
from twinkle_async.gateway.checkpoint_routes import artifact_store, base_url, checkpoint_root
from twinkle_async.gateway.state import ARTIFACTS, BUS, FUTURES, QUOTAS, REGISTRY, SETTINGS
from twinkle_async.gateway.store_files import StoreFiles
from twinkle_async.quotas import check_limit, check_room

routes = web.RouteTableDef()

ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
MAX_UPLOAD_BYTES = 4 << 30  # an adapter's tensors: far above any LoRA of a served model
MAX_CONFIG_BYTES = 64 << 10
WAIT_S = 20.0  # one long-poll of a transfer job (the CLI waits 30 s for an answer)
URL_TTL_S = 3600
EXPORT_KEEP_S = 6 * 3600  # merged exports older than this go when the next one starts
_CHUNK_BYTES = 1 << 20


class ExportRequest(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    merged: bool = False
    layout: AdapterLayout = "peft"  # of a MoE adapter's experts; not with `merged`


# Tinker's 3-D expert keys in a `target_modules` regex or list (checkpoints written before the
# trainer wrote PEFT's `target_parameters` layout).
_TINKER_EXPERTS = re.compile(r"experts\\*\.w[123]")


# -- export -------------------------------------------------------------------------------------


@routes.post("/admin/v1/checkpoints/export")
async def export_checkpoint(request: web.Request) -> web.Response:
    body = api.decode(await read_body(request), ExportRequest)
    path = paths.parse_path(body.path)
    registry = request.app[REGISTRY]
    ckpt = await registry.find_checkpoint(path.run_id, path.checkpoint_id)
    if ckpt is None:
        raise NotFound(f"checkpoint {body.path!r} not found")
    if body.merged and body.layout != "peft":
        raise UserError("layout: a merged export is a whole model, not an adapter in a layout")
    if ckpt.store_key:
        store = artifact_store(request, ckpt)
        if not body.merged:
            config = await store.read_small(ckpt.store_key, ADAPTER_CONFIG, MAX_CONFIG_BYTES)
            if _layout_of(config) in (None, body.layout):
                return await _export_stored(store, ckpt, body)
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=EXPORT_KEEP_S)
        await store.delete_older(EXPORTS_DIR, cutoff)
    else:
        root = checkpoint_root(request)
        directory = paths.checkpoint_dir(root, path)
        stored = None if body.merged else await asyncio.to_thread(_stored_layout, directory)
        if not body.merged and stored in (None, body.layout):
            return await _export_local(request, body, ckpt, path, directory)
        await asyncio.to_thread(_sweep_exports, root, time.time())
    registry.check_base_model(ckpt.base_model)
    export_id = uuid.uuid4().hex
    job = ExportMergedJob(
        request_id=new_request_id("export_merged"),
        model_id=f"export-{export_id}",
        tenant_id=ckpt.tenant_id,
        seq_id=0,
        published_at=time.time(),
        path=ckpt.path,
        export_id=export_id,
        layout=None if body.merged else body.layout,
        content_id=ckpt.content_id if ckpt.store_key else "",
    )
    await _submit(request, ckpt.base_model, job, "export_merged")
    return await _answer(request, job.request_id)


async def _export_local(
    request: web.Request,
    body: ExportRequest,
    ckpt: CheckpointRecord,
    path: paths.TinkerPath,
    directory: Path,
) -> web.Response:
    """An adapter export of a checkpoint on this gateway's disk: its files' signed URLs."""
    found = await asyncio.to_thread(downloadable_files, directory)
    files = [f for f in found if f.name in ADAPTER_FILES]
    if len(files) != len(ADAPTER_FILES):
        raise NotFound(f"checkpoint {body.path!r} has no PEFT adapter files in the store")
    settings = request.app[SETTINGS]
    expires = int(time.time()) + URL_TTL_S
    listed = [
        {
            "name": f.name,
            "size": f.stat().st_size,
            "url": signed_urls.file_url(
                base_url(request),
                settings.download_secret,
                path,
                f.name,
                ckpt.content_id,
                expires,
            ),
        }
        for f in files
    ]
    return _adapter_answer(body, ckpt, listed)


async def _export_stored(
    store: StoreFiles, ckpt: CheckpointRecord, body: ExportRequest
) -> web.Response:
    """An adapter export of a checkpoint in the artifact store: presigned URLs of its files."""
    files = [f for f in await store.files(ckpt.store_key) if f.name in ADAPTER_FILES]
    if len(files) != len(ADAPTER_FILES):
        raise NotFound(f"checkpoint {body.path!r} has no PEFT adapter files in the store")
    listed = [
        {"name": f.name, "size": f.size, "url": await store.sign(ckpt.store_key, f.name, URL_TTL_S)}
        for f in files
    ]
    return _adapter_answer(body, ckpt, listed)


def _adapter_answer(
    body: ExportRequest, ckpt: CheckpointRecord, listed: list[dict[str, Any]]
) -> web.Response:
    """An adapter export's answer: done at once, its files' URLs."""
    return json_response(
        {
            "state": "done",
            "kind": "adapter",
            "layout": body.layout,
            "path": ckpt.path,
            "files": listed,
        }
    )


def _stored_layout(directory: Path) -> AdapterLayout | None:
    """The layout of a checkpoint's MoE experts, from its adapter config; None without experts
    (or without a readable config: then the files are served, or found missing, as they are)."""
    try:
        return _layout_of((directory / ADAPTER_CONFIG).read_bytes())
    except OSError:
        return None


def _layout_of(raw: bytes | None) -> AdapterLayout | None:
    """`_stored_layout` of an adapter config's bytes."""
    try:
        config = json.loads(raw or b"")
    except (ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("target_parameters"):
        return "peft"
    targets = config.get("target_modules")
    if isinstance(targets, list) and {"w1", "w2", "w3"} & set(map(str, targets)):
        return "tinker"
    if _TINKER_EXPERTS.search(json.dumps(targets)):
        return "tinker"
    return None


def _sweep_exports(root: Path, now: float) -> None:
    """Remove merged exports nobody fetched and deleted within `EXPORT_KEEP_S`."""
    folder = root / EXPORTS_DIR
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if now - entry.stat().st_mtime > EXPORT_KEEP_S:
            shutil.rmtree(entry, ignore_errors=True)


def _export_resource(export_id: str, file_name: str) -> str:
    return f"export/{export_id}/{file_name}"


@routes.get(f"{signed_urls.FILES_PREFIX}/exports/{{export_id}}/{{file}}")
async def download_export_file(request: web.Request) -> web.StreamResponse:
    """One file of a merged export; the signed URL is the permission (no key)."""
    export_id = rules.check_id("export_id", request.match_info["export_id"])
    name = request.match_info["file"]
    directory = merged_export_dir(checkpoint_root(request), export_id)
    files = {f.name: f for f in await asyncio.to_thread(downloadable_files, directory)}
    signed_urls.check(
        request.app[SETTINGS].download_secret,
        _export_resource(export_id, name),
        export_id if files else None,
        request.query,
        time.time(),
    )
    if name not in files:
        raise NotFound(f"file {name[:80]!r} is not part of export {export_id}")
    return web.FileResponse(files[name], headers={"Content-Type": "application/octet-stream"})


@routes.delete("/admin/v1/exports/{export_id}")
async def delete_export(request: web.Request) -> web.Response:
    """Remove a merged export once its files are fetched (from the store, or this disk)."""
    export_id = rules.check_id("export_id", request.match_info["export_id"])
    store = request.app[ARTIFACTS]
    found = False
    if store is not None and await store.files(key := merged_export_key(export_id)):
        await store.delete_tree(key)
        found = True
    root = request.app[SETTINGS].checkpoint_root if store is not None else checkpoint_root(request)
    if root is not None and (directory := merged_export_dir(root, export_id)).is_dir():
        await asyncio.to_thread(shutil.rmtree, directory, True)
        found = True
    if not found:
        raise NotFound(f"export {export_id!r} not found")
    return json_response({"deleted": export_id})


# -- import -------------------------------------------------------------------------------------


@routes.post("/admin/v1/checkpoints/import")
async def import_checkpoint(request: web.Request) -> web.Response:
    tenant = await _known_tenant(request, request.query.get("tenant", ""))
    name = rules.check_checkpoint_name("name", request.query.get("name", ""))
    limits = await request.app[QUOTAS].limits(tenant)
    stored = sum(c.size_bytes for c in await request.app[REGISTRY].tenant_checkpoints(tenant))
    check_room("max_checkpoint_bytes", stored, limits.max_checkpoint_bytes)
    room = None if limits.max_checkpoint_bytes is None else limits.max_checkpoint_bytes - stored
    max_bytes = min(MAX_UPLOAD_BYTES, room) if room is not None else MAX_UPLOAD_BYTES
    staging_id = uuid.uuid4().hex
    store = request.app[ARTIFACTS]
    staging: _Staging = (
        _LocalStaging(import_staging_dir(checkpoint_root(request), staging_id))
        if store is None
        else _StoreStaging(store, import_staging_key(staging_id))
    )
    registry = request.app[REGISTRY]
    run: RunRecord | None = None
    try:
        config = await _receive(request, staging, max_bytes)
        base_model, rank = _check_config(request, config, request.query.get("base_model"))
        check_limit("max_rank", rank, limits.max_rank)
        await staging.commit()
        now = time.time()
        run = RunRecord(
            model_id=f"import-{staging_id[:20]}",
            tenant_id=tenant,
            session_id="",
            base_model=base_model,
            lora=LoraConfig(rank=rank),  # until the worker says which layers it trains
            created_at=now,
            last_request_time=now,
            user_metadata={"imported": name},
            unloaded_at=now,  # never on a worker: it is loaded into new training clients
        )
        if not await registry.create_run(run):
            run = None
            raise ServerError("the new run's id is taken; retry")
        job = ImportAdapterJob(
            request_id=new_request_id("import_adapter"),
            model_id=run.model_id,
            tenant_id=tenant,
            seq_id=0,
            published_at=now,
            staging_id=staging_id,
            name=name,
            base_model=base_model,
            max_bytes=room or 0,
        )
        await _submit(request, base_model, job, "import_adapter")
    except BaseException:
        await staging.discard()
        if run is not None:
            await registry.delete_run(run.model_id)
        raise
    return await _answer(request, job.request_id)


class _Staging(Protocol):
    """Where an upload's two files wait for the worker: this gateway's disk or the store."""

    async def open(self) -> None: ...
    async def write(self, name: str, data: bytes) -> None: ...
    async def stream(self, name: str, chunks: AsyncIterator[bytes]) -> None: ...
    async def commit(self) -> None: ...
    async def discard(self) -> None: ...


class _LocalStaging:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    async def open(self) -> None:
        await asyncio.to_thread(self.directory.mkdir, parents=True)

    async def write(self, name: str, data: bytes) -> None:
        await asyncio.to_thread((self.directory / name).write_bytes, data)

    async def stream(self, name: str, chunks: AsyncIterator[bytes]) -> None:
        handle = await asyncio.to_thread(open, self.directory / name, "wb")
        try:
            async for chunk in chunks:
                await asyncio.to_thread(handle.write, chunk)
        finally:
            await asyncio.to_thread(handle.close)

    async def commit(self) -> None:
        return None

    async def discard(self) -> None:
        await asyncio.to_thread(shutil.rmtree, self.directory, True)


class _StoreStaging:
    """In the artifact store under `key`, each file's size and sha256 kept for the manifest
    that `commit` writes last (the worker checks the files against it)."""

    def __init__(self, store: StoreFiles, key: str) -> None:
        self.store = store
        self.key = key
        self.files: dict[str, tuple[int, str]] = {}

    async def open(self) -> None:
        return None

    async def write(self, name: str, data: bytes) -> None:
        await self.store.put(self.key, name, data)
        self.files[name] = (len(data), hashlib.sha256(data).hexdigest())

    async def stream(self, name: str, chunks: AsyncIterator[bytes]) -> None:
        digest, size = hashlib.sha256(), 0
        failed: list[Exception] = []

        async def counted() -> AsyncIterator[bytes]:
            # what the source raises (over the limit) is raised below, not as the store
            # client's own error for an upload whose body failed
            nonlocal size
            try:
                async for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
                    yield chunk
            except Exception as error:
                failed.append(error)

        await self.store.put(self.key, name, counted())
        if failed:
            raise failed[0]
        self.files[name] = (size, digest.hexdigest())

    async def commit(self) -> None:
        await self.store.put_manifest(self.key, self.files)

    async def discard(self) -> None:
        await self.store.delete_tree(self.key)


async def _receive(request: web.Request, staging: _Staging, max_bytes: int) -> dict[str, Any]:
    """Stream the two parts of the upload into `staging`; the adapter config, decoded."""
    if not request.content_type.startswith("multipart/"):
        raise UserError(
            f"upload: expected multipart/form-data with {' and '.join(ADAPTER_FILES)},"
            f" got {request.content_type or 'no content type'}"
        )
    await staging.open()
    reader = await request.multipart()
    config_bytes: bytes | None = None
    weights = False
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader) or part.name not in ADAPTER_FILES:
            shown = getattr(part, "name", None)
            raise UserError(f"upload: unexpected part {str(shown)[:60]!r} (only {ADAPTER_FILES})")
        if part.name == ADAPTER_CONFIG and config_bytes is None:
            config_bytes = await _read_part(part, MAX_CONFIG_BYTES)
            await staging.write(ADAPTER_CONFIG, config_bytes)
        elif part.name == ADAPTER_WEIGHTS and not weights:
            await staging.stream(ADAPTER_WEIGHTS, _limited(part, max_bytes))
            weights = True
        else:
            raise UserError(f"upload: {part.name} given twice")
    if config_bytes is None:
        raise UserError(f"{ADAPTER_CONFIG}: missing from the upload; a PEFT adapter folder has one")
    if not weights:
        raise UserError(f"{ADAPTER_WEIGHTS}: missing from the upload (safetensors only)")
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise UserError(f"{ADAPTER_CONFIG}: not valid JSON ({exc})") from None
    except RecursionError:
        raise UserError(f"{ADAPTER_CONFIG}: {api.NESTED_TOO_DEEPLY}") from None
    if not isinstance(config, dict):
        raise UserError(f"{ADAPTER_CONFIG}: expected a JSON object")
    return config


async def _read_part(part: BodyPartReader, limit: int) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(_CHUNK_BYTES):
        data += chunk
        if len(data) > limit:
            raise PayloadTooLarge(f"{part.name}: over {limit} bytes")
    return bytes(data)


async def _limited(part: BodyPartReader, limit: int) -> AsyncIterator[bytes]:
    """The part's chunks, refused once they pass `limit` bytes (nothing past it is read)."""
    written = 0
    while chunk := await part.read_chunk(_CHUNK_BYTES):
        written += len(chunk)
        if written > limit:
            raise PayloadTooLarge(
                f"{part.name}: over {limit} bytes (the upload limit, or the tenant's room"
                " under max_checkpoint_bytes)"
            )
        yield chunk


def _check_config(
    request: web.Request, config: dict[str, Any], base_model: str | None
) -> tuple[str, int]:
    """The base model the adapter is imported for, and its rank; what JSON alone can refuse."""
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}, expected LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UserError(f"{ADAPTER_CONFIG}: r {rank!r} is not a positive integer")
    declared = config.get("base_model_name_or_path") or ""
    if not isinstance(declared, str):
        raise UserError(f"{ADAPTER_CONFIG}: base_model_name_or_path is not a string")
    if base_model and declared and declared != base_model:
        raise UserError(
            f"{ADAPTER_CONFIG}: the adapter was trained on {declared[:200]!r}, not on"
            f" {base_model!r} (base_model_name_or_path)"
        )
    chosen = base_model or declared
    if not chosen:
        raise UserError("base_model: the adapter's config names no base model; give one")
    worker = request.app[REGISTRY].check_base_model(chosen)
    if worker is not None and rank > worker.max_rank:
        raise UserError(
            f"{ADAPTER_CONFIG}: rank {rank} is above the largest rank {worker.max_rank} the"
            f" workers of {chosen!r} accept"
        )
    return chosen, rank


# -- jobs and their answers ---------------------------------------------------------------------


async def _submit(request: web.Request, base_model: str, job: Job, request_type: str) -> None:
    futures = request.app[FUTURES]
    await futures.record_pending(job.request_id, request_type, job.model_id, job.tenant_id)
    await request.app[BUS].publish_job(subjects.pool_of(base_model), job)


@routes.get("/admin/v1/transfers/{request_id}")
async def transfer_state(request: web.Request) -> web.Response:
    request_id = rules.check_request_id("request_id", request.match_info["request_id"])
    return await _answer(request, request_id)


async def _answer(request: web.Request, request_id: str) -> web.Response:
    """The job's answer once it is done (waiting up to `WAIT_S`), else `pending`."""
    futures = request.app[FUTURES]
    outcome = await futures.read(request_id)  # another request's id never waits
    if outcome is None or outcome.request_type not in ("import_adapter", "export_merged"):
        raise NotFound(f"transfer {request_id!r} not found")
    outcome = await futures.wait(request_id, WAIT_S) or outcome
    if outcome.state == "pending":
        return json_response({"state": "pending", "request_id": request_id})
    if outcome.request_type == "import_adapter":
        return json_response(await _import_answer(request, outcome))
    if outcome.state == "error":
        _raise(outcome)
    done = json.loads(outcome.payload)
    export_id = str(done["export_id"])
    kind = "merged" if done.get("layout") is None else "adapter"
    store_key = done.pop("store_key", None)
    if store_key is not None:  # written to the artifact store: presigned URLs of it
        store = artifact_store(request, f"export {export_id}")
        if store_key != merged_export_key(export_id):
            raise ServerError(f"export {export_id}: unexpected store key {store_key!r}")
        for entry in done["files"]:
            entry["url"] = await store.sign(store_key, str(entry["name"]), URL_TTL_S)
        return json_response({"state": "done", "kind": kind, **done})
    secret = request.app[SETTINGS].download_secret
    expires = int(time.time()) + URL_TTL_S
    prefix = f"{base_url(request)}{signed_urls.FILES_PREFIX}/exports/{export_id}"
    for entry in done["files"]:
        sig = signed_urls.signature(
            secret, _export_resource(export_id, entry["name"]), export_id, expires
        )
        entry["url"] = f"{prefix}/{entry['name']}?expires={expires}&sig={sig}"
    return json_response({"state": "done", "kind": kind, **done})


async def _import_answer(request: web.Request, outcome: Outcome) -> dict[str, Any]:
    """A finished import: its run gets the checkpoint's LoRA spec, or goes if it failed."""
    registry = request.app[REGISTRY]
    run = await registry.find_run(outcome.model_id)
    if outcome.state == "error":
        if run is not None and not await registry.checkpoints(run.model_id):
            await registry.delete_run(run.model_id)
        _raise(outcome)
    done = json.loads(outcome.payload)
    path = paths.parse_path(done["path"])
    ckpt = await registry.find_checkpoint(path.run_id, path.checkpoint_id)
    if run is not None and ckpt is not None and run.lora != ckpt.lora:
        await registry.put_run(msgspec.structs.replace(run, lora=ckpt.lora))
    return {"state": "done", "kind": "import", "tenant": outcome.tenant_id, **done}


def _raise(outcome: Outcome) -> None:
    if outcome.category is not None and outcome.category.value == "user":
        raise UserError(outcome.error)
    raise ServerError(outcome.error)
