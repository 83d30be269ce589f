"""Sequenced calls on a training model beyond the training loop: `save_weights_external` and
`unload_model`.

Both spend a `seq_id` of the model and go through `submit_sequenced` (ownership first, then
the seq is claimed and settled even when the call is refused).

- `save_weights_external` exports the adapter as PEFT files under
  `tinker://<run>/external_weights/<name>` (adapter only, like a sampler checkpoint); the result
  is `{"path", "size_bytes"}`, and the checkpoint lists, downloads and deletes like any other.
  Encrypted exports (`age_encryption_recipients`) are refused: nothing here speaks age.
- `unload_model` (older SDKs) releases the model's slot. The SDK sends no `seq_id`, so the call
  takes the next seq after every call the gateway has seen for the model: it runs after them,
  and a call the client numbers after it is refused as a reused seq (the model is gone anyway).
"""

from __future__ import annotations

import time

from aiohttp import web

from protocol import api, paths, rules
from protocol.errors import UserError
from protocol.jobs import Job, SaveWeightsJob, UnloadModelJob
from twinkle_async.gateway.bodies import read_body
from twinkle_async.gateway.sequenced import seq_ref, submit_sequenced
from twinkle_async.gateway.state import FUTURES, REGISTRY, TENANT
from twinkle_async.gateway.training_routes import _owned_run, _refuse_existing

routes = web.RouteTableDef()


@routes.post("/api/v1/save_weights_external")
async def save_weights_external(request: web.Request) -> web.Response:
    raw = await read_body(request)
    run, seq_id = await _owned_run(request, raw)

    async def build(request_id: str) -> Job:
        body = api.decode(raw, api.SaveWeightsExternalRequest)
        if body.age_encryption_recipients:
            raise UserError(
                "age_encryption_recipients: encrypted exports are not supported by this server;"
                " omit it (downloads are served over signed, expiring URLs)"
            )
        name = rules.check_checkpoint_name("path", body.path)
        await _refuse_existing(
            request, run, paths.TinkerPath(run.model_id, "external_weights", name)
        )
        return SaveWeightsJob(
            request_id=request_id,
            model_id=run.model_id,
            tenant_id=run.tenant_id,
            seq_id=body.seq_id or 0,
            published_at=time.time(),
            name=name,
            kind="external_weights",
            ttl_seconds=rules.check_ttl_seconds("ttl_seconds", body.ttl_seconds),
        )

    return await submit_sequenced(request, run, seq_id, "save_weights_external", raw, build)


async def _next_seq(request: web.Request, model_id: str) -> int:
    """Reserve the seq after the highest the gateway has seen for the model."""
    futures = request.app[FUTURES]
    # `note_seq` answers the highest seq seen before the one given; 0 (the creation) never
    # raises it, so this reads it
    highest = await futures.note_seq(model_id, 0)
    while True:
        before = await futures.note_seq(model_id, highest + 1)
        if before <= highest:
            return highest + 1  # ours: nobody moved the line past it meanwhile
        highest = before


@routes.post("/api/v1/unload_model")
async def unload_model(request: web.Request) -> web.Response:
    raw = await read_body(request)
    ref = seq_ref(raw)
    if ref.model_id is None:
        raise UserError("model_id: missing")
    run = await request.app[REGISTRY].run(ref.model_id, request[TENANT])
    seq_id = ref.seq_id if ref.seq_id is not None else await _next_seq(request, run.model_id)

    async def build(request_id: str) -> Job:
        api.decode(raw, api.UnloadModelRequest)
        return UnloadModelJob(
            request_id=request_id,
            model_id=run.model_id,
            tenant_id=run.tenant_id,
            seq_id=seq_id,
            published_at=time.time(),
        )

    return await submit_sequenced(request, run, seq_id, "unload_model", raw, build)
