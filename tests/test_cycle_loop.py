"""The worker's cycle loop on a bus that records every write: no NATS and no model.

What the loop does besides running cycles (snapshotting a model idle since its last change)
comes after the ops that woke it: a lone tenant's op never waits behind another model's write.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from protocol.jobs import ForwardBackwardJob, Job, OptimStepJob
from workers.metrics import TrainerMetrics
from workers.settings import WorkerSettings
from workers.trainer.operations import Result, done_outcome
from workers.trainer.sequencer import Pending
from workers.trainer.service import TrainerService


class RecordingBus:
    """The part of `WorkerBus` that the cycles use: KV writes, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str, bytes]] = []

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        self.writes.append((bucket, key, value))


async def test_an_op_that_wakes_the_loop_runs_before_an_idle_models_snapshot(
    tmp_path: Path,
) -> None:
    settings = WorkerSettings(base_model="stub", data_dir=tmp_path, worker_id="w-1")
    order: list[str] = []
    snapshotted = asyncio.Event()

    def shared_pass(jobs: list[Job]) -> list[Result]:
        order.extend(f"pass {job.model_id}" for job in jobs)
        return [(done_outcome(job, b"{}"), None) for job in jobs]

    # the parts of the operations that planning, a pass and the slot gauges use
    ops: Any = SimpleNamespace(
        model=SimpleNamespace(pass_tokens=16384, max_slots=8),
        residency=SimpleNamespace(slots_used=lambda: 0, parked={}, has=lambda model_id: True),
        metrics=TrainerMetrics(),
        store=None,
        failed={},
        shared_pass=shared_pass,
    )
    service = TrainerService(RecordingBus(), ops, settings)  # type: ignore[arg-type]

    async def take(item: Pending[Any], current: Any = None) -> None:
        order.append(f"snapshot {item.job.model_id}")
        service.snapshots.forget(item.job.model_id)
        snapshotted.set()

    service.snapshots.take = take  # type: ignore[method-assign]
    # a model changed long ago and idle since: due its idle snapshot
    idle_step = OptimStepJob(request_id="idle-step", model_id="m-idle", tenant_id="a", seq_id=1)
    idle_since = time.monotonic() - 10 * settings.snapshot_idle_s
    service.snapshots._unsnapped["m-idle"] = (
        Pending(job=idle_step, handle=None, received_at=0.0, stream_seq=3),
        idle_since,
    )
    service.sequencer.start("m-idle", applied_seq=1)
    service.sequencer.start("m-busy", applied_seq=0)
    fb = ForwardBackwardJob(request_id="busy-fb", model_id="m-busy", tenant_id="b", seq_id=1)
    service.sequencer.offer(Pending(job=fb, handle=None, received_at=0.0))
    service.leases.settled.set()
    service._wake.set()

    loop = asyncio.create_task(service._cycle_loop())
    try:
        async with asyncio.timeout(10):
            await snapshotted.wait()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    assert order == ["pass m-busy", "snapshot m-idle"]
