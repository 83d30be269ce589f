"""What the gateway's periodic and per-request registry reads cost as the history grows.

Starts a nats-server on loopback, stores `--sessions` finished sessions and `--runs` runs with
one checkpoint each across `--tenants` tenants, plus a few live sessions and one small tenant,
then times, median of `--repeats`:

- the session expiry sweep's read: every session record (the old sweep) vs the sessions marked
  open (`Registry.open_sessions`);
- the small tenant's storage-quota read: every checkpoint record (the old `tenant_checkpoints`)
  vs the tenant's own (`Registry.tenant_checkpoints`).

    OMP_NUM_THREADS=1 .venv/bin/python bench/registry_reads.py [--sessions 20000] [--runs 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from protocol import records, subjects
from protocol.api import LoraConfig
from protocol.records import CheckpointRecord, RunRecord, SessionRecord
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsServer
from twinkle_async.registry import Registry
from twinkle_async.settings import BusSettings

LIVE_SESSIONS = 20


async def median_s(call: Callable[[], Awaitable[Any]], repeats: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        size = len(await call())
        times.append(time.perf_counter() - started)
    return statistics.median(times), size


async def put_all(bus: Bus, bucket: str, items: list[tuple[str, bytes]]) -> None:
    """Pipelined writes, 2000 at a time (records and index keys as the registry writes them)."""
    assert bus.js is not None
    for start in range(0, len(items), 2000):
        batch = items[start : start + 2000]
        await asyncio.gather(*(bus.js.publish(f"$KV.{bucket}.{k}", v) for k, v in batch))


def session_items(session: SessionRecord) -> list[tuple[str, bytes]]:
    items = [
        (subjects.tenant_index_key(session.tenant_id, session.session_id), b"1"),
        (subjects.token(session.session_id), records.encode(session)),
    ]
    if not session.finished:
        items.append((subjects.open_session_key(session.session_id), repr(time.time()).encode()))
    return items


def run_items(tenant_id: str, model_id: str) -> tuple[list[tuple[str, bytes]], tuple[str, bytes]]:
    run = RunRecord(
        model_id=model_id,
        tenant_id=tenant_id,
        session_id="sess",
        base_model="base",
        lora=LoraConfig(),
        created_at=0.0,
        last_request_time=0.0,
    )
    ckpt = CheckpointRecord(
        run_id=model_id,
        tenant_id=tenant_id,
        checkpoint_id="weights/w",
        kind="weights",
        path=f"tinker://{model_id}/weights/w",
        directory="/nowhere",
        created_at=0.0,
        size_bytes=1,
        base_model="base",
        lora=LoraConfig(),
    )
    runs = [
        (subjects.tenant_index_key(tenant_id, model_id), b"1"),
        (subjects.token(model_id), records.encode(run)),
    ]
    return runs, (subjects.checkpoint_key(model_id, ckpt.checkpoint_id), records.encode(ckpt))


async def main(args: argparse.Namespace) -> None:
    server = NatsServer(Path(tempfile.mkdtemp(prefix="registry-reads-")))
    bus = Bus(BusSettings(nats_url=server.start()))
    await bus.connect()
    try:
        registry = Registry(bus)
        now = time.time()
        sessions = [
            SessionRecord(
                session_id=f"sess-{n:07d}",
                tenant_id=f"tenant-{n % args.tenants}",
                created_at=now,
                last_heartbeat=now,
                finished=n >= LIVE_SESSIONS,
            )
            for n in range(args.sessions + LIVE_SESSIONS)
        ]
        await put_all(
            bus, subjects.BUCKET_SESSIONS, [i for s in sessions for i in session_items(s)]
        )
        run_keys: list[tuple[str, bytes]] = []
        ckpt_keys: list[tuple[str, bytes]] = []
        owners = [(f"tenant-{n % args.tenants}", f"run-{n:07d}") for n in range(args.runs)]
        owners += [("small", f"small-run-{n}") for n in range(3)]
        for tenant_id, model_id in owners:
            runs, ckpt = run_items(tenant_id, model_id)
            run_keys += runs
            ckpt_keys.append(ckpt)
        await put_all(bus, subjects.BUCKET_RUNS, run_keys)
        await put_all(bus, subjects.BUCKET_CHECKPOINTS, ckpt_keys)

        print(f"{args.sessions} finished + {LIVE_SESSIONS} live sessions, {len(owners)} runs with")
        print(f"a checkpoint each, {args.tenants} tenants; median of {args.repeats} (seconds)")
        every, n = await median_s(lambda: registry.sessions(None), args.repeats)
        opened, m = await median_s(lambda: registry.open_sessions(time.time(), 120), args.repeats)
        print(
            f"expiry sweep read:   every session {every:7.3f} ({n})   open ones {opened:7.3f} ({m})"
        )
        every, n = await median_s(registry.all_checkpoints, args.repeats)
        own, m = await median_s(lambda: registry.tenant_checkpoints("small"), args.repeats)
        print(
            f"storage-quota read:  every checkpoint {every:7.3f} ({n})   the tenant's {own:7.3f} ({m})"
        )
    finally:
        await bus.close()
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5_000)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
