"""The web console at `/console`: one page and its assets, served from this package.

The page (`console/index.html`, `console/console.js`) is a small script with no build step that
draws what the gateway's own JSON routes answer: the tenant's runs, metric history
(`/api/v1/training_runs/{id}/metrics`), checkpoints and their actions (the REST routes the SDK
calls), the playground (`/v1/completions`), usage (`/api/v1/usage`) and, for the operator, the
admin API. Charts are drawn by uPlot, vendored from the npm registry (`console/vendor/`,
`make vendor-console`): no CDN, so the console works offline.

Logging in exchanges a key for a session cookie (`console_session`); the page then calls the
same routes a client does, with the cookie and its CSRF token instead of a key. What only the
console needs is here: the run list with status and steps, a checkpoint's download link,
workers with their token rates, and the recent errors every gateway sees.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from protocol import paths
from protocol.errors import Forbidden, NotFound, Unauthorized, UserError
from protocol.jobs import Outcome
from protocol.metric_history import MetricEntry
from protocol.records import RunRecord
from twinkle_async.auth import hash_key, same_secret
from twinkle_async.gateway import console_session
from twinkle_async.gateway.account_routes import LEDGER
from twinkle_async.gateway.admin_routes import consumer_depths
from twinkle_async.gateway.bodies import json_response
from twinkle_async.gateway.checkpoint_routes import archive_location
from twinkle_async.gateway.middleware import console_identity
from twinkle_async.gateway.rest_routes import metric_steps
from twinkle_async.gateway.state import (
    CONSOLE_KIND,
    FUTURES,
    KEYS,
    REGISTRY,
    SETTINGS,
    TENANT,
)
from twinkle_async.registry import WORKER_STALE_S

routes = web.RouteTableDef()

ASSETS = Path(__file__).parent / "console"
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
# every file the console serves, by name; nothing outside this list is ever read
_FILES: dict[str, Path] = {
    str(p.relative_to(ASSETS)): p
    for p in sorted(ASSETS.rglob("*"))
    if p.is_file() and p.suffix in _TYPES and p.name != "index.html"
}
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        " connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
MAX_LOGIN_BYTES = 4096
MAX_RUNS = 20  # runs the list shows, the most recently active first (each history is read)
HISTORY_READS = 4  # runs' metric histories read at once by one call
MAX_ERRORS = 100  # recent failed requests a gateway keeps for the operator
RATE_WINDOW_S = 60.0


class Login(msgspec.Struct, forbid_unknown_fields=True):
    key: str


# -- the page -----------------------------------------------------------------------------------


@routes.get("/console")
async def page(request: web.Request) -> web.Response:
    return web.Response(
        body=(ASSETS / "index.html").read_bytes(),
        content_type="text/html",
        charset="utf-8",
        headers={**_SECURITY_HEADERS, "Cache-Control": "no-store"},
    )


@routes.get("/console/")
async def page_slash(request: web.Request) -> web.Response:
    raise web.HTTPFound("/console")


@routes.get("/console/static/{name:.+}")
async def asset(request: web.Request) -> web.Response:
    found = _FILES.get(request.match_info["name"])
    if found is None:
        raise NotFound("no such console file")
    return web.Response(
        body=found.read_bytes(),
        content_type=_TYPES[found.suffix],
        headers={**_SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )


# -- the session --------------------------------------------------------------------------------


def _same_origin(request: web.Request) -> None:
    """A login or logout from a page of another site is refused (no login CSRF)."""
    origin = request.headers.get("Origin")
    if origin is not None and origin != f"{request.scheme}://{request.host}":
        raise Forbidden("the console accepts logins from its own pages only")


def _session_view(request: web.Request, cookie: str, kind: str, tenant: str) -> dict[str, Any]:
    settings = request.app[SETTINGS]
    return {
        "kind": kind,
        "tenant": tenant,
        "csrf": console_session.csrf_token(settings.download_secret, cookie),
    }


@routes.post("/console/login")
async def login(request: web.Request) -> web.Response:
    """Open a session with a tenant's key or the admin key, sent in the body (never a URL)."""
    _same_origin(request)
    raw = await request.content.read(MAX_LOGIN_BYTES + 1)
    if len(raw) > MAX_LOGIN_BYTES:
        raise UserError(f"a login body is at most {MAX_LOGIN_BYTES} bytes")
    try:
        key = msgspec.json.decode(raw, type=Login).key.strip()
    except msgspec.DecodeError as err:
        raise UserError(f'a login body is {{"key": "..."}}: {err}') from None
    settings = request.app[SETTINGS]
    tenant = ""
    if settings.admin_key and same_secret(key, settings.admin_key):
        kind: console_session.Kind = "admin"
    else:
        found = await request.app[KEYS].tenant_of(key)
        if found is None:
            raise Unauthorized("that key is not a valid API key or the admin key")
        kind, tenant = "tenant", found
    cookie = console_session.issue(settings.download_secret, kind, hash_key(key))
    response = json_response(_session_view(request, cookie, kind, tenant))
    response.set_cookie(
        console_session.COOKIE,
        cookie,
        max_age=console_session.SESSION_S,
        path="/",
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return response


@routes.post("/console/logout")
async def logout(request: web.Request) -> web.Response:
    _same_origin(request)
    response = json_response({})
    response.del_cookie(console_session.COOKIE, path="/")
    return response


@routes.get("/console/session")
async def session(request: web.Request) -> web.Response:
    """Who the session cookie is, with its CSRF token (readable by the console's own page only:
    this server sends no CORS headers); `kind` null when there is none or it no longer holds."""
    cookie = request.cookies.get(console_session.COOKIE, "")
    found = await console_identity(request, cookie) if cookie else None
    if found is None:
        return json_response({"kind": None, "tenant": "", "csrf": ""})
    return json_response(_session_view(request, cookie, *found))


def _tenant(request: web.Request) -> str:
    if request[CONSOLE_KIND] != "tenant":
        raise Forbidden("a tenant's page: log in with the tenant's API key")
    return request[TENANT]


def _operator(request: web.Request) -> None:
    if request[CONSOLE_KIND] != "admin":
        raise Forbidden("an operator's page: log in with the admin key")


# -- the tenant's pages -------------------------------------------------------------------------


def _status(run: RunRecord) -> str:
    if run.corrupted:
        return "failed"
    if run.copied_from:
        return "copy"
    return "ended" if run.unloaded_at is not None else "active"


@routes.get("/console/api/runs")
async def runs(request: web.Request) -> web.Response:
    """The tenant's runs, most recently active first: status, base model, rank, optimizer
    steps taken, the last loss and the last activity."""
    tenant = _tenant(request)
    registry = request.app[REGISTRY]
    found = sorted(await registry.runs(tenant), key=lambda r: -r.last_request_time)
    shown = found[:MAX_RUNS]
    reads = asyncio.Semaphore(HISTORY_READS)

    async def history(run: RunRecord) -> list[MetricEntry]:
        async with reads:
            return await metric_steps(request, run.model_id)

    histories = await asyncio.gather(*(history(run) for run in shown))
    rows = []
    for run, steps in zip(shown, histories, strict=True):
        ckpts = await registry.checkpoints(run.model_id)
        losses = [
            e.metrics.get("loss:sum")
            for e in steps
            if e.kind == "forward_backward" and "loss:sum" in e.metrics
        ]
        rows.append(
            {
                "run_id": run.model_id,
                "status": _status(run),
                "base_model": run.base_model,
                "rank": run.lora.rank,
                "steps": sum(1 for e in steps if e.kind == "optim_step"),
                "last_loss": losses[-1] if losses else None,
                "checkpoints": len(ckpts),
                "created_at": run.created_at,
                "last_activity": max(
                    [
                        run.last_request_time,
                        *(e.time for e in steps[-1:]),
                        *(c.created_at for c in ckpts),
                    ]
                ),
            }
        )
    return json_response({"runs": rows, "total": len(found), "shown": len(rows)})


@routes.get("/console/api/download")
async def download(request: web.Request) -> web.Response:
    """A signed link to a tar of one of the tenant's checkpoints (`?path=tinker://…`)."""
    tenant = _tenant(request)
    path = paths.parse_path(request.query.get("path", ""))
    ckpt = await request.app[REGISTRY].checkpoint(path.run_id, path.checkpoint_id, tenant)
    url, expires = archive_location(request, path, ckpt)
    return json_response({"url": url, "expires": expires})


# -- the operator's pages -----------------------------------------------------------------------


class RecentErrors:
    """The last failed requests this gateway saw finish (every gateway sees every outcome)."""

    def __init__(self, size: int = MAX_ERRORS) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=size)

    def record(self, outcome: Outcome) -> None:
        if outcome.state != "error":
            return
        self.entries.append(
            {
                "time": outcome.finished_at or time.time(),
                "request_id": outcome.request_id,
                "request_type": outcome.request_type,
                "tenant": outcome.tenant_id,
                "model_id": outcome.model_id,
                "category": outcome.category.value if outcome.category else "",
                "error": outcome.error[:500],
            }
        )


