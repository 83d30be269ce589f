"""An empty admin key turns the admin API off; it never opens it to callers sending no key.

(`TWINKLE_ADMIN_KEY=` in an environment file gives the gateway an empty string: compared as a
secret, it matched a request without the header.)
"""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from twinkle_async.gateway.middleware import auth_middleware, errors_middleware
from twinkle_async.gateway.state import SETTINGS
from twinkle_async.settings import GatewaySettings


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.mark.parametrize(("admin_key", "sent", "status"), [
    ("", None, 403), ("", "", 403), ("", "x", 403),
    (None, None, 403),
    ("twa-secret", None, 401), ("twa-secret", "", 401), ("twa-secret", "twa-secret", 200),
])  # fmt: skip
async def test_the_admin_api_needs_a_real_key(
    admin_key: str | None, sent: str | None, status: int
) -> None:
    app = web.Application(middlewares=[errors_middleware, auth_middleware])
    app[SETTINGS] = GatewaySettings(admin_key=admin_key)
    app.router.add_get("/admin/v1/tenants", _ok)
    headers = {} if sent is None else {"X-Admin-Key": sent}
    async with TestClient(TestServer(app)) as client:
        answer = await client.get("/admin/v1/tenants", headers=headers)
        assert answer.status == status, await answer.text()
