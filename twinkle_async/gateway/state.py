"""Typed application state (`web.AppKey`s) shared by the handlers."""

from __future__ import annotations

from aiohttp import web

from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.registry import Registry
from twinkle_async.settings import GatewaySettings

SETTINGS = web.AppKey("settings", GatewaySettings)
BUS = web.AppKey("bus", Bus)
FUTURES = web.AppKey("futures", FutureStore)
REGISTRY = web.AppKey("registry", Registry)
TENANT = "tenant_id"  # request-scoped key set by the auth middleware