class TokenRates:
    """Each worker's tokens a second over the last minute, from its usage counters as the
    operator's page reads them (trained, forward and sampled tokens of every tenant)."""

    def __init__(self) -> None:
        self.readings: deque[tuple[float, dict[str, int]]] = deque()

    def add(self, now: float, totals: dict[str, int]) -> dict[str, float | None]:
        self.readings.append((now, totals))
        while len(self.readings) > 2 and now - self.readings[1][0] >= RATE_WINDOW_S:
            self.readings.popleft()
        then, before = self.readings[0]
        elapsed = now - then
        return {
            worker: (
                max(0, total - before[worker]) / elapsed
                if elapsed >= 1.0 and worker in before
                else None
            )
            for worker, total in totals.items()
        }


ERRORS = web.AppKey("console_errors", RecentErrors)
RATES = web.AppKey("console_rates", TokenRates)


async def console_ctx(app: web.Application) -> AsyncIterator[None]:
    """The recent errors list and the token rates, kept from the bus's start."""
    errors, app[RATES] = RecentErrors(), TokenRates()
    app[ERRORS] = errors
    app[FUTURES].on_finished.append(errors.record)
    yield
    app[FUTURES].on_finished.remove(errors.record)


def _worker_tokens(request: web.Request) -> dict[str, int]:
    """Each worker's trained, forward and sampled tokens of every tenant, as the usage ledger
    last heard them."""
    totals: dict[str, int] = {}
    for record in request.app[LEDGER].latest.values():
        tokens = record.tokens_trained + record.tokens_forward + record.sampled_tokens
        totals[record.worker_id] = totals.get(record.worker_id, 0) + tokens
    return totals


