"""The Twinkle Client protocol's gateway and model routes (`protocol.twinkle_api` says how its
calls map onto ours).

Gateway routes (`/api/v1/twinkle/...`): sessions, capabilities, training runs and checkpoints in
twinkle's shapes (a checkpoint's `twinkle_path`). Model routes
(`/api/v1/model/{base model}/twinkle/{call}`): every call names its adapter, scoped to the
caller's session (the `X-Twinkle-Session-Id` header). An adapter is a training run; its calls
are submitted as the Tinker routes submit theirs, with the seq the gateway reserves, and
answered when done (twinkle's client waits on each call). The adapter's loop state lives in the
sessions bucket, so any gateway serves the next call.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
from aiohttp import web

from protocol import api, paths, rules, subjects, twinkle_schedule
from protocol.errors import NotFound, UserError
from protocol.jobs import CreateModelJob, Job, LoadWeightsJob, OptimStepJob, Outcome
from protocol.json_tensors import answer_json, forward_backward_from_json
from protocol.records import RunRecord, SessionRecord
from protocol.tensors import scan_forward_backward
from protocol.twinkle_api import (
    AddAdapterBody,
    ClipBody,
    ForwardBackwardBody,
    LoadBody,
    SaveBody,
    SetLossBody,
    TwinkleAdapterRecord,
    check_adapter_name,
    check_loss,
    lora_config,
    step_params,
    tinker_forward_backward,
    twinkle_batch,
)
from twinkle_async.gateway import rest_routes
from twinkle_async.gateway.bodies import json_response, read_body, read_json
from twinkle_async.gateway.checkpoint_files import remove_checkpoint
from twinkle_async.gateway.futures_routes import finished
from twinkle_async.gateway.sequenced import live_run, submit
from twinkle_async.gateway.service_routes import new_session
from twinkle_async.gateway.state import ARTIFACTS, BUS, FUTURES, REGISTRY, SETTINGS, TENANT
from twinkle_async.gateway.training_routes import (
    check_storage,
    forward_backward_build,
    loadable,
    new_run,
    save_job,
    trainable_lora,
)

routes = web.RouteTableDef()

SESSION_HEADER = "X-Twinkle-Session-Id"
MODEL = "/api/v1/model/{base_model:.+}/twinkle"
MAX_ADAPTERS = 64  # a session's adapters
_OK = {"status": "ok"}
_ENCODER = msgspec.json.Encoder()
_locks: dict[str, asyncio.Lock] = {}


# -- gateway routes -----------------------------------------------------------------------------


class _SessionBody(msgspec.Struct, frozen=True):
    metadata: dict[str, Any] | None = None
    session_id: str = ""


@routes.post("/api/v1/twinkle/create_session")
async def create_session(request: web.Request) -> web.Response:
    body = await read_json(request, _SessionBody)
    metadata = {str(k)[:64]: str(v)[:256] for k, v in (body.metadata or {}).items()}
    session = await new_session(request, [], metadata or None, "twinkle")
    return json_response({"session_id": session.session_id})


@routes.post("/api/v1/twinkle/session_heartbeat")
async def session_heartbeat(request: web.Request) -> web.Response:
    body = await read_json(request, _SessionBody)
    await request.app[REGISTRY].touch_session(
        rules.check_id("session_id", body.session_id), request[TENANT]
    )
    return json_response({})


@routes.get("/api/v1/twinkle/healthz")
async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


@routes.get("/api/v1/twinkle/capacity_info")
async def capacity_info(request: web.Request) -> web.Response:
    workers = [w for w in request.app[REGISTRY].served_models().values() if w is not None]
    total = sum(w.slots_total for w in workers)
    used = sum(w.slots_used for w in workers)
    return json_response({"max_loras": total, "used_loras": used, "free_loras": total - used})


@routes.get("/api/v1/twinkle/get_server_capabilities")
async def get_server_capabilities(request: web.Request) -> web.Response:
    names = sorted(request.app[REGISTRY].served_models())
    return json_response({"supported_models": [{"model_name": name} for name in names]})


def _twinkle_checkpoint(view: Any) -> dict[str, Any]:
    """A checkpoint as twinkle's `Checkpoint` reads it (a size always, its `twinkle_path`)."""
    fields: dict[str, Any] = msgspec.json.decode(_ENCODER.encode(view))
    fields.setdefault("size_bytes", 0)
    fields["is_lora"] = True
    return fields


