"""Sequenced calls on a training model beyond the training loop: `save_weights_external` and
`unload_model`.

Both spend a `seq_id` of the model and go through `submit_sequenced` (ownership first, then
the seq is claimed and settled even when the call is refused).

- `save_weights_external` exports the adapter as PEFT files under
  `tinker://<run>/external_weights/<name>` (adapter only, like a sampler checkpoint); the result
  is `{"path", "size_bytes"}`, and the checkpoint lists, downloads and deletes like any other.
  Encrypted exports (`age_encryption_recipients`) are refused: nothing here speaks age.
- `unload_model` (older SDKs) releases the model's slot, its state saved as
  `weights/session-end` (see `lifecycle.py`). The SDK sends no `seq_id`, so the call takes the
  next seq after every call the gateway has seen for the model; later calls on the model
  answer 410.
"""

from __future__ import annotations

import time

from aiohttp import web

from protocol import api, paths, rules
from protocol.errors import UserError
from protocol.jobs import Job, UnloadModelJob
from twinkle_async.gateway.bodies import json_response, read_body
from twinkle_async.gateway.sequenced import live_run, owned_run, seq_ref, submit_sequenced
from twinkle_async.gateway.state import LIFECYCLE, REGISTRY
from twinkle_async.gateway.training_routes import check_storage, refuse_existing, save_job
from twinkle_async.lifecycle import SESSION_END_CHECKPOINT

routes = web.RouteTableDef()


@routes.post("/api/v1/save_weights_external")
async def save_weights_external(request: web.Request) -> web.Response:
    raw = await read_body(request)
    run, seq_id = await owned_run(request, raw)

    async def build(request_id: str, first: bool) -> Job:
        body = api.decode(raw, api.SaveWeightsExternalRequest)
        if body.age_encryption_recipients:
            raise UserError(
                "age_encryption_recipients: encrypted exports are not supported by this server;"
                " omit it (downloads are served over signed, expiring URLs)"
            )
        name = rules.check_checkpoint_name("path", body.path)
        await refuse_existing(
            request, run, paths.TinkerPath(run.model_id, "external_weights", name)
        )
        await check_storage(request, run.tenant_id)
        return save_job(request_id, run, body, name, "external_weights")

    return await submit_sequenced(request, run, seq_id, "save_weights_external", raw, build)


@routes.post("/api/v1/unload_model")
async def unload_model(request: web.Request) -> web.Response:
    raw = await read_body(request)
    ref = seq_ref(raw)
    if ref.model_id is None:
        raise UserError("model_id: missing")
    run = await live_run(request, ref.model_id)
    api.decode(raw, api.UnloadModelRequest)
    if ref.seq_id is None:  # as older SDKs send it: after everything sent so far
        request_id = await request.app[LIFECYCLE].unload(run)
        return json_response(api.UntypedAPIFuture(request_id=request_id, model_id=run.model_id))

    async def build(request_id: str, first: bool) -> Job:
        return UnloadModelJob(
            request_id=request_id,
            model_id=run.model_id,
            tenant_id=run.tenant_id,
            seq_id=ref.seq_id or 0,
            published_at=time.time(),
            save_as=SESSION_END_CHECKPOINT,
        )

    response = await submit_sequenced(request, run, ref.seq_id, "unload_model", raw, build)
    run.unloaded_at = time.time()  # later calls answer 410 rather than wait for a gone line
    await request.app[REGISTRY].put_run(run)
    return response
