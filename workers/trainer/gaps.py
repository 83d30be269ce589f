"""Holes in a model's seq line, and ops that come after their model moved on.

Job: what the sequencer's waiting asks of the trainer service (`workers.trainer.service`):
- a model that waited `GAP_REDELIVER_S` for a seq has its shard's un-acked ops delivered again
  (`redeliver`): a delivery the server sent on a connection that died with its NATS node (or its
  consumer's leader) counts as delivered and comes back only after `ack_wait` (120 s); the
  gateway published it, so it is in the log. Once per shard every `GAP_REDELIVER_S`;
- a model that waited `gap_timeout_s` fails the ops it holds (`fail_stalled`): the seq before
  them was never published;
- an op at or below its model's applied seq is a redelivery, answered already, or one the line
  skipped past, which never ran and must not leave its future pending (`answer_late`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from protocol import subjects
from protocol.errors import ServerError
from protocol.jobs import Job, Outcome, decode_outcome
from workers.bus import WorkerBus
from workers.settings import WorkerSettings
from workers.trainer.operations import failed_outcome
from workers.trainer.sequencer import Pending, Sequencer

log = logging.getLogger(__name__)

# a model waiting this long for a seq has its shard's un-acked ops delivered again
GAP_REDELIVER_S = 5.0

Item = Pending[Any]


class Gaps:
    """Redelivery, the gap timeout and late ops of this worker's shards."""

    def __init__(
        self,
        bus: WorkerBus,
        settings: WorkerSettings,
        sequencer: Sequencer[Any],
        shard_tasks: dict[int, asyncio.Task[None]],
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.sequencer = sequencer
        self.shard_tasks = shard_tasks  # the shards consumed now (the service's own dict)
        self._redelivered: dict[int, float] = {}  # shard -> when its ops were last redelivered

    async def redeliver(self) -> None:
        """Have the shards of models that waited `GAP_REDELIVER_S` delivered again, in order;
        the copies of what is already buffered are duplicates (`Sequencer.offer`)."""
        now = time.monotonic()
        for model_id in self.sequencer.gapped(now, GAP_REDELIVER_S):
            shard = subjects.shard_of(model_id, self.settings.n_shards)
            if shard not in self.shard_tasks or now - self._redelivered.get(shard, -1e9) < (
                GAP_REDELIVER_S
            ):
                continue
            self._redelivered[shard] = now
            log.warning(
                "model %s: waiting %.0f s for a seq; shard %d's un-acked ops delivered again",
                model_id,
                GAP_REDELIVER_S,
                shard,
            )
            durable = subjects.consumer_name(self.settings.pool, shard)
            try:
                await self.bus.reset_consumer(subjects.STREAM_OPS, durable)
            except Exception:
                log.exception("shard %d: redelivery failed; trying again later", shard)

    async def fail_stalled(self, finish: Callable[[Item, Outcome], Awaitable[None]]) -> None:
        """Fail the ops of models that waited `gap_timeout_s` for a seq (`finish` stores each
        outcome and acks its op)."""
        timeout_s = self.settings.gap_timeout_s
        for model_id, items in self.sequencer.stalled(time.monotonic(), timeout_s).items():
            first = items[0].job.seq_id
            log.error(
                "model %s: seq before %d never arrived; failing %d ops", model_id, first, len(items)
            )
            for item in items:
                err = ServerError(
                    f"request seq_id {item.job.seq_id} of {model_id} waited {timeout_s:.0f} s"
                    " for an earlier request that never arrived; restore from your last"
                    " checkpoint"
                )
                await finish(item, failed_outcome(item.job, err))

    async def answer_late(self, job: Job, store: Callable[[Outcome], Awaitable[None]]) -> None:
        """An op at or below its model's applied seq: nothing for a redelivery whose result is
        stored (or that waits its turn), else a failed outcome."""
        data = await self.bus.get(subjects.BUCKET_FUTURES, subjects.future_key(job.request_id))
        if data is not None and decode_outcome(data).state != "pending":
            log.info("duplicate op %s seq %d of %s", job.request_id, job.seq_id, job.model_id)
            return
        if self.sequencer.buffered(job):
            return  # a redelivery of an op still waiting for its turn
        log.warning(
            "op %s seq %d of %s arrived after its model moved past it",
            job.request_id,
            job.seq_id,
            job.model_id,
        )
        err = ServerError(
            f"request seq_id {job.seq_id} of {job.model_id} arrived after the model's later"
            " requests had run, so it was not applied; restore from your last checkpoint"
        )
        await store(failed_outcome(job, err))
