"""Training endpoints: create_model, get_info, forward_backward, optim_step, save, load.

Step 1 of the request flow (docs/architecture.md): read only what the call is routed on, check that the
caller owns the model, then hand the call to `sequenced.submit_sequenced`, which spends and
settles its `seq_id` (claim, tombstone on refusal, pending future, publish). Each handler's
`build` does the rest of the validation, so a refusal after ownership still settles the seq.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from protocol import api, paths, rules, stability
from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError
from protocol.jobs import (
    CreateModelJob,
    ForwardBackwardJob,
    Job,
    LoadWeightsJob,
    OptimStepJob,
    SaveWeightsJob,
)
from protocol.json_tensors import forward_backward_from_json, is_json
from protocol.records import CheckpointRecord, RunRecord, SamplerRecord, SessionRecord
from protocol.tensors import (
    FwdBwdSummary,
    check_budget,
    check_datum_lengths,
    check_images,
    check_target_width,
    forward_backward_ref,
    scan_forward_backward,
)
from twinkle_async import quotas
from twinkle_async.gateway.bodies import json_response, read_body, read_json
from twinkle_async.gateway.custom_loss_routes import custom_loss_for
from twinkle_async.gateway.provenance import resolve as resolve_provenance
from twinkle_async.gateway.sequenced import (
    BuildJob,
    live_run,
    owned_run,
    seq_ref,
    submit_sequenced,
)
from twinkle_async.gateway.state import BUS, QUOTAS, REGISTRY, SETTINGS, TENANT

routes = web.RouteTableDef()

# `model_seq_id` / `sampling_session_seq_id` count a session's clients; they become part of ids.
_MAX_CLIENT_SEQ = 2**31 - 1


def _client_seq(field: str, value: int) -> int:
    if not 0 <= value <= _MAX_CLIENT_SEQ:
        raise UserError(f"{field}: {value} is out of range 0..{_MAX_CLIENT_SEQ}")
    return value


def _check_optimizer(config: api.OptimizerConfig | None) -> None:
    if isinstance(config, api.DimuonOptimizerConfig):
        raise UserError("optimizer_config type 'dimuon' is not supported yet; use adamw")


async def new_run(
    request: web.Request,
    model_id: str,
    session: SessionRecord,
    base_model: str,
    lora: api.LoraConfig,
    user_metadata: dict[str, Any] | None,
    now: float,
) -> RunRecord:
    """The run record a creation (create_model or create-via-load) makes, unless it exists.

    A retried creation finds its own record; a different creation of the same id is refused
    when it claims seq 0 with another body.
    """
    registry = request.app[REGISTRY]
    run = await registry.find_run(model_id)
    if run is None:
        limits = await request.app[QUOTAS].limits(session.tenant_id)
        quotas.check_limit("max_rank", lora.rank, limits.max_rank)
        if limits.max_adapters is not None:
            active = [r for r in await registry.runs(session.tenant_id) if r.unloaded_at is None]
            quotas.check_cap("max_adapters", len(active), 1, limits.max_adapters)
        await check_storage(request, session.tenant_id)
        run = RunRecord(
            model_id=model_id,
            tenant_id=session.tenant_id,
            session_id=session.session_id,
            base_model=base_model,
            lora=lora,
            created_at=now,
            last_request_time=now,
            user_metadata=rules.check_user_metadata("user_metadata", user_metadata),
        )
        await registry.put_run(run)
    return run


def trainable_lora(request: web.Request, base_model: str, lora: api.LoraConfig) -> api.LoraConfig:
    """`lora` if the base model is served and its workers can train that adapter shape."""
    worker = request.app[REGISTRY].check_base_model(base_model)
    lora = rules.check_lora_config(lora, worker.max_rank if worker else None)
    for flag, reason in (worker.refused if worker else {}).items():
        if getattr(lora, flag, False):  # what the base model's workers cannot train
            raise UserError(reason)
    return lora


async def check_storage(request: web.Request, tenant_id: str) -> None:
    """A save of any kind is refused once the tenant's checkpoints fill its storage quota; so is
    a new run, which saves its state as a checkpoint when it is unloaded."""
    limit = (await request.app[QUOTAS].limits(tenant_id)).max_checkpoint_bytes
    if limit is not None:
        checkpoints = await request.app[REGISTRY].tenant_checkpoints(tenant_id)
        used = sum(c.size_bytes for c in checkpoints)
        quotas.check_room("max_checkpoint_bytes", used, limit)


@routes.post("/api/v1/create_model")
async def create_model(request: web.Request) -> web.Response:
    raw = await read_body(request)
    body = api.decode(raw, api.CreateModelRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    session = await registry.session(body.session_id, tenant)
    lora = trainable_lora(request, body.base_model, body.lora_config or api.LoraConfig())
    _check_optimizer(body.optimizer_config)
    model_id = f"{session.session_id}:train:{_client_seq('model_seq_id', body.model_seq_id)}"
    now = time.time()
    run = await new_run(request, model_id, session, body.base_model, lora, body.user_metadata, now)

    async def build(request_id: str, first: bool) -> Job:
        return CreateModelJob(
            request_id=request_id,
            model_id=model_id,
            tenant_id=tenant,
            seq_id=0,
            published_at=now,
            base_model=body.base_model,
            lora=lora,
        )

    return await submit_sequenced(request, run, 0, "create_model", raw, build)


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
    """Routed on a scan of the protobuf body: no tensor is built here; the worker decodes it."""
    return await _forward_backward(request, forward=False)


@routes.post("/api/v1/forward")
async def forward(request: web.Request) -> web.Response:
    """A forward-only pass as the SDKs before protobuf bodies send it (a JSON `ForwardRequest`)."""
    return await _forward_backward(request, forward=True)


async def _forward_backward(request: web.Request, *, forward: bool) -> web.Response:
    """A protobuf `ForwardBackwardRequest` body, or the JSON one of an older SDK converted to it
    (`protocol.json_tensors`). A body refused before it decodes still spends its seq when its
    `model_id` and `seq_id` can be read (`_refused`), so the model's next call runs at once."""
    sent = await read_body(request, protobuf=True)
    raw = sent
    try:
        if is_json(request.content_type, sent):
            raw = forward_backward_from_json(sent, forward_only=forward)
        summary = scan_forward_backward(raw)
    except UserError as refusal:
        return await _refused(request, sent, refusal, forward=forward)
    if forward and not summary.forward_only:  # a protobuf body sent to /forward
        message = pb.ForwardBackwardRequest.FromString(raw)
        message.forward_only = True
        raw = message.SerializeToString(deterministic=True)
        summary = scan_forward_backward(raw)
    run = await live_run(request, summary.model_id)
    kind = "forward" if summary.forward_only else "forward_backward"
    build = forward_backward_build(request, run, raw, summary)
    return await submit_sequenced(request, run, summary.seq_id, kind, raw, build)


