"""`retrieve_future`: step 6 of the request flow, a long-poll on the future's outcome.

Holds up to `long_poll_s` (under the SDK's 45 s read timeout), then answers `try_again`. A
finished forward_backward or sample answers protobuf to a client that asks for it in `Accept`
(SDK 0.38), JSON to one that does not (older SDKs); other results JSON; a failure
`{"error", "category"}` with status 200, as the SDK expects.
"""

from __future__ import annotations

import time

from aiohttp import web

from protocol import api, rules
from protocol.errors import ErrorCategory, NotFound, ServerError, UserError
from protocol.jobs import Outcome
from protocol.json_tensors import answer_json, wants_protobuf
from twinkle_async.gateway.bodies import json_response, read_json
from twinkle_async.gateway.state import FUTURES, REGISTRY, SAMPLES, SETTINGS, TENANT

routes = web.RouteTableDef()

WAIT_S = 590.0  # a waiting route's longest wait (twinkle's client gives up after 600 s)


async def _owned(request: web.Request, outcome: Outcome) -> bool:
    """Another tenant's future answers exactly like an unknown one."""
    if outcome.tenant_id:
        return bool(outcome.tenant_id == request[TENANT])
    # Written before futures carried their owner: judge by the model's owner, if any.
    if not outcome.model_id:
        return False
    run = await request.app[REGISTRY].find_run(outcome.model_id)
    return run is not None and run.tenant_id == request[TENANT]


@routes.post("/api/v1/retrieve_future")
async def retrieve_future(request: web.Request) -> web.Response:
    body = await read_json(request, api.FutureRetrieveRequest)
    rules.check_request_id("request_id", body.request_id)
    outcome = await request.app[FUTURES].wait(body.request_id, request.app[SETTINGS].long_poll_s)
    if outcome is None or not await _owned(request, outcome):
        raise NotFound(f"request_id {body.request_id!r} not found (unknown or expired)")
    if outcome.state == "pending":
        if outcome.not_before > time.time():
            return json_response(
                api.TryAgainResponse(
                    request_id=body.request_id,
                    queue_state="paused_rate_limit",
                    queue_state_reason=outcome.queue_reason or None,
                )
            )
        return json_response(api.TryAgainResponse(request_id=body.request_id, queue_state="active"))
    if outcome.request_type == "sample":
        await request.app[SAMPLES].done(request[TENANT], body.request_id)
    if outcome.state == "error":
        return json_response(
            api.RequestFailedResponse(
                error=outcome.error, category=outcome.category or ErrorCategory.UNKNOWN
            )
        )
    if outcome.payload_type == "proto":
        if wants_protobuf(request.headers.get("Accept", "")):
            return web.Response(body=outcome.payload, content_type="application/x-protobuf")
        # an SDK before protobuf answers (tinker 0.16): the same answer as JSON
        answer = answer_json(outcome.request_type, outcome.payload)
        return web.Response(body=answer, content_type="application/json")
    return web.Response(body=outcome.payload, content_type="application/json")


async def finished(request: web.Request, request_id: str) -> Outcome:
    """The outcome of a request this gateway submitted for its caller, once done (for routes
    that answer when the work is done, as Twinkle's and OpenAI's clients expect); its error
    as the answer's."""
    futures = request.app[FUTURES]
    deadline = time.monotonic() + WAIT_S
    while True:
        outcome = await futures.wait(request_id, max(0.1, min(30.0, deadline - time.monotonic())))
        if outcome is None:
            raise ServerError(f"request {request_id} was lost")
        if outcome.state != "pending":
            break
        if time.monotonic() > deadline:
            raise ServerError(f"request {request_id} did not finish in {WAIT_S:.0f} s", status=504)
    if outcome.state == "error":
        if outcome.category is ErrorCategory.USER:
            raise UserError(outcome.error)
        raise ServerError(outcome.error)
    return outcome
