"""Server-side custom losses: `create_custom_loss`, and the lookup a `custom` forward_backward uses.

Step 1 (`create_custom_loss`): the SDK uploads a torch.fx graph traced from the user's loss. It
is validated here as plain data (`protocol.custom_loss.check_custom_loss`: allow-listed targets,
sizes, references), stored in KV `tw_sessions` under the session's n-th loss id, and the call's
future resolves at once to `{"loss_id"}` (the SDK polls it like any future).
Step 2 (`custom_loss_for`): a `forward_backward(loss_fn="custom", loss_fn_config={"loss_id"})`
resolves the id; the job then carries the validated graph, so the worker looks nothing up.

Invariants: a loss belongs to the tenant and session that created it; any other caller's id
answers like an unknown one (a `UserError` naming `loss_fn_config.loss_id`). A retried upload
(same body) gets the same loss id; a different graph under the same `custom_loss_seq_id` is
refused. Nothing in a graph is evaluated here.
"""

from __future__ import annotations

import time

from aiohttp import web

from protocol import api
from protocol.custom_loss import (
    MAX_BODY_BYTES,
    CustomLoss,
    CustomLossRecord,
    check_custom_loss,
    loss_id_of,
)
from protocol.errors import Gone, PayloadTooLarge, UserError
from protocol.jobs import Outcome
from protocol.records import RunRecord
from twinkle_async.futures import new_request_id
from twinkle_async.gateway.bodies import json_response, read_body
from twinkle_async.gateway.sequenced import body_digest
from twinkle_async.gateway.state import FUTURES, REGISTRY, TENANT

routes = web.RouteTableDef()

REQUEST_TYPE = "create_custom_loss"


@routes.post("/api/v1/create_custom_loss")
async def create_custom_loss(request: web.Request) -> web.Response:
    raw = await read_body(request)
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLarge(
            f"create_custom_loss body of {len(raw)} bytes exceeds {MAX_BODY_BYTES} bytes"
        )
    body = api.decode(raw, api.CreateCustomLossRequest)
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    session = await registry.session(body.session_id, tenant)
    if session.finished:
        raise Gone(f"session {body.session_id!r} is finished")
    loss_id = loss_id_of(session.session_id, body.custom_loss_seq_id)
    loss = check_custom_loss(loss_id, body.name, body.inputs, body.graph)
    record = CustomLossRecord(
        tenant_id=tenant,
        session_id=session.session_id,
        digest=body_digest(raw),
        created_at=time.time(),
        loss=loss,
    )
    stored = await registry.create_custom_loss(record)
    if stored.digest != record.digest:
        raise UserError(
            f"custom_loss_seq_id: {body.custom_loss_seq_id} of session {session.session_id!r} was"
            " already used by another loss; each create_custom_loss takes the next seq"
        )
    request_id = new_request_id(REQUEST_TYPE)
    await request.app[FUTURES].resolve(
        Outcome(
            request_id=request_id,
            state="done",
            request_type=REQUEST_TYPE,
            payload=api.encode(api.CreateCustomLossResponse(loss_id=loss_id)),
            created_at=record.created_at,
            finished_at=time.time(),
            tenant_id=tenant,
        )
    )
    return json_response(api.UntypedAPIFuture(request_id=request_id))


async def custom_loss_for(request: web.Request, run: RunRecord, loss_id: str) -> CustomLoss:
    """The loss a `custom` forward_backward on `run` names: one its own session created."""
    if not loss_id:
        raise UserError(
            "loss_fn_config.loss_id: missing; loss_fn custom runs a loss created with"
            " ServiceClient.create_custom_loss"
        )
    record = await request.app[REGISTRY].find_custom_loss(loss_id)
    if record is None or record.tenant_id != run.tenant_id or record.session_id != run.session_id:
        raise UserError(
            f"loss_fn_config.loss_id: {loss_id[:120]!r} is not a custom loss of this model's"
            " session"
        )
    return record.loss
