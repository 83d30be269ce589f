"""Request middleware: API-key auth, and the one place errors become responses.

A `TwinkleError` becomes its HTTP status with a JSON body (`detail`, `category`, `code`) and an
`x-should-retry` header the SDK honours. The bus wrapper turns a NATS outage that outlasts its
retries into `Unavailable` (503, retry); a transient NATS error that reaches here by another path
is answered the same way. Anything else is logged with the request id and answered as a server
error with no traceback.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from protocol.errors import (
    ErrorCategory,
    Forbidden,
    PayloadTooLarge,
    TwinkleError,
    Unauthorized,
    Unavailable,
    UserError,
)
from twinkle_async.auth import hash_key, same_secret
from twinkle_async.bus import TRANSIENT_ERRORS
from twinkle_async.gateway import console_session
from twinkle_async.gateway.state import CONSOLE_KIND, KEYS, SETTINGS, TENANT

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_OPEN_PATHS = frozenset({"/api/v1/healthz", "/healthz", "/metrics"})


def error_response(err: TwinkleError, openai: bool = False) -> web.Response:
    """The error's JSON answer; on the OpenAI routes (`openai`) it also carries OpenAI's
    `{"error": {"message", "type", "code"}}`, which OpenAI's clients read their message from."""
    body: dict[str, object] = {
        "detail": err.message,
        "category": err.category.value,
        "code": err.code,
    }
    if openai:
        kind = "invalid_request_error" if err.category is ErrorCategory.USER else "server_error"
        if err.status == 401:
            kind = "authentication_error"
        elif err.status == 429:
            kind = "rate_limit_error"
        body["error"] = {"message": err.message, "type": kind, "param": None, "code": err.code}
    return web.json_response(
        body, status=err.status, headers={"x-should-retry": "true" if err.retryable else "false"}
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    openai = request.path.startswith("/v1/")
    try:
        return await handler(request)
    except TwinkleError as err:
        if err.category is not ErrorCategory.USER:
            log.warning("%s %s failed: %s", request.method, request.path, err.message)
        return error_response(err, openai)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(PayloadTooLarge(f"request body too large: {exc.text}"), openai)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own answers (no route, wrong method) in the same JSON shape as ours
        reason = f"{request.method} {request.path[:100]}: {exc.reason}"
        return error_response(
            UserError(reason, code=exc.reason.lower().replace(" ", "_"), status=exc.status),
            openai,
        )
    except ConnectionResetError:
        # the client went away mid-request (its body half sent): nobody to answer, no fault
        log.info("%s %s: the client went away", request.method, request.path)
        return web.Response(status=499)
    except TRANSIENT_ERRORS as exc:
        log.warning("%s %s: the bus is away: %r", request.method, request.path, exc)
        return error_response(
            Unavailable(f"the job bus is unavailable ({type(exc).__name__})"), openai
        )
    except Exception:
        incident = uuid.uuid4().hex[:12]
        log.exception("%s %s crashed (incident %s)", request.method, request.path, incident)
        body = {
            "detail": f"internal server error (incident {incident})",
            "category": "server",
            "code": "internal",
        }
        return web.json_response(body, status=500, headers={"x-should-retry": "false"})


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`/api/` and `/v1/` (OpenAI's) need a tenant's API key (`X-API-Key` or a Bearer token);
    `/admin/` the admin key (`X-Admin-Key`). A web console session (`console_session`) stands
    for the key it was opened with where no key is sent; `/console/api/` takes only a session."""
    path = request.path
    if path in _OPEN_PATHS:
        return await handler(request)
    if path.startswith("/admin/"):
        admin_key = request.app[SETTINGS].admin_key
        if not admin_key:  # None, or an empty variable: never a key that "" would match
            raise Forbidden("the admin API is off: start the gateway with --admin-key")
        if "X-Admin-Key" not in request.headers and await _console_login(request) == "admin":
            return await handler(request)
        if not same_secret(request.headers.get("X-Admin-Key", ""), admin_key):
            raise Unauthorized("invalid or missing admin key (send it in X-Admin-Key)")
        return await handler(request)
    if path.startswith("/console/api/"):
        kind = await _console_login(request)
        if kind is None:
            raise Unauthorized("no console session: log in at /console")
        request[CONSOLE_KIND] = kind
        return await handler(request)
    if not path.startswith(("/api/", "/v1/")):
        return await handler(request)
    key = api_key(request.headers)
    if not key and await _console_login(request) == "tenant":
        return await handler(request)
    tenant = await request.app[KEYS].tenant_of(key)
    if tenant is None:
        raise Unauthorized("invalid, revoked or missing API key (send a tml-... key in X-API-Key)")
    request[TENANT] = tenant
    return await handler(request)


async def _console_login(request: web.Request) -> str | None:
    """The kind of console session the request carries ("tenant", with `TENANT` set, or
    "admin"), or None: no cookie, no matching CSRF token, lapsed, or its key no longer valid."""
    cookie = request.cookies.get(console_session.COOKIE, "")
    token = request.headers.get(console_session.CSRF_HEADER, "")
    secret = request.app[SETTINGS].download_secret
    if not cookie or not console_session.csrf_ok(secret, cookie, token):
        return None
    found = await console_identity(request, cookie)
    if found is None:
        return None
    kind, tenant = found
    if kind == "tenant":
        request[TENANT] = tenant
    return kind


async def console_identity(request: web.Request, cookie: str) -> tuple[str, str] | None:
    """Who a console session cookie stands for now: ("admin", "") or ("tenant", its tenant);
    None when it is malformed, lapsed, or its key was revoked (or the admin key changed)."""
    settings = request.app[SETTINGS]
    session = console_session.read(settings.download_secret, cookie)
    if session is None:
        return None
    if session.kind == "admin":
        admin_key = settings.admin_key
        ok = bool(admin_key) and session.key_hash == hash_key(admin_key or "")
        return ("admin", "") if ok else None
    tenant = await request.app[KEYS].tenant_of_hash(session.key_hash)
    return None if tenant is None else ("tenant", tenant)


def api_key(headers: Mapping[str, str]) -> str:
    """The tenant key a request carries: `X-API-Key`, else a Bearer token in `Authorization` or
    `Twinkle-Authorization` (as Twinkle's clients send it). Only one is read: the first present."""
    if "X-API-Key" in headers:
        return headers["X-API-Key"]
    for name in ("Authorization", "Twinkle-Authorization"):
        scheme, _, token = headers.get(name, "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return ""
