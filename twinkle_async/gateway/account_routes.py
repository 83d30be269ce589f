"""The caller's account: billing usage, checkpoint storage, audit log and session search.

The `RestClient`/`AdminClient` calls `get_billing_usage` (`GET /api/v1/billing/usage/events`),
`get_current_checkpoint_storage_usage` (`GET /api/v1/billing/usage/checkpoints/current`),
`get_audit_log` (`GET /api/v1/audit`) and `search_sessions` (`POST /api/v1/sessions/search`).
Every answer is the caller's tenant's alone; every parameter is checked here (a `UserError`
naming it), lists are capped, and the responses are built by the pure `account_views`.

Place in the flow: the handlers read the registry and the usage history (`UsageLedger`, owned by
`ledger_ctx`, which watches the workers' usage counters while the gateway runs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta

from aiohttp import web

from protocol import account_api, rules
from protocol.errors import NotFound, UserError
from twinkle_async.gateway import account_views as views
from twinkle_async.gateway.bodies import json_response, read_json
from twinkle_async.gateway.state import BUS, KEYS, REGISTRY, TENANT
from twinkle_async.usage_history import UsageLedger, hour_of

routes = web.RouteTableDef()
LEDGER = web.AppKey("usage_ledger", UsageLedger)

MAX_WINDOW = timedelta(days=14)
MAX_SEARCH_LIMIT = 200
MAX_PROJECT_IDS = 100
MAX_METADATA_PAIRS = 64
MAX_METADATA_CHARS = 512
MAX_DISPLAY_NAME_CHARS = 256
MAX_STATUSES = 16
_MAX_PARAM_CHARS = 64


async def ledger_ctx(app: web.Application) -> AsyncIterator[None]:
    """The usage history keeper, for as long as the bus is up (registered after it)."""
    ledger = UsageLedger(app[BUS], app[REGISTRY])
    await ledger.start()
    app[LEDGER] = ledger
    yield
    await ledger.stop()


# -- parameters ---------------------------------------------------------------------------------


def _shown(raw: str) -> str:
    return repr(raw if len(raw) <= 40 else raw[:40] + "...")


def hour_param(request: web.Request, name: str) -> datetime:
    """A required RFC 3339 time on a whole UTC hour (a time without a zone is taken as UTC)."""
    raw = request.query.get(name)
    if raw is None:
        raise UserError(f"query parameter {name}: missing (an RFC 3339 time on a UTC hour)")
    try:
        if len(raw) > _MAX_PARAM_CHARS:
            raise ValueError
        when = datetime.fromisoformat(raw)
        when = (when if when.tzinfo else when.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):  # overflow: an offset that leaves the years 1..9999
        raise UserError(f"query parameter {name}: {_shown(raw)} is not an RFC 3339 time") from None
    if (when.minute, when.second, when.microsecond) != (0, 0, 0):
        raise UserError(f"query parameter {name}: {_shown(raw)} is not on a whole UTC hour")
    return when


def project_param(request: web.Request, tenant_id: str) -> None:
    """`project_id`, when sent, must be the caller's one project (its tenant id)."""
    raw = request.query.get("project_id")
    if raw is not None:
        check_project("project_id", raw, tenant_id)


def check_project(field: str, project_id: str, tenant_id: str) -> None:
    rules.check_id(field, project_id)
    if project_id != tenant_id:
        raise NotFound(f"{field}: project {project_id!r} not found (yours is {tenant_id!r})")


def check_search(query: account_api.SessionSearchRequest, tenant_id: str) -> None:
    """Every field of a session search within its bounds; projects and owners the caller's."""
    if not 1 <= query.limit <= MAX_SEARCH_LIMIT:
        raise UserError(f"limit: {query.limit} is not in 1..{MAX_SEARCH_LIMIT}")
    if query.session_id is not None:
        rules.check_id("session_id", query.session_id)
    if query.display_name is not None and not 1 <= len(query.display_name) <= (
        MAX_DISPLAY_NAME_CHARS
    ):
        raise UserError(f"display_name: must have 1 to {MAX_DISPLAY_NAME_CHARS} characters")
    if query.project_ids is not None:
        if len(query.project_ids) > MAX_PROJECT_IDS:
            raise UserError(f"project_ids: {len(query.project_ids)} ids, at most {MAX_PROJECT_IDS}")
        for project_id in query.project_ids:
            check_project("project_ids", project_id, tenant_id)
    if len(query.user_metadata) > MAX_METADATA_PAIRS:
        raise UserError(
            f"user_metadata: {len(query.user_metadata)} pairs, at most {MAX_METADATA_PAIRS}"
        )
    for key, value in query.user_metadata.items():
        if len(key) > MAX_METADATA_CHARS or len(value) > MAX_METADATA_CHARS:
            raise UserError(
                f"user_metadata: keys and values have at most {MAX_METADATA_CHARS} characters"
            )
    if isinstance(query.owner, account_api.UserSearchOwner):
        if not 1 <= len(query.owner.owner_urns) <= 10:
            raise UserError("owner.owner_urns: 1 to 10 owners")
        for owner in query.owner.owner_urns:
            if owner != tenant_id:
                shown = _shown(owner[:200])
                raise NotFound(f"owner.owner_urns: owner {shown} not found (you are {tenant_id!r})")
    if query.statuses is not None:
        if not 1 <= len(query.statuses) <= MAX_STATUSES:
            raise UserError(f"statuses: 1 to {MAX_STATUSES} statuses, or none for any")
        for status in query.statuses:
            if (
                isinstance(status, account_api.ClientFinishedSessionStatusQuery)
                and status.reasons == []
            ):
                raise UserError("statuses.reasons: at least one reason, or none for any")
    if query.cursor is not None:
        rules.check_id("cursor.last_session_id", query.cursor.last_session_id)