def forward_backward_build(
    request: web.Request, run: RunRecord, raw: bytes, summary: FwdBwdSummary
) -> BuildJob:
    """The job of a protobuf `ForwardBackwardRequest` on `run`, every limit checked."""

    async def build(request_id: str, first: bool) -> Job:
        if not summary.n_datums:
            raise UserError("forward_backward: data is empty")
        # Images are read from their headers here and counted by their vision tokens; while
        # the model's worker is still loading, its worker checks them when it decodes.
        worker = request.app[REGISTRY].served_models().get(run.base_model)
        checked = (
            summary if worker is None else check_images(summary, worker.vision, run.base_model)
        )
        budget = request.app[SETTINGS].request_elements_budget
        check_budget(checked, budget)
        check_target_width(checked)
        check_datum_lengths(checked, worker.max_train_tokens if worker else None)
        custom_loss = None
        if summary.loss_fn == "custom":
            custom_loss = await custom_loss_for(request, run, summary.loss_id)
        limits = await request.app[QUOTAS].limits(run.tenant_id)
        quotas.check_limit(
            "max_tokens_per_request", checked.n_tokens, limits.max_tokens_per_request
        )
        not_before, reason = 0.0, ""
        if limits.tokens_per_minute is not None and first:
            start_at = await request.app[QUOTAS].admit_tokens(
                run.tenant_id, checked.n_tokens, limits.tokens_per_minute
            )
            if start_at > time.time():
                not_before = start_at
                reason = (
                    f"tenant {run.tenant_id!r} is over its {limits.tokens_per_minute} training"
                    " tokens per minute; this request is queued"
                )
        provenance = b""
        if summary.loss_fn == stability.LOSS_NAME:
            provenance = await resolve_provenance(request.app[BUS], raw, run.tenant_id)
        return ForwardBackwardJob(
            provenance=provenance,
            request_id=request_id,
            model_id=run.model_id,
            tenant_id=run.tenant_id,
            seq_id=summary.seq_id,
            published_at=time.time(),
            body=raw,
            forward_only=summary.forward_only,
            n_tokens=checked.n_tokens,
            max_elements=budget,
            not_before=not_before,
            queue_reason=reason,
            custom_loss=custom_loss,
        )

    return build


