"""The gateway application: route table, middleware, and resource lifecycles.

`build_app(settings)` is all a test or `main()` needs; `run_gateway` serves it on uvloop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from twinkle_async.auth import KeyRing
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.gateway import (
    account_routes,
    admin_routes,
    admin_store_routes,
    admin_transfer_routes,
    checkpoint_routes,
    console_routes,
    custom_loss_routes,
    download_routes,
    futures_routes,
    metrics_routes,
    model_routes,
    openai_routes,
    processor_routes,
    rest_routes,
    sampling_futures_routes,
    sampling_routes,
    service_routes,
    training_routes,
    twinkle_routes,
    twinkle_sampler_routes,
    unknown_routes,
    usage_routes,
)
from twinkle_async.gateway.completions import SessionCompletions
from twinkle_async.gateway.metrics_routes import METRICS, metrics_middleware
from twinkle_async.gateway.middleware import auth_middleware, errors_middleware
from twinkle_async.gateway.sampling_futures_routes import COMPLETIONS
from twinkle_async.gateway.state import (
    ARTIFACTS,
    BUS,
    FUTURES,
    KEYS,
    LIFECYCLE,
    QUOTAS,
    REGISTRY,
    SAMPLES,
    SETTINGS,
)
from twinkle_async.gateway.store_files import StoreFiles
from twinkle_async.gateway.sweeper import sweeper_ctx
from twinkle_async.lifecycle import Lifecycle
from twinkle_async.metrics import GatewayMetrics
from twinkle_async.quotas import InFlight, Quotas
from twinkle_async.registry import Registry
from twinkle_async.settings import GatewaySettings

log = logging.getLogger(__name__)


async def _bus_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    bus = Bus(settings.bus)
    await bus.connect()
    futures = FutureStore(bus, app[METRICS])
    completions = SessionCompletions()
    futures.on_finished.append(completions.record)
    await futures.start()

    async def missed_completions() -> None:  # the subscription missed what NATS carried meanwhile
        completions.mark_incomplete()

    bus.on_reconnect(missed_completions)
    app[COMPLETIONS] = completions
    registry = Registry(bus, settings.base_models)
    await registry.start()
    keys = KeyRing(bus, settings.api_keys)
    await keys.start()
    app[BUS], app[FUTURES], app[REGISTRY], app[KEYS] = bus, futures, registry, keys
    quotas = Quotas(
        bus,
        settings.quota_defaults,
        max_queue_s=settings.max_rate_queue_s,
        burst_s=settings.rate_burst_s,
    )
    app[QUOTAS], app[SAMPLES] = quotas, InFlight(bus, quotas)
    lifecycle = Lifecycle(
        registry,
        futures,
        bus,
        session_timeout_s=settings.session_timeout_s,
        sweep_interval_s=settings.sweep_interval_s,
    )
    await lifecycle.start()
    app[LIFECYCLE] = lifecycle
    yield
    await lifecycle.stop()
    completions.close()
    await keys.stop()
    await registry.stop()
    await futures.stop()
    await bus.close()


def build_app(settings: GatewaySettings) -> web.Application:
    app = web.Application(
        # metrics first: it times the whole request and sees the status errors were mapped to
        middlewares=[metrics_middleware, errors_middleware, auth_middleware],
        client_max_size=settings.max_request_bytes,
    )
    app[SETTINGS] = settings
    app[ARTIFACTS] = (
        StoreFiles(settings.artifact_store, settings.artifact_public_url)
        if settings.artifact_store
        else None
    )
    app[METRICS] = GatewayMetrics()  # a registry per app: apps in one process never collide
    app.cleanup_ctx.append(_bus_ctx)
    app.cleanup_ctx.append(sweeper_ctx)  # after the bus: it sweeps through the registry
    app.cleanup_ctx.append(account_routes.ledger_ctx)  # after the bus: it watches usage keys
    app.cleanup_ctx.append(processor_routes.processor_ctx)
    app.cleanup_ctx.append(console_routes.console_ctx)  # after the bus: it hears outcomes
    for module in (
        service_routes,
        training_routes,
        custom_loss_routes,
        sampling_routes,
        sampling_futures_routes,
        futures_routes,
        rest_routes,
        account_routes,
        model_routes,
        checkpoint_routes,
        download_routes,
        admin_routes,
        admin_store_routes,
        admin_transfer_routes,
        metrics_routes,
        twinkle_routes,
        twinkle_sampler_routes,
        openai_routes,
        processor_routes,
        console_routes,
        usage_routes,
        unknown_routes,  # last: the paths nothing else matched
    ):
        app.add_routes(module.routes)
    return app


async def serve(settings: GatewaySettings, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until cancelled; `on_ready` gets the base URL (port 0 picks a free port).

    `auto_decompress=False`: zstd request bodies are decoded by the handler, within limits.
    """
    runner = web.AppRunner(build_app(settings), auto_decompress=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = settings.port
    server = site._server  # the bound asyncio server: the only place the chosen port is known
    sockets = getattr(server, "sockets", None)
    if sockets:
        port = int(sockets[0].getsockname()[1])
    base_url = f"http://{settings.host}:{port}"
    log.info("gateway listening on %s", base_url)
    # What start-up built lives as long as the process: frozen out of the collector's sight,
    # a full collection no longer walks it (a pause in whichever request it fell into).
    gc.collect()
    gc.freeze()
    if on_ready is not None:
        on_ready(base_url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
