"""Endpoints this server does not implement: a clear 404 that still settles the call's seq.

The SDK numbers a training client's calls before sending them, including calls to endpoints a
server may not have (`save_weights_external`, say). A plain 404 would leave that `seq_id`
unspent and stall the model's next call, so a POST that names a model the caller owns and a
`seq_id` is settled like any refused call (see `sequenced.py`). Registered last: it only sees
paths no other route matched.
"""

from __future__ import annotations

from aiohttp import web

from protocol.errors import NotFound, UserError
from protocol.jobs import Job
from twinkle_async.gateway.bodies import read_body
from twinkle_async.gateway.sequenced import seq_ref, submit_sequenced
from twinkle_async.gateway.state import REGISTRY, TENANT

routes = web.RouteTableDef()


@routes.route("*", "/api/v1/{endpoint:.*}")
async def unknown_endpoint(request: web.Request) -> web.StreamResponse:
    endpoint = request.match_info["endpoint"]
    refusal = NotFound(f"endpoint /api/v1/{endpoint[:80]} is not supported by this server")
    if request.method != "POST":
        raise refusal
    raw = await read_body(request)
    try:
        ref = seq_ref(raw)
    except UserError:
        raise refusal from None
    if ref.model_id is None or ref.seq_id is None:
        raise refusal
    run = await request.app[REGISTRY].run(ref.model_id, request[TENANT])

    async def build(request_id: str, first: bool) -> Job:
        raise refusal

    return await submit_sequenced(request, run, ref.seq_id, "unsupported", raw, build)