async def _refused(
    request: web.Request, sent: bytes, refusal: UserError, *, forward: bool
) -> web.Response:
    """`refusal` as the answer to the call that spent the seq `sent` names (a JSON body's
    `model_id` and `seq_id`, or a protobuf one's read before its damage), settled like any
    refused call; raised as it is when the body names none."""
    if is_json(request.content_type, sent):
        try:
            ref = seq_ref(sent)
        except UserError:
            raise refusal from None
        named = (ref.model_id, ref.seq_id) if ref.model_id and ref.seq_id is not None else None
    else:
        named = forward_backward_ref(sent)
    if named is None:
        raise refusal
    model_id, seq_id = named
    run = await live_run(request, model_id)

    async def build(request_id: str, first: bool) -> Job:
        raise refusal

    kind = "forward" if forward else "forward_backward"
    return await submit_sequenced(request, run, seq_id, kind, sent, build)


@routes.post("/api/v1/optim_step")
async def optim_step(request: web.Request) -> web.Response:
    raw = await read_body(request)
    run, seq_id = await owned_run(request, raw)

    async def build(request_id: str, first: bool) -> Job:
        body = api.decode(raw, api.OptimStepRequest)
        if body.adam_params is None:
            given = "optimizer_params (dimuon)" if body.optimizer_params else "nothing"
            raise UserError(
                f"adam_params: missing (got {given}); this server steps with AdamW only"
            )
        return OptimStepJob(
            request_id=request_id,
            model_id=run.model_id,
            tenant_id=run.tenant_id,
            seq_id=body.seq_id or 0,
            published_at=time.time(),
            adam=rules.check_adam(body.adam_params),
        )

    return await submit_sequenced(request, run, seq_id, "optim_step", raw, build)


async def refuse_existing(request: web.Request, run: RunRecord, path: paths.TinkerPath) -> None:
    """A checkpoint name is immutable content unless the call says `overwrite`."""
    if await request.app[REGISTRY].find_checkpoint(run.model_id, path.checkpoint_id) is not None:
        raise UserError(
            f"path: checkpoint {str(path)!r} already exists; choose another name or pass"
            " overwrite=True"
        )


@routes.post("/api/v1/save_weights")
async def save_weights(request: web.Request) -> web.Response:
    raw = await read_body(request)
    run, seq_id = await owned_run(request, raw)

    async def build(request_id: str, first: bool) -> Job:
        body = api.decode(raw, api.SaveWeightsRequest)
        name = rules.check_checkpoint_name("path", body.path or "")
        path = paths.TinkerPath(run_id=run.model_id, kind="weights", name=name)
        if not body.overwrite:
            await refuse_existing(request, run, path)
        await check_storage(request, run.tenant_id)
        return save_job(request_id, run, body, name, "weights")

    return await submit_sequenced(request, run, seq_id, "save_weights", raw, build)


@routes.post("/api/v1/save_weights_for_sampler")
async def save_weights_for_sampler(request: web.Request) -> web.Response:
    """Named: a sampler checkpoint at `path`. Unnamed (`save_weights_and_get_sampling_client`):
    an immutable snapshot plus a sampling session bound to it, answered by its id."""
    raw = await read_body(request)
    run, seq_id = await owned_run(request, raw)

    async def build(request_id: str, first: bool) -> Job:
        body = api.decode(raw, api.SaveWeightsForSamplerRequest)
        session_sampler = ""
        if body.path is not None:
            name = rules.check_checkpoint_name("path", body.path)
            if not body.overwrite:
                await refuse_existing(
                    request, run, paths.TinkerPath(run.model_id, "sampler_weights", name)
                )
        elif body.sampling_session_seq_id is not None:
            client_seq = _client_seq("sampling_session_seq_id", body.sampling_session_seq_id)
            session_sampler = f"{run.session_id}:sample:{client_seq}"
            name = f"snapshot-{body.seq_id}-{client_seq}"
            snapshot = paths.TinkerPath(run_id=run.model_id, kind="sampler_weights", name=name)
            await request.app[REGISTRY].put_sampler(
                SamplerRecord(
                    sampling_session_id=session_sampler,
                    tenant_id=run.tenant_id,
                    session_id=run.session_id,
                    base_model=run.base_model,
                    model_path=str(snapshot),
                    created_at=time.time(),
                )
            )
        else:
            raise UserError("save_weights_for_sampler needs path or sampling_session_seq_id")
        await check_storage(request, run.tenant_id)
        return save_job(
            request_id, run, body, name, "sampler_weights", sampling_session_id=session_sampler
        )

    return await submit_sequenced(request, run, seq_id, "save_weights_for_sampler", raw, build)


