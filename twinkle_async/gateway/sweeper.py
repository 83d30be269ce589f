"""The TTL sweeper: deletes every checkpoint past its `expires_at`, record and files.

A background task owned by the app's `cleanup_ctx` (started after the bus, cancelled before
it closes): one pass every `GatewaySettings.checkpoint_sweep_s` (60 s by default, None: off).
A pass that fails is logged and the next one runs, so the task never dies quietly. Several
gateways may sweep the same store: deleting is idempotent. `expired` is the pure core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from protocol.errors import TwinkleError
from protocol.records import CheckpointRecord
from twinkle_async.gateway.checkpoint_files import remove_checkpoint
from twinkle_async.gateway.state import ARTIFACTS, REGISTRY, SETTINGS
from twinkle_async.gateway.store_files import StoreFiles
from twinkle_async.registry import Registry

log = logging.getLogger(__name__)


def expired(ckpts: list[CheckpointRecord], now: float) -> list[CheckpointRecord]:
    """The checkpoints whose time to live is over at `now`."""
    return [c for c in ckpts if c.expires_at is not None and c.expires_at <= now]


async def sweep_once(
    registry: Registry, root: Path | None, store: StoreFiles | None, now: float
) -> int:
    """Delete what has expired; returns how many checkpoints went."""
    removed = 0
    for ckpt in expired(await registry.all_checkpoints(), now):
        try:
            await remove_checkpoint(registry, root, store, ckpt)
        except (TwinkleError, OSError):
            # one broken record or directory must not keep the others alive
            log.exception("sweeper: could not delete expired checkpoint %s", ckpt.path)
            continue
        removed += 1
    return removed


async def _sweep_forever(app: web.Application, interval_s: float) -> None:
    settings = app[SETTINGS]
    while True:
        await asyncio.sleep(interval_s)
        try:
            removed = await sweep_once(
                app[REGISTRY], settings.checkpoint_root, app[ARTIFACTS], time.time()
            )
        except Exception:
            log.exception("checkpoint sweep failed; retrying in %.0f s", interval_s)
            continue
        if removed:
            log.info("sweeper: deleted %d expired checkpoint(s)", removed)


async def sweeper_ctx(app: web.Application) -> AsyncIterator[None]:
    """Run the sweeper for the app's lifetime (nothing when `checkpoint_sweep_s` is None)."""
    interval_s = app[SETTINGS].checkpoint_sweep_s
    task = None
    if interval_s:
        task = asyncio.create_task(_sweep_forever(app, interval_s), name="checkpoint-sweeper")
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
