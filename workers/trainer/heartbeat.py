"""The trainer worker's heartbeat: its record in KV `tw_workers`, its usage, its slot gauges.

Job: every `heartbeat_s`, write this worker's `WorkerRecord` (pool, model sizes, slots, sampler,
metrics URL, image geometry) and flush the usage it recorded per tenant; read the pool's live
trainers for the leases (`workers.trainer.leases`). A failed write is logged and tried again at
the next beat: the leases, not the heartbeat, decide who owns a shard.
"""

from __future__ import annotations

import asyncio
import logging
import time

from protocol import records, subjects
from protocol.records import WorkerRecord
from workers.bus import WorkerBus
from workers.settings import WorkerSettings
from workers.trainer.operations import TrainerOps
from workers.usage import UsageBook

log = logging.getLogger(__name__)


class Heartbeat:
    """This worker's record, usage and slot gauges; see the module docstring."""

    def __init__(
        self,
        bus: WorkerBus,
        settings: WorkerSettings,
        ops: TrainerOps,
        usage: UsageBook,
        metrics_url: str,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.ops = ops
        self.usage = usage
        self.metrics_url = metrics_url  # reported in the record

    async def run(self) -> None:
        while True:
            model = self.ops.model
            record = WorkerRecord(
                worker_id=self.settings.worker_id,
                pool=self.settings.pool,
                base_model=self.settings.base_model,
                arch=model.arch,
                vocab_size=model.vocab_size,
                max_context=model.max_context,
                max_rank=self.settings.max_rank,
                slots_total=model.max_slots,
                slots_used=self.ops.residency.slots_used(),
                heartbeat_at=time.time(),
                sampler_backend=self.settings.sampler,
                metrics_url=self.metrics_url,
                vision=model.geometry,
                refused=self.ops.residency.refused(),
                max_train_tokens=model.token_plan.train_tokens,
                max_sample_tokens=model.token_plan.sample_tokens,
            )
            self.update_gauges()
            key = subjects.worker_key(self.settings.pool, self.settings.worker_id)
            try:
                await self.bus.put(subjects.BUCKET_WORKERS, key, records.encode(record))
                await self.usage.flush(self.bus.put)
            except Exception:
                log.exception("worker heartbeat failed")
            await asyncio.sleep(self.settings.heartbeat_s)

    def update_gauges(self) -> None:
        """The slot gauges: training adapters resident and parked, of how many slots."""
        self.ops.metrics.set_slots(
            used=self.ops.residency.slots_used(),
            parked=len(self.ops.residency.parked),
            total=self.ops.model.max_slots,
        )

    async def live_workers(self) -> dict[str, float]:
        """The pool's trainers with a fresh heartbeat, and when it was."""
        fresh = time.time() - 3 * self.settings.heartbeat_s
        live = {}
        for value in await self.bus.values(subjects.BUCKET_WORKERS, self.settings.pool):
            record = records.decode(value, WorkerRecord)
            if record.role == "trainer" and record.heartbeat_at >= fresh:
                live[record.worker_id] = record.heartbeat_at
        return live