def day_param(request: web.Request, today: date) -> date:
    """`day` as `YYYY-MM-DD`, not after today (UTC); today when absent."""
    raw = request.query.get("day")
    if raw is None:
        return today
    try:
        if len(raw) != 10:
            raise ValueError
        day = date.fromisoformat(raw)
    except ValueError:
        raise UserError(f"query parameter day: {_shown(raw)} is not a date (YYYY-MM-DD)") from None
    if day > today:
        raise UserError(f"query parameter day: {raw} is in the future (today is {today})")
    return day


# -- handlers -----------------------------------------------------------------------------------


@routes.get("/api/v1/billing/usage/events")
async def billing_usage(request: web.Request) -> web.Response:
    """Hourly usage of the caller in `[starting_on, ending_before)` (at most 14 days)."""
    start = hour_param(request, "starting_on")
    end = hour_param(request, "ending_before")
    now = datetime.now(UTC)
    if start > now:
        raise UserError(f"query parameter starting_on: {start.isoformat()} is in the future")
    if end <= start:
        raise UserError("query parameter ending_before: must be after starting_on")
    if end - start > MAX_WINDOW:
        raise UserError("query parameter ending_before: at most 14 days after starting_on")
    tenant = request[TENANT]
    histories = await request.app[LEDGER].histories(tenant)
    ckpts = await request.app[REGISTRY].tenant_checkpoints(tenant)
    start_h = hour_of(start.timestamp())
    end_h = hour_of(end.timestamp())
    events = views.billing_events(tenant, histories, ckpts, start_h, end_h, now.timestamp())
    return json_response(account_api.BillingUsageResponse(data=events))


@routes.get("/api/v1/billing/usage/checkpoints/current")
async def checkpoint_storage(request: web.Request) -> web.Response:
    """What the caller stores now: count and bytes of its unexpired checkpoints."""
    tenant = request[TENANT]
    project_param(request, tenant)
    ckpts = await request.app[REGISTRY].tenant_checkpoints(tenant)
    return json_response(views.storage_usage(tenant, ckpts, datetime.now(UTC).timestamp()))


@routes.get("/api/v1/audit")
async def audit_log(request: web.Request) -> web.Response:
    """The caller's events of one UTC day, derived from its records (see `account_views`)."""
    event_type = request.query.get("event_type", "all")
    if event_type not in views.AUDIT_EVENT_TYPES:
        names = ", ".join(views.AUDIT_EVENT_TYPES)
        raise UserError(f"query parameter event_type: {_shown(event_type)} is not one of {names}")
    day = day_param(request, datetime.now(UTC).date())
    tenant = request[TENANT]
    registry = request.app[REGISTRY]
    day_start = datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()
    entries = views.audit_entries(
        tenant,
        event_type,
        day_start,
        await registry.sessions(tenant),
        await registry.runs(tenant),
        await registry.tenant_samplers(tenant),
        await registry.tenant_checkpoints(tenant),
        await request.app[KEYS].list(tenant),
    )
    return json_response(account_api.AuditLogResponse(entries=entries))


@routes.post("/api/v1/sessions/search")
async def search_sessions(request: web.Request) -> web.Response:
    """A page of the caller's sessions matching every filter, newest first."""
    query = await read_json(request, account_api.SessionSearchRequest)
    tenant = request[TENANT]
    check_search(query, tenant)
    registry = request.app[REGISTRY]
    page = views.search_sessions(
        tenant,
        query,
        await registry.sessions(tenant),
        await registry.runs(tenant),
        await registry.tenant_checkpoints(tenant),
        datetime.now(UTC).timestamp(),
    )
    return json_response(page)
