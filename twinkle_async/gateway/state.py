"""Typed application state (`web.AppKey`s) shared by the handlers."""

from __future__ import annotations

from aiohttp import web

from twinkle_async.auth import KeyRing
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.gateway.store_files import StoreFiles
from twinkle_async.lifecycle import Lifecycle
from twinkle_async.quotas import InFlight, Quotas
from twinkle_async.registry import Registry
from twinkle_async.settings import GatewaySettings

SETTINGS = web.AppKey("settings", GatewaySettings)
BUS = web.AppKey("bus", Bus)
FUTURES = web.AppKey("futures", FutureStore)
REGISTRY = web.AppKey("registry", Registry)
KEYS = web.AppKey("keys", KeyRing)
QUOTAS = web.AppKey("quotas", Quotas)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
SAMPLES = web.AppKey("samples", InFlight)
# the artifact store of checkpoints saved there (None: no `--artifact-store`)
ARTIFACTS = web.AppKey[StoreFiles | None]("artifacts")
TENANT = web.RequestKey("tenant_id", str)  # set by the auth middleware
CONSOLE_KIND = web.RequestKey("console_kind", str)  # "tenant" or "admin", on /console/api/
