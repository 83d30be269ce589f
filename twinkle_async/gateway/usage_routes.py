"""Usage per day and per training run, priced at the operator's prices.

- `GET /api/v1/usage?days=N`: the caller's tenant's usage of the last N UTC days (today
  included; 1 to 14, 7 by default), per day and per run, with costs.
- `GET /admin/v1/tenants/{name}/usage?days=N`: the same for any tenant, for the operator.
- `GET` / `PUT /admin/v1/prices`: the price list (`protocol.records.PriceList`), kept in KV
  `tw_quotas` under `subjects.PRICES_KEY`; a `PUT` changes the fields it gives.

Place in the flow: the handlers read the hourly usage history (the `UsageLedger` that
`account_routes.ledger_ctx` owns), the tenant's runs through the registry's tenant index, each
run's metric history (`rest_routes.metric_steps`) and the prices; `usage_views` builds the
answer. A tenant's call reads its own records only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from protocol import api, records, subjects
from protocol.errors import Unavailable
from protocol.metric_history import MetricEntry
from protocol.records import PriceList, RunRecord
from twinkle_async.bus import Bus
from twinkle_async.gateway import rest_routes
from twinkle_async.gateway import usage_views as views
from twinkle_async.gateway.account_routes import LEDGER
from twinkle_async.gateway.admin_routes import _known_tenant
from twinkle_async.gateway.bodies import json_response, read_body
from twinkle_async.gateway.state import BUS, REGISTRY, TENANT

routes = web.RouteTableDef()

HISTORY_READS = 8  # runs' metric histories read at once by one call
_MAX_SWAPS = 8


async def read_prices(bus: Bus) -> PriceList:
    """The operator's prices; all zero until some are set."""
    data = await bus.get(subjects.BUCKET_QUOTAS, subjects.PRICES_KEY)
    return records.decode(data, PriceList) if data else PriceList()


async def _usage(request: web.Request, tenant_id: str) -> dict[str, Any]:
    """`usage_views.usage_view` of one tenant, its records read here."""
    window = views.Window.ending(time.time(), views.days_param(request.query.get("days")))
    runs, truncated = views.runs_to_read(await request.app[REGISTRY].runs(tenant_id), window)
    reads = asyncio.Semaphore(HISTORY_READS)

    async def history(run: RunRecord) -> list[MetricEntry]:
        async with reads:
            return await rest_routes.metric_steps(request, run.model_id)

    histories = await asyncio.gather(*(history(run) for run in runs))
    return views.usage_view(
        tenant_id,
        await read_prices(request.app[BUS]),
        await request.app[LEDGER].histories(tenant_id),
        zip(runs, histories, strict=True),
        window,
        truncated,
    )


@routes.get("/api/v1/usage")
async def tenant_usage(request: web.Request) -> web.Response:
    """The caller's usage per day and per run, with costs."""
    return json_response(await _usage(request, request[TENANT]))


@routes.get("/admin/v1/tenants/{name}/usage")
async def admin_tenant_usage(request: web.Request) -> web.Response:
    """Any tenant's usage per day and per run, with costs (404 for a tenant that is not)."""
    return json_response(
        await _usage(request, await _known_tenant(request, request.match_info["name"]))
    )


@routes.get("/admin/v1/prices")
async def show_prices(request: web.Request) -> web.Response:
    """The price list, in the shape `PUT` takes."""
    return json_response(views.prices_view(await read_prices(request.app[BUS])))


@routes.put("/admin/v1/prices")
async def set_prices(request: web.Request) -> web.Response:
    """Change the prices the body gives (a compare-and-set, so two operators' changes of
    different fields both stay)."""
    change = api.decode(await read_body(request), views.PriceChange)
    bus = request.app[BUS]
    for _ in range(_MAX_SWAPS):
        entry = await bus.entry(subjects.BUCKET_QUOTAS, subjects.PRICES_KEY)
        current = records.decode(entry[0], PriceList) if entry else PriceList()
        prices = views.price_change(current, change)
        revision = entry[1] if entry else None
        if await bus.swap(
            subjects.BUCKET_QUOTAS, subjects.PRICES_KEY, records.encode(prices), revision
        ):
            return json_response(views.prices_view(prices))
    raise Unavailable(f"the prices changed under {_MAX_SWAPS} tries; retry")
