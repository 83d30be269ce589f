"""`GET /metrics` (Prometheus, no API key) and the middleware that times every request.

The middleware is the outermost one, so it sees the status the client gets after the error
middleware has mapped exceptions, and it labels each request by its route's canonical path
(`/api/v1/training_runs/{run_id}`), never the raw path: ids in paths would make a series per
run. A request no route matched is labelled `unmatched`; a client that hangs up first, `499`.
The series themselves are `twinkle_async.metrics`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from twinkle_async.gateway.state import BUS
from twinkle_async.metrics import GatewayMetrics

METRICS = web.AppKey("metrics", GatewayMetrics)
QUEUE_DEPTH_TIMEOUT_S = 2.0  # a scrape waits at most this long for JetStream's consumer list
CLIENT_CLOSED = 499  # nginx's code for a request the client abandoned

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

routes = web.RouteTableDef()


def route_of(request: web.Request) -> str:
    """The canonical path of the route that matched, or `unmatched`."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    finally:
        request.app[METRICS].observe_request(
            route_of(request), request.method, status, time.perf_counter() - started
        )


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Every gateway series, queue depth read now (bounded by `QUEUE_DEPTH_TIMEOUT_S`)."""
    gateway_metrics = request.app[METRICS]
    js = request.app[BUS].js
    if js is not None:
        await gateway_metrics.refresh_queue_depth(js, QUEUE_DEPTH_TIMEOUT_S)
    body, content_type = gateway_metrics.render(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})
