"""Sampling endpoints: create_sampling_session, samplers/{id}, asample.

A sampling session points at a base model or at an immutable sampler checkpoint. `asample`
validates the request against the model (context, vocabulary) and publishes a `SampleJob` to
`tw.v1.sample.<pool>`, where any sampler of the pool takes it; the answer carries one
`sample_sequence_ids` entry per sample, as the SDK requires.
"""

from __future__ import annotations

import time

from aiohttp import web

from protocol import api, paths, stability, subjects
from protocol.errors import UserError
from protocol.jobs import SampleJob, TextPrompt
from protocol.records import SamplerRecord
from protocol.sampling import TEXT_ONLY, check_sample_request
from protocol.sampling_futures import check_sample_seq_id, clone_of
from twinkle_async.futures import new_request_id
from twinkle_async.gateway.bodies import json_response, read_body, read_json
from twinkle_async.gateway.sequenced import body_digest
from twinkle_async.gateway.state import BUS, FUTURES, QUOTAS, REGISTRY, SAMPLES, TENANT
from twinkle_async.registry import Registry
from twinkle_async.seq_claims import claim_seq

routes = web.RouteTableDef()


def sampling_session_id(session_id: str, seq_id: int) -> str:
    return f"{session_id}:sample:{seq_id}"


@routes.post("/api/v1/create_sampling_session")
async def create_sampling_session(request: web.Request) -> web.Response:
    body = await read_json(request, api.CreateSamplingSessionRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    session = await registry.session(body.session_id, tenant)
    client_seq = body.sampling_session_seq_id
    if not 0 <= client_seq < 2**31:
        raise UserError(f"sampling_session_seq_id: {client_seq} is out of range 0..{2**31 - 1}")
    content_id = ""
    if body.model_path:
        path = paths.parse_path(body.model_path)
        ckpt = await registry.checkpoint(path.run_id, path.checkpoint_id, tenant)
        if path.kind == "external_weights":
            raise UserError(
                f"model_path {body.model_path!r} is an exported adapter; sample from a sampler "
                "checkpoint (save_weights_for_sampler) or a saved state instead"
            )
        base_model = ckpt.base_model
        content_id = ckpt.content_id
    elif body.base_model:
        base_model = body.base_model
    else:
        raise UserError("create_sampling_session needs base_model or model_path")
    registry.check_base_model(base_model)
    sampler = SamplerRecord(
        sampling_session_id=sampling_session_id(session.session_id, body.sampling_session_seq_id),
        tenant_id=tenant,
        session_id=session.session_id,
        base_model=base_model,
        model_path=body.model_path or None,
        created_at=time.time(),
        content_id=content_id,
    )
    await registry.put_sampler(sampler)
    return json_response(
        api.CreateSamplingSessionResponse(sampling_session_id=sampler.sampling_session_id)
    )


@routes.get("/api/v1/samplers/{sampler_id}")
async def get_sampler(request: web.Request) -> web.Response:
    sampler = await request.app[REGISTRY].sampler(request.match_info["sampler_id"], request[TENANT])
    return json_response(
        api.GetSamplerResponse(
            sampler_id=sampler.sampling_session_id,
            base_model=sampler.base_model,
            model_path=sampler.model_path,
        )
    )


@routes.post("/api/v1/asample")
async def asample(request: web.Request) -> web.Response:
    raw = await read_body(request)
    body = api.decode(raw, api.SampleRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    if body.sampling_session_id is None:
        raise UserError("asample needs a sampling_session_id (create_sampling_session first)")
    sampler = await registry.sampler(body.sampling_session_id, tenant)
    check_sample(registry, sampler.base_model, body)
    futures = request.app[FUTURES]
    if body.seq_id is None:  # never a retry
        request_id = dedupe = new_request_id("sample")
        clone_id = 0
    else:
        # A sampling client numbers its samples too; a retry (same body) gets the same future.
        # Clones number theirs in disjoint blocks (`join_sampling_session`), so two clones'
        # requests never share a key.
        check_sample_seq_id("seq_id", body.seq_id)
        clone_id = clone_of(body.seq_id)
        dedupe = f"{sampler.sampling_session_id}/{body.seq_id}"
        claim, _ = await claim_seq(
            futures,
            sampler.sampling_session_id,
            body.seq_id,
            "sample",
            body_digest(raw),
            named=f"sampling session {sampler.sampling_session_id!r}",
        )
        request_id = claim.request_id
    await publish_sample(request, sampler, raw, request_id, dedupe, clone_id)
    return json_response(
        api.UntypedAPIFuture(
            request_id=request_id,
            sample_sequence_ids=[
                stability.sequence_id(request_id, i) for i in range(body.num_samples)
            ],
        )
    )


def check_sample(registry: Registry, base_model: str, body: api.SampleRequest) -> None:
    """Every rule of a sample body, so that a bad field is a 400 before anything is spent; the
    sampler builds the `SampleSpec` from the same body. Images are read from their headers
    here; the sampler decodes them."""
    worker = registry.check_base_model(base_model)
    if not registry.sampler_backends(base_model):
        raise UserError(
            f"no sampler serves {base_model!r} on this cluster (start one with --sampler)"
        )
    check_sample_request(
        body,
        max_context=worker.max_context if worker else None,
        vocab_size=worker.vocab_size if worker else None,
        vision=worker.vision if worker else None,
        max_sequence=registry.longest_sample(base_model),
        no_images=(
            TEXT_ONLY
            if worker
            else f"{base_model!r} is still loading: send images once it is served"
        ),
    )


async def publish_sample(
    request: web.Request,
    sampler: SamplerRecord,
    raw: bytes,
    request_id: str,
    dedupe: str,
    clone_id: int = 0,
    text: TextPrompt | None = None,
) -> None:
    """Admit a checked sample body (`raw`) under the tenant's concurrency quota, record it
    pending and publish it to the base model's pool."""
    tenant = sampler.tenant_id
    job = SampleJob(
        request_id=request_id,
        tenant_id=tenant,
        sampling_session_id=sampler.sampling_session_id,
        base_model=sampler.base_model,
        adapter_path=sampler.model_path or "",
        adapter_content_id=sampler.content_id,
        body=raw,
        published_at=time.time(),
        clone_id=clone_id,
        text=text,
    )
    bus = request.app[BUS]
    data = bus.encode_sample_job(job)  # past the bus's largest message: a 413, nothing pending
    # Counted for the whole cluster once the request id is known: a retried submit (its seq
    # claim names the same id) passes even at the limit; a refused one keeps its claim and is
    # counted when the SDK retries it.
    limit = (await request.app[QUOTAS].limits(tenant)).max_concurrent_samples
    await request.app[SAMPLES].admit(tenant, request_id, limit, time.time())
    await request.app[FUTURES].record_pending(
        request_id,
        "sample",
        "",
        tenant,
        sampling_session_id=sampler.sampling_session_id,
        clone_id=clone_id,
    )
    await bus.publish_sample(subjects.pool_of(sampler.base_model), job, dedupe, data)
