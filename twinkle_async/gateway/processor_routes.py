"""The Twinkle Client protocol's processor routes (`/api/v1/processor/twinkle/create`, `/call`):
remote `Dataset` and `DataLoader` objects, run by the processor service (`workers.processor`, a
process of its own with twinkle-kit's dependencies, which the gateway does not carry).

The gateway authenticates the caller and checks its session (`X-Twinkle-Session-Id`, as the
model routes do: `twinkle_routes.twinkle_session`), then
forwards the body as it came, naming the tenant and the session to the service, which scopes
every object to them. The service's answer (a result, a 410 when an iterator is exhausted, a 4xx
naming what was refused) goes back as it is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from protocol.errors import ServerError, Unavailable, UserError
from protocol.records import SessionRecord
from twinkle_async.gateway.bodies import read_body
from twinkle_async.gateway.state import SETTINGS
from twinkle_async.gateway.twinkle_routes import twinkle_session

routes = web.RouteTableDef()

WAIT_S = 600.0  # twinkle's client waits as long for `encode` over a whole dataset
PROCESSOR_CLIENT = web.AppKey("processor_client", aiohttp.ClientSession)


async def processor_ctx(app: web.Application) -> AsyncIterator[None]:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S))
    app[PROCESSOR_CLIENT] = session
    yield
    await session.close()


async def _post(
    request: web.Request, session: SessionRecord, call: str, body: bytes
) -> tuple[int, bytes]:
    """The service's status and answer to `body`, sent for the caller's session."""
    settings = request.app[SETTINGS]
    if not settings.processor_url:
        raise ServerError(
            "this cluster runs no Twinkle processor service (start `up` with --twinkle-python)",
            code="no_processor",
            status=501,
        )
    headers = {
        "Content-Type": "application/json",
        "X-Processor-Secret": settings.processor_secret,
        "X-Tenant": session.tenant_id,
        "X-Session": session.session_id,
    }
    url = f"{settings.processor_url.rstrip('/')}/{call}"
    try:
        async with request.app[PROCESSOR_CLIENT].post(url, data=body, headers=headers) as answer:
            data = await answer.read()
            status = answer.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise Unavailable(f"the Twinkle processor service did not answer: {exc}") from None
    if status == 401:  # the gateway's secret, not the client's: never the client's fault
        raise ServerError("the Twinkle processor service refused this gateway's secret")
    return status, data


async def _forward(request: web.Request, call: str) -> web.Response:
    session = await twinkle_session(request)
    status, data = await _post(request, session, call, await read_body(request))
    return web.Response(body=data, status=status, content_type="application/json")


async def run_template(request: web.Request, session: SessionRecord, body: dict[str, Any]) -> Any:
    """A sampler's template at work in the service (`workers.processor.sampler_templates`):
    its result, or the service's refusal as ours (its status and detail)."""
    status, data = await _post(request, session, "template", json.dumps(body).encode())
    try:
        answer = json.loads(data)
    except ValueError:
        answer = {}
    if status == 200 and isinstance(answer, dict) and "result" in answer:
        return answer["result"]
    detail = answer.get("detail") if isinstance(answer, dict) else None
    if 400 <= status < 500:
        raise UserError(f"template: {detail or status}", status=status)
    raise ServerError(f"the Twinkle processor service failed: {detail or status}")


@routes.post("/api/v1/processor/twinkle/create")
async def create(request: web.Request) -> web.Response:
    return await _forward(request, "create")


@routes.post("/api/v1/processor/twinkle/call")
async def call(request: web.Request) -> web.Response:
    return await _forward(request, "call")