@routes.get("/console/api/workers")
async def workers(request: web.Request) -> web.Response:
    """Each worker: base model, role, slots used and free, its pool's queue depth, tokens/s."""
    _operator(request)
    now = time.time()
    depth = {c["pool"]: c for c in await consumer_depths(request) if c["pool"]}
    known = request.app[REGISTRY].workers.values()
    tokens = _worker_tokens(request)
    rates = request.app[RATES].add(now, {w.worker_id: tokens.get(w.worker_id, 0) for w in known})
    rows = [
        {
            "worker_id": w.worker_id,
            "role": w.role,
            "pool": w.pool,
            "base_model": w.base_model,
            "slots_used": w.slots_used,
            "slots_free": max(0, w.slots_total - w.slots_used),
            "queue_depth": depth.get(w.pool, {}).get("backlog", 0),
            "tokens_per_s": rates.get(w.worker_id),
            "stale": now - w.heartbeat_at > WORKER_STALE_S,
        }
        for w in sorted(request.app[REGISTRY].workers.values(), key=lambda w: w.worker_id)
    ]
    pools = [c for c in depth.values() if "consumer" not in c]
    return json_response({"workers": rows, "pools": pools})


@routes.get("/console/api/errors")
async def errors(request: web.Request) -> web.Response:
    """The last failed requests, newest first."""
    _operator(request)
    return json_response({"errors": list(reversed(request.app[ERRORS].entries))})