def _twinkle_run(view: Any) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.json.decode(_ENCODER.encode(view))
    for key in ("last_checkpoint", "last_sampler_checkpoint"):
        if fields.get(key):
            fields[key] = _twinkle_checkpoint(fields[key])
    return fields


@routes.get("/api/v1/twinkle/training_runs")
async def list_training_runs(request: web.Request) -> web.Response:
    limit = rest_routes.int_param(request, "limit", 20)
    offset = rest_routes.int_param(request, "offset", 0)
    registry = request.app[REGISTRY]
    runs = await registry.runs(request[TENANT])
    views = [
        _twinkle_run(rest_routes.run_view(run, await registry.checkpoints(run.model_id)))
        for run in runs[offset : offset + limit]
    ]
    cursor = {"limit": limit, "offset": offset, "total_count": len(runs)}
    return json_response({"training_runs": views, "cursor": cursor})


@routes.get("/api/v1/twinkle/training_runs/{run_id}")
async def get_training_run(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    run = await registry.run(request.match_info["run_id"], request[TENANT])
    return json_response(
        _twinkle_run(rest_routes.run_view(run, await registry.checkpoints(run.model_id)))
    )


@routes.get("/api/v1/twinkle/training_runs/{run_id}/checkpoints")
async def list_checkpoints(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    run = await registry.run(request.match_info["run_id"], request[TENANT])
    views = [
        _twinkle_checkpoint(rest_routes.checkpoint_view(c))
        for c in await registry.checkpoints(run.model_id)
    ]
    return json_response({"checkpoints": views})


def _path(run_id: str, checkpoint_id: str) -> paths.TinkerPath:
    return paths.parse_path(f"{paths.SCHEME}{run_id}/{checkpoint_id}", "checkpoint")


@routes.get("/api/v1/twinkle/checkpoint_path/{run_id}/{checkpoint_id:.+}")
async def checkpoint_path(request: web.Request) -> web.Response:
    path = _path(request.match_info["run_id"], request.match_info["checkpoint_id"])
    await request.app[REGISTRY].checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    return json_response({"path": str(path), "twinkle_path": path.twinkle_path})


@routes.delete("/api/v1/twinkle/training_runs/{run_id}/checkpoints/{checkpoint_id:.+}")
async def delete_checkpoint(request: web.Request) -> web.Response:
    path = _path(request.match_info["run_id"], request.match_info["checkpoint_id"])
    registry = request.app[REGISTRY]
    ckpt = await registry.owned_checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    await remove_checkpoint(
        registry, request.app[SETTINGS].checkpoint_root, request.app[ARTIFACTS], ckpt
    )
    return json_response({"success": True, "message": f"deleted {path.twinkle_path}"})


class _WeightsInfoBody(msgspec.Struct, frozen=True):
    twinkle_path: str = ""


@routes.post("/api/v1/twinkle/weights_info")
async def weights_info(request: web.Request) -> web.Response:
    body = await read_json(request, _WeightsInfoBody)
    path = paths.parse_path(body.twinkle_path, "twinkle_path")
    ckpt = await request.app[REGISTRY].checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    run = await request.app[REGISTRY].find_run(path.run_id)
    return json_response(
        {
            "training_run_id": path.run_id,
            "base_model": ckpt.base_model,
            "model_owner": run.tenant_id if run else "",
            "is_lora": True,
            "lora_rank": ckpt.lora.rank,
        }
    )


# -- model routes: the adapter's state ----------------------------------------------------------


async def twinkle_session(request: web.Request) -> SessionRecord:
    """The caller's session that `X-Twinkle-Session-Id` names (400 without it, 404 if not its)."""
    session_id = request.headers.get(SESSION_HEADER)
    if not session_id:
        raise UserError(f"{SESSION_HEADER}: missing (init_twinkle_client creates the session)")
    return await request.app[REGISTRY].session(
        rules.check_id(SESSION_HEADER, session_id), request[TENANT]
    )


def _key(session_id: str, adapter_name: str) -> str:
    return f"twinkle.{subjects.token(session_id)}.{subjects.token(adapter_name)}"


async def json_body(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    raw = await read_body(request)
    try:
        fields = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise UserError("body is not valid JSON") from None
    if not isinstance(fields, dict):
        raise UserError("body is not a JSON object")
    return raw, fields


async def _adapter(
    request: web.Request, adapter_name: str | None
) -> tuple[TwinkleAdapterRecord, int]:
    """The caller's adapter of its session, and the revision its update must swap from."""
    session = await twinkle_session(request)
    name = check_adapter_name(adapter_name)
    entry = await request.app[BUS].entry(subjects.BUCKET_SESSIONS, _key(session.session_id, name))
    if entry is None:
        raise NotFound(f"adapter_name {name!r}: no such adapter (add_adapter_to_model first)")
    return msgspec.json.decode(entry[0], type=TwinkleAdapterRecord), entry[1]


async def _save(request: web.Request, record: TwinkleAdapterRecord, revision: int) -> None:
    key = _key(record.session_id, record.adapter_name)
    if not await request.app[BUS].swap(
        subjects.BUCKET_SESSIONS, key, _ENCODER.encode(record), revision
    ):
        raise UserError(
            f"adapter_name {record.adapter_name!r}: changed by a concurrent call; retry",
            code="conflict",
            status=409,
        )


def _locked(session_id: str, adapter_name: str) -> asyncio.Lock:
    """One call of an adapter at a time in this gateway (its client runs them in order)."""
    key = _key(session_id, adapter_name)
    if len(_locks) > 10_000:
        for name in [k for k, lock in _locks.items() if not lock.locked()]:
            del _locks[name]
    return _locks.setdefault(key, asyncio.Lock())


async def _run(request: web.Request, record: TwinkleAdapterRecord) -> RunRecord:
    return await live_run(request, record.model_id)


async def _call(
    request: web.Request,
    run: RunRecord,
    request_type: str,
    make: Any,
) -> Outcome:
    """Submit one call on the adapter's run with the next seq, and wait for it: `make(seq_id)`
    gives the call's body (what a retry is recognised by) and the `BuildJob` of its job."""
    seq_id = await request.app[FUTURES].next_seq(run.model_id)
    try:
        body, build = make(seq_id)
    except UserError as refusal:  # the reserved seq is settled: the next call runs at once
        refused = refusal

        async def refuse(request_id: str, first: bool) -> Job:
            raise refused

        body, build = str(refusal).encode(), refuse
    request_id = await submit(request, run, seq_id, request_type, body, build)
    return await finished(request, request_id)


def _job_fields(run: RunRecord, request_id: str, seq_id: int) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "model_id": run.model_id,
        "tenant_id": run.tenant_id,
        "seq_id": seq_id,
        "published_at": time.time(),
    }


# -- model routes -------------------------------------------------------------------------------


def served_base_model(request: web.Request) -> str:
    """The URL's model as one this cluster serves (twinkle's client drops `ms://`; a local
    path loses its leading slash in some clients' URLs)."""
    name = request.match_info["base_model"]
    served = request.app[REGISTRY].served_models()
    for candidate in (name, "/" + name.lstrip("/")):
        if candidate in served:
            return candidate
    request.app[REGISTRY].check_base_model(name)  # the registry's own refusal, naming the models
    return name


@routes.post(MODEL + "/create")
async def create(request: web.Request) -> web.Response:
    await twinkle_session(request)
    served_base_model(request)
    return json_response(_OK)


@routes.post(MODEL + "/add_adapter_to_model")
async def add_adapter_to_model(request: web.Request) -> web.Response:
    raw = await read_body(request)
    body = api.decode(raw, AddAdapterBody)
    session = await twinkle_session(request)
    name = check_adapter_name(body.adapter_name)
    base_model = served_base_model(request)
    lora = trainable_lora(request, base_model, lora_config(body.config))
    steps = twinkle_schedule.check_accumulation_steps(body.gradient_accumulation_steps)
    bus = request.app[BUS]
    key = _key(session.session_id, name)
    async with _locked(session.session_id, name):
        if await bus.get(subjects.BUCKET_SESSIONS, key) is not None:
            raise UserError(f"adapter_name {name!r}: already added to this session")
        slot = await _slot(request, session.session_id, name)
        model_id = f"{session.session_id}:train:{1_000_000 + slot}"
        now = time.time()
        run = await new_run(request, model_id, session, base_model, lora, None, now)

        async def build(request_id: str, first: bool) -> Job:
            return CreateModelJob(
                **_job_fields(run, request_id, 0), base_model=base_model, lora=lora
            )

        request_id = await submit(request, run, 0, "create_model", raw, build)
        await finished(request, request_id)
        record = TwinkleAdapterRecord(
            session_id=session.session_id,
            tenant_id=session.tenant_id,
            adapter_name=name,
            model_id=model_id,
            base_model=base_model,
            accumulation_steps=steps,
            created_at=now,
        )
        await bus.put(subjects.BUCKET_SESSIONS, key, _ENCODER.encode(record))
    return json_response(_OK)


async def _slot(request: web.Request, session_id: str, name: str) -> int:
    """The adapter's number in its session (its run id's), kept for the session's life."""
    bus = request.app[BUS]
    for slot in range(MAX_ADAPTERS):
        key = f"twinkle.{subjects.token(session_id)}.slot{slot}"
        if await bus.create(subjects.BUCKET_SESSIONS, key, name.encode()):
            return slot
        if await bus.get(subjects.BUCKET_SESSIONS, key) == name.encode():
            return slot
    raise UserError(f"a session holds at most {MAX_ADAPTERS} adapters")


async def _settings(request: web.Request, change: Any) -> web.Response:
    """A call that only changes what the adapter's loop holds (`change(record, fields)`)."""
    _, fields = await json_body(request)
    record, revision = await _adapter(request, fields.get("adapter_name"))
    async with _locked(record.session_id, record.adapter_name):
        record, revision = await _adapter(request, record.adapter_name)
        await _save(request, change(record, fields), revision)
    return json_response(_OK)


def _kwargs(fields: dict[str, Any], *named: str) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k not in ("adapter_name", *named)}


@routes.post(MODEL + "/set_optimizer")
async def set_optimizer(request: web.Request) -> web.Response:
    def change(record: TwinkleAdapterRecord, fields: dict[str, Any]) -> TwinkleAdapterRecord:
        settings = twinkle_schedule.check_optimizer(
            fields.get("optimizer_cls"), _kwargs(fields, "optimizer_cls")
        )
        return msgspec.structs.replace(record, optimizer=settings)

    return await _settings(request, change)


@routes.post(MODEL + "/set_lr_scheduler")
async def set_lr_scheduler(request: web.Request) -> web.Response:
    def change(record: TwinkleAdapterRecord, fields: dict[str, Any]) -> TwinkleAdapterRecord:
        if record.optimizer is None:
            raise UserError("set_lr_scheduler: set an optimizer first (set_optimizer)")
        scheduler = twinkle_schedule.check_scheduler(
            fields.get("scheduler_cls"), _kwargs(fields, "scheduler_cls")
        )
        return msgspec.structs.replace(record, scheduler=scheduler, lr_steps=0)

    return await _settings(request, change)


@routes.post(MODEL + "/set_loss")
async def set_loss(request: web.Request) -> web.Response:
    def change(record: TwinkleAdapterRecord, fields: dict[str, Any]) -> TwinkleAdapterRecord:
        body = api.decode(json.dumps(fields).encode(), SetLossBody)
        return msgspec.structs.replace(record, reduction=check_loss(body))

    return await _settings(request, change)


def _class_name(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.isidentifier() or len(value) > 64:
        raise UserError(f"{field}: a class name")
    return value


@routes.post(MODEL + "/set_template")
async def set_template(request: web.Request) -> web.Response:
    def change(record: TwinkleAdapterRecord, fields: dict[str, Any]) -> TwinkleAdapterRecord:
        name = _class_name(fields.get("template_cls"), "template_cls")
        return msgspec.structs.replace(record, template_cls=name)

    return await _settings(request, change)


@routes.post(MODEL + "/set_processor")
async def set_processor(request: web.Request) -> web.Response:
    def change(record: TwinkleAdapterRecord, fields: dict[str, Any]) -> TwinkleAdapterRecord:
        name = _class_name(fields.get("processor_cls"), "processor_cls")
        return msgspec.structs.replace(record, processor_cls=name)

    return await _settings(request, change)


def _lr(record: TwinkleAdapterRecord) -> float:
    if record.optimizer is None:
        return 0.0
    return twinkle_schedule.learning_rate(record.scheduler, record.optimizer.lr, record.lr_steps)


@routes.post(MODEL + "/get_train_configs")
async def get_train_configs(request: web.Request) -> web.Response:
    _, fields = await json_body(request)
    record, _ = await _adapter(request, fields.get("adapter_name"))
    described = {
        "adapter_name": record.adapter_name,
        "training_run_id": record.model_id,
        "base_model": record.base_model,
        "gradient_accumulation_steps": record.accumulation_steps,
        "cur_step": record.cur_step,
        "loss": f"CrossEntropyLoss(reduction={record.reduction!r})",
        "optimizer": msgspec.to_builtins(record.optimizer),
        "lr_scheduler": msgspec.to_builtins(record.scheduler),
        "learning_rate": _lr(record),
    }
    return json_response({"result": json.dumps(described)})


@routes.post(MODEL + "/forward_backward")
async def forward_backward(request: web.Request) -> web.Response:
    raw = await read_body(request)
    body = api.decode(raw, ForwardBackwardBody)
    record, _ = await _adapter(request, body.adapter_name)
    batch, count = twinkle_batch(body.inputs, record.reduction)  # refused before a seq is spent
    async with _locked(record.session_id, record.adapter_name):
        record, revision = await _adapter(request, record.adapter_name)
        run = await _run(request, record)

        def make(seq_id: int) -> tuple[bytes, Any]:
            tinker = forward_backward_from_json(
                tinker_forward_backward(batch, run.model_id, seq_id), forward_only=False
            )
            return tinker, forward_backward_build(
                request, run, tinker, scan_forward_backward(tinker)
            )

        outcome = await _call(request, run, "forward_backward", make)
        answer = json.loads(answer_json("forward_backward", outcome.payload))
        loss = float(answer.get("metrics", {}).get("loss:sum", 0.0))
        await _save(
            request,
            msgspec.structs.replace(
                record,
                cur_step=record.cur_step + 1,
                count=record.count + count,
                clipped=False,
                last_loss=loss,
            ),
            revision,
        )
    return json_response({"result": {"loss": loss, "num_tokens": batch.labelled}})


async def _step(
    request: web.Request, record: TwinkleAdapterRecord, max_grad_norm: float
) -> TwinkleAdapterRecord:
    """The optimizer step of a sync (see `protocol.twinkle_api`), and the record after it."""
    params = step_params(record, _lr(record), max_grad_norm)
    coupled = record.optimizer is not None and record.optimizer.coupled
    run = await _run(request, record)
    outcome = await _optim_step(
        request, run, _ENCODER.encode(params), adam=params, coupled_weight_decay=coupled
    )
    metrics = api.decode(outcome.payload, api.OptimStepResponse).metrics or {}
    norm = float(metrics.get("unclipped_grad_l2:mean", 0.0))
    count = record.count if max_grad_norm > 0 and record.count > 0 else 1.0
    return msgspec.structs.replace(record, clipped=True, count=0.0, grad_norm=norm / count)


async def _optim_step(request: web.Request, run: RunRecord, body: bytes, **fields: Any) -> Outcome:
    """An `optim_step` job of the adapter's run with its own `fields`; `body` is what a retry
    of it is recognised by."""

    def make(seq_id: int) -> tuple[bytes, Any]:
        async def build(request_id: str, first: bool) -> Job:
            return OptimStepJob(**_job_fields(run, request_id, seq_id), **fields)

        return body, build

    return await _call(request, run, "optim_step", make)


def _synced(record: TwinkleAdapterRecord) -> bool:
    return twinkle_schedule.grad_sync(record.cur_step, record.accumulation_steps)


async def _clip(request: web.Request, clip: ClipBody) -> tuple[TwinkleAdapterRecord, int] | None:
    """clip_grad_norm's work: the step of this sync, clipped; None when the sync is not now."""
    if clip.norm_type != 2:
        raise UserError(f"norm_type: {clip.norm_type}; this server clips the L2 norm (2)")
    record, revision = await _adapter(request, clip.adapter_name)
    if not _synced(record):
        return None
    if not record.clipped:
        record = await _step(request, record, clip.max_grad_norm)
        await _save(request, record, revision)
        record, revision = await _adapter(request, record.adapter_name)
    return record, revision


@routes.post(MODEL + "/clip_grad_norm")
async def clip_grad_norm(request: web.Request) -> web.Response:
    body = await read_json(request, ClipBody)
    record, _ = await _adapter(request, body.adapter_name)
    async with _locked(record.session_id, record.adapter_name):
        clipped = await _clip(request, body)
    return json_response({"result": str(clipped[0].grad_norm if clipped else None)})


async def _plain_step(request: web.Request, adapter_name: str | None) -> None:
    record, revision = await _adapter(request, adapter_name)
    if _synced(record) and not record.clipped:
        await _save(request, await _step(request, record, 0.0), revision)


async def _zero_grad(request: web.Request, adapter_name: str | None) -> None:
    """At a sync whose step has not run, the accumulated gradients are dropped (a later `step`
    of the same sync has none to apply, as torch's after `zero_grad`)."""
    record, revision = await _adapter(request, adapter_name)
    if not _synced(record) or record.clipped or record.count <= 0:
        return
    run = await _run(request, record)
    await _optim_step(request, run, b'{"discard":true}', discard=True)
    await _save(request, msgspec.structs.replace(record, clipped=True, count=0.0), revision)


async def _lr_step(request: web.Request, adapter_name: str | None) -> None:
    record, revision = await _adapter(request, adapter_name)
    if _synced(record):
        await _save(
            request, msgspec.structs.replace(record, lr_steps=record.lr_steps + 1), revision
        )


@routes.post(MODEL + "/step")
async def step(request: web.Request) -> web.Response:
    _, fields = await json_body(request)
    record, _ = await _adapter(request, fields.get("adapter_name"))
    async with _locked(record.session_id, record.adapter_name):
        await _plain_step(request, record.adapter_name)
    return json_response(_OK)


@routes.post(MODEL + "/zero_grad")
async def zero_grad(request: web.Request) -> web.Response:
    _, fields = await json_body(request)
    record, _ = await _adapter(request, fields.get("adapter_name"))
    async with _locked(record.session_id, record.adapter_name):
        await _zero_grad(request, record.adapter_name)
    return json_response(_OK)


@routes.post(MODEL + "/lr_step")
async def lr_step(request: web.Request) -> web.Response:
    _, fields = await json_body(request)
    record, _ = await _adapter(request, fields.get("adapter_name"))
    async with _locked(record.session_id, record.adapter_name):
        await _lr_step(request, record.adapter_name)
    return json_response(_OK)


@routes.post(MODEL + "/clip_grad_and_step")
async def clip_grad_and_step(request: web.Request) -> web.Response:
    body = await read_json(request, ClipBody)
    record, _ = await _adapter(request, body.adapter_name)
    async with _locked(record.session_id, record.adapter_name):
        await _clip(request, body)
        await _plain_step(request, record.adapter_name)
        await _lr_step(request, record.adapter_name)
    return json_response(_OK)


@routes.post(MODEL + "/calculate_metric")
async def calculate_metric(request: web.Request) -> web.Response:
    _, fields = await json_body(request)
    record, _ = await _adapter(request, fields.get("adapter_name"))
    return json_response(
        {
            "result": {
                "loss": f"{record.last_loss:.4f}",
                "grad_norm": f"{record.grad_norm:.6f}",
                "lr": f"{_lr(record):.6e}",
                "step": record.cur_step,
            }
        }
    )


@routes.post(MODEL + "/save")
async def save(request: web.Request) -> web.Response:
    raw = await read_body(request)
    body = api.decode(raw, SaveBody)
    record, _ = await _adapter(request, body.adapter_name)
    name = rules.check_checkpoint_name("name", body.name or f"checkpoint-step-{record.cur_step}")
    path = paths.TinkerPath(run_id=record.model_id, kind="weights", name=name)
    async with _locked(record.session_id, record.adapter_name):
        run = await _run(request, record)
        await check_storage(request, run.tenant_id)
        metadata = {
            "twinkle.cur_step": str(record.cur_step),
            "twinkle.gradient_accumulation_steps": str(record.accumulation_steps),
        }

        def make(seq_id: int) -> tuple[bytes, Any]:
            saved = api.SaveWeightsRequest(
                model_id=run.model_id,
                path=name,
                seq_id=seq_id,
                overwrite=True,
                user_metadata=metadata,
            )

            async def build(request_id: str, first: bool) -> Job:
                return save_job(request_id, run, saved, name, "weights")

            return _ENCODER.encode(saved), build

        await _call(request, run, "save_weights", make)
    return json_response({"twinkle_path": path.twinkle_path, "checkpoint_dir": path.twinkle_path})


@routes.post(MODEL + "/load")
async def load(request: web.Request) -> web.Response:
    raw = await read_body(request)
    body = api.decode(raw, LoadBody)
    record, _ = await _adapter(request, body.adapter_name)
    if "://" in body.name:
        path = paths.parse_path(body.name, "name")
    else:
        path = paths.TinkerPath(
            run_id=record.model_id,
            kind="weights",
            name=rules.check_checkpoint_name("name", body.name),
        )
    async with _locked(record.session_id, record.adapter_name):
        record, revision = await _adapter(request, record.adapter_name)
        run = await _run(request, record)
        loading = api.LoadWeightsRequest(
            path=str(path), optimizer=body.load_optimizer, model_id=run.model_id
        )
        ckpt = await loadable(request, loading)
        if ckpt.base_model != run.base_model:
            raise UserError(f"name: {path.twinkle_path!r} is a checkpoint of {ckpt.base_model!r}")
        if ckpt.lora.rank != run.lora.rank:
            raise UserError(
                f"name: {path.twinkle_path!r} has rank {ckpt.lora.rank}, the adapter {run.lora.rank}"
            )

        def make(seq_id: int) -> tuple[bytes, Any]:
            async def build(request_id: str, first: bool) -> Job:
                return LoadWeightsJob(
                    **_job_fields(run, request_id, seq_id),
                    path=str(path),
                    with_optimizer=body.load_optimizer,
                    base_model=ckpt.base_model,
                    content_id=ckpt.content_id,
                )

            return _ENCODER.encode(msgspec.structs.replace(loading, seq_id=seq_id)), build

        await _call(request, run, "load_weights", make)
        restored = msgspec.structs.replace(record, count=0.0, clipped=False)
        steps = (ckpt.user_metadata or {}).get("twinkle.cur_step", "")
        if body.load_optimizer and steps.isdigit():
            restored = msgspec.structs.replace(restored, cur_step=int(steps))
        await _save(request, restored, revision)
    return json_response(_OK)
