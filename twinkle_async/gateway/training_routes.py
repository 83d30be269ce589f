"""Training endpoints: create_model, get_info, forward_backward, optim_step, save, load.

Step 1 of the request flow (DESIGN.md §3): decode, check ownership and input, map
`(model_id, seq_id)` to one request id, record the future as pending, publish the job to the
model's shard with `Nats-Msg-Id`, and answer `{"request_id"}` at once. A retried submit finds the
same request id and publishes again; JetStream drops the duplicate.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from protocol import api, paths, subjects
from protocol.errors import UserError
from protocol.jobs import (
    CreateModelJob,
    ForwardBackwardJob,
    Job,
    LoadWeightsJob,
    OptimStepJob,
    SaveWeightsJob,
    request_type_of,
)
from protocol.records import RunRecord, SamplerRecord
from protocol.rules import check_adam, check_lora_config
from protocol.tensors import decode_forward_backward
from twinkle_async.futures import new_request_id
from twinkle_async.gateway.bodies import json_response, read_body, read_json
from twinkle_async.gateway.state import BUS, FUTURES, REGISTRY, TENANT

routes = web.RouteTableDef()


async def submit(request: web.Request, job: Job, base_model: str) -> web.Response:
    """Dedupe, record pending, publish; answer the request id (the first one for a retry)."""
    futures = request.app[FUTURES]
    request_id = await futures.claim(job.model_id, job.seq_id, job.request_id)
    if request_id != job.request_id:
        job = msgspec.structs.replace(job, request_id=request_id)
    await futures.record_pending(request_id, request_type_of(job), job.model_id)
    await request.app[BUS].publish_job(subjects.pool_of(base_model), job)
    return json_response(api.UntypedAPIFuture(request_id=request_id, model_id=job.model_id))


def _seq(seq_id: int | None, what: str) -> int:
    if seq_id is None or seq_id < 1:
        raise UserError(f"{what}: seq_id must be a positive integer, got {seq_id!r}")
    return seq_id


def _check_optimizer(config: api.OptimizerConfig | None) -> None:
    if isinstance(config, api.DimuonOptimizerConfig):
        raise UserError("optimizer_config type 'dimuon' is not supported yet; use adamw")


@routes.post("/api/v1/create_model")
async def create_model(request: web.Request) -> web.Response:
    body = await read_json(request, api.CreateModelRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    session = await registry.session(body.session_id, tenant)
    worker = registry.check_base_model(body.base_model)
    lora = check_lora_config(
        body.lora_config or api.LoraConfig(), worker.max_rank if worker else None
    )
    _check_optimizer(body.optimizer_config)
    model_id = f"{session.session_id}:train:{body.model_seq_id}"
    now = time.time()
    if await registry.find_run(model_id) is None:
        await registry.put_run(
            RunRecord(
                model_id=model_id,
                tenant_id=tenant,
                session_id=session.session_id,
                base_model=body.base_model,
                lora=lora,
                created_at=now,
                last_request_time=now,
                user_metadata=dict(body.user_metadata or {}),
            )
        )
    job = CreateModelJob(
        request_id=new_request_id("create_model"),
        model_id=model_id,
        tenant_id=tenant,
        seq_id=0,
        published_at=now,
        base_model=body.base_model,
        lora=lora,
    )
    return await submit(request, job, body.base_model)


@routes.post("/api/v1/get_info")
async def get_info(request: web.Request) -> web.Response:
    body = await read_json(request, api.GetInfoRequest)
    registry = request.app[REGISTRY]
    run = await registry.run(body.model_id, request[TENANT])
    worker = registry.served_models().get(run.base_model)
    return json_response(
        api.GetInfoResponse(
            model_id=run.model_id,
            model_data=api.ModelData(
                arch=worker.arch if worker else None,
                model_name=run.base_model,
                tokenizer_id=run.base_model,
            ),
            is_lora=True,
            lora_rank=run.lora.rank,
            model_name=run.base_model,
        )
    )


@routes.post("/api/v1/forward_backward")
async def forward_backward(request: web.Request) -> web.Response:
    body = await read_body(request)
    decoded = decode_forward_backward(body)
    run = await request.app[REGISTRY].run(decoded.model_id, request[TENANT])
    if not decoded.datums:
        raise UserError("forward_backward: data is empty")
    kind = "forward" if decoded.forward_only else "forward_backward"
    job = ForwardBackwardJob(
        request_id=new_request_id(kind),
        model_id=decoded.model_id,
        tenant_id=request[TENANT],
        seq_id=decoded.seq_id,
        published_at=time.time(),
        body=body,
        forward_only=decoded.forward_only,
        n_tokens=decoded.n_tokens,
    )
    return await submit(request, job, run.base_model)


@routes.post("/api/v1/optim_step")
async def optim_step(request: web.Request) -> web.Response:
    body = await read_json(request, api.OptimStepRequest)
    run = await request.app[REGISTRY].run(body.model_id, request[TENANT])
    if body.adam_params is None:
        raise UserError("optim_step: only adam_params is supported (the dimuon optimizer is not)")
    p = check_adam(body.adam_params)
    job = OptimStepJob(
        request_id=new_request_id("optim_step"),
        model_id=body.model_id,
        tenant_id=request[TENANT],
        seq_id=_seq(body.seq_id, "optim_step"),
        published_at=time.time(),
        adam=p,
    )
    return await submit(request, job, run.base_model)


@routes.post("/api/v1/save_weights")
async def save_weights(request: web.Request) -> web.Response:
    body = await read_json(request, api.SaveWeightsRequest)
    run = await request.app[REGISTRY].run(body.model_id, request[TENANT])
    job = SaveWeightsJob(
        request_id=new_request_id("save_weights"),
        model_id=body.model_id,
        tenant_id=request[TENANT],
        seq_id=_seq(body.seq_id, "save_weights"),
        published_at=time.time(),
        name=paths.check_name(body.path or ""),
        kind="weights",
        ttl_seconds=body.ttl_seconds,
        user_metadata=dict(body.user_metadata or {}),
    )
    return await submit(request, job, run.base_model)


@routes.post("/api/v1/save_weights_for_sampler")
async def save_weights_for_sampler(request: web.Request) -> web.Response:
    """Named: a sampler checkpoint at `path`. Unnamed (`save_weights_and_get_sampling_client`):
    an immutable snapshot plus a sampling session bound to it, answered by its id."""
    body = await read_json(request, api.SaveWeightsForSamplerRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    run = await registry.run(body.model_id, tenant)
    seq_id = _seq(body.seq_id, "save_weights_for_sampler")
    session_sampler = ""
    if body.path is not None:
        name = paths.check_name(body.path)
    elif body.sampling_session_seq_id is not None:
        session_sampler = f"{run.session_id}:sample:{body.sampling_session_seq_id}"
        name = f"snapshot-{seq_id}-{body.sampling_session_seq_id}"
        snapshot = paths.TinkerPath(run_id=run.model_id, kind="sampler_weights", name=name)
        await registry.put_sampler(
            SamplerRecord(
                sampling_session_id=session_sampler,
                tenant_id=tenant,
                session_id=run.session_id,
                base_model=run.base_model,
                model_path=str(snapshot),
                created_at=time.time(),
            )
        )
    else:
        raise UserError("save_weights_for_sampler needs path or sampling_session_seq_id")
    job = SaveWeightsJob(
        request_id=new_request_id("save_weights_for_sampler"),
        model_id=body.model_id,
        tenant_id=tenant,
        seq_id=seq_id,
        published_at=time.time(),
        name=name,
        kind="sampler_weights",
        ttl_seconds=body.ttl_seconds,
        user_metadata=dict(body.user_metadata or {}),
        sampling_session_id=session_sampler,
    )
    return await submit(request, job, run.base_model)


@routes.post("/api/v1/load_weights")
async def load_weights(request: web.Request) -> web.Response:
    body = await read_json(request, api.LoadWeightsRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    path = paths.parse_path(body.path)
    ckpt = await registry.checkpoint(path.run_id, path.checkpoint_id, tenant)
    if path.kind != "weights":
        raise UserError(
            f"load_weights needs a training checkpoint (tinker://<run>/weights/<name>), got {body.path!r}"
        )
    if body.optimizer and not ckpt.with_optimizer:
        raise UserError(f"checkpoint {body.path!r} has no optimizer state")
    now = time.time()
    if body.model_id is not None:  # legacy addressing: load into an existing model
        run = await registry.run(body.model_id, tenant)
        if run.base_model != ckpt.base_model:
            raise UserError(
                f"checkpoint base model {ckpt.base_model!r} differs from the model's {run.base_model!r}"
            )
        model_id, seq_id, create = run.model_id, body.seq_id or 0, False
    else:  # create-via-load: the SDK derives the model id itself
        if body.session_id is None or body.model_seq_id is None:
            raise UserError("load_weights needs either model_id or session_id + model_seq_id")
        session = await registry.session(body.session_id, tenant)
        registry.check_base_model(ckpt.base_model)
        model_id, seq_id, create = f"{session.session_id}:train:{body.model_seq_id}", 0, True
        if await registry.find_run(model_id) is None:
            await registry.put_run(
                RunRecord(
                    model_id=model_id,
                    tenant_id=tenant,
                    session_id=session.session_id,
                    base_model=ckpt.base_model,
                    lora=ckpt.lora,
                    created_at=now,
                    last_request_time=now,
                    user_metadata=dict(body.user_metadata or {}),
                )
            )
    job = LoadWeightsJob(
        request_id=new_request_id("load_weights"),
        model_id=model_id,
        tenant_id=tenant,
        seq_id=seq_id,
        published_at=now,
        path=body.path,
        with_optimizer=body.optimizer,
        create=create,
        base_model=ckpt.base_model,
    )
    return await submit(request, job, ckpt.base_model)