def save_job(
    request_id: str,
    run: RunRecord,
    body: api.SaveWeightsRequest
    | api.SaveWeightsForSamplerRequest
    | api.SaveWeightsExternalRequest,
    name: str,
    kind: paths.CheckpointKind,
    *,
    sampling_session_id: str = "",
) -> SaveWeightsJob:
    """The job of a save of any kind, its TTL and metadata checked."""
    metadata = getattr(body, "user_metadata", None)  # external exports carry none
    return SaveWeightsJob(
        request_id=request_id,
        model_id=run.model_id,
        tenant_id=run.tenant_id,
        seq_id=body.seq_id or 0,
        published_at=time.time(),
        name=name,
        kind=kind,
        ttl_seconds=rules.check_ttl_seconds("ttl_seconds", body.ttl_seconds),
        user_metadata=rules.check_user_metadata("user_metadata", metadata),
        sampling_session_id=sampling_session_id,
        overwrite=getattr(body, "overwrite", False),
    )


@routes.post("/api/v1/load_weights")
async def load_weights(request: web.Request) -> web.Response:
    """Legacy addressing (`model_id` + `seq_id`) loads into a model the caller owns and spends a
    seq; create-via-load (`session_id` + `model_seq_id`) creates the model as its seq 0."""
    raw = await read_body(request)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    ref = seq_ref(raw)
    if ref.model_id is not None:
        run = await live_run(request, ref.model_id)

        async def build_load(request_id: str, first: bool) -> Job:
            body = api.decode(raw, api.LoadWeightsRequest)
            ckpt = await loadable(request, body)
            if run.base_model != ckpt.base_model:
                raise UserError(
                    f"path: checkpoint base model {ckpt.base_model!r} differs from the model's"
                    f" {run.base_model!r}"
                )
            limits = await request.app[QUOTAS].limits(run.tenant_id)
            quotas.check_limit("max_rank", ckpt.lora.rank, limits.max_rank)
            _check_same_shape(body.path, ckpt.lora, run.lora)
            return LoadWeightsJob(
                request_id=request_id,
                model_id=run.model_id,
                tenant_id=tenant,
                seq_id=body.seq_id or 0,
                published_at=time.time(),
                path=body.path,
                with_optimizer=body.optimizer,
                base_model=ckpt.base_model,
                content_id=ckpt.content_id,
            )

        return await submit_sequenced(request, run, ref.seq_id, "load_weights", raw, build_load)

    body = api.decode(raw, api.LoadWeightsRequest)
    assert body.session_id is not None and body.model_seq_id is not None
    session = await registry.session(body.session_id, tenant)
    ckpt = await loadable(request, body)
    registry.check_base_model(ckpt.base_model)
    model_id = f"{session.session_id}:train:{_client_seq('model_seq_id', body.model_seq_id)}"
    now = time.time()
    created = await new_run(
        request, model_id, session, ckpt.base_model, ckpt.lora, body.user_metadata, now
    )

    async def build_create(request_id: str, first: bool) -> Job:
        return LoadWeightsJob(
            request_id=request_id,
            model_id=model_id,
            tenant_id=tenant,
            seq_id=0,
            published_at=now,
            path=body.path,
            with_optimizer=body.optimizer,
            create=True,
            base_model=ckpt.base_model,
            content_id=ckpt.content_id,
        )

    return await submit_sequenced(request, created, 0, "load_weights", raw, build_create)


def _check_same_shape(path: str, loaded: api.LoraConfig, model: api.LoraConfig) -> None:
    """A load into an existing model keeps its adapter's shape: the run record, `get_info` and
    the SDK's client all hold the shape it was created with. The seed only drew the initial
    weights a load replaces, so it may differ."""
    if msgspec.structs.replace(loaded, seed=model.seed) != model:
        raise UserError(
            f"path: checkpoint {path!r} has LoRA {_shape(loaded)}, the model has {_shape(model)};"
            " load it into a new model (create_training_client_from_state) instead"
        )


def _shape(lora: api.LoraConfig) -> str:
    fields = msgspec.structs.asdict(lora)
    del fields["seed"]
    return "(" + ", ".join(f"{name}={value}" for name, value in fields.items()) + ")"


async def loadable(request: web.Request, body: api.LoadWeightsRequest) -> CheckpointRecord:
    """The training checkpoint a load names, readable by the caller (own or published)."""
    path = paths.parse_path(body.path)
    ckpt = await request.app[REGISTRY].checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    if path.kind != "weights":
        raise UserError(
            f"path: load_weights needs a training checkpoint (tinker://<run>/weights/<name>),"
            f" got {body.path!r}"
        )
    if body.optimizer and not ckpt.with_optimizer:
        raise UserError(f"path: checkpoint {body.path!r} has no optimizer state")
    return ckpt
