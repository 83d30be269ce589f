"""Taking a model over: its latest state snapshot, then its logged ops after it, replayed.

A worker that gains a shard (its owner died, or handed it over) meets models it has no state
for. Before the first op of such a model runs, the worker restores the model's latest snapshot
(`workers.trainer.snapshots`, pointer in KV `tw_runs`, `snap.<model>`), or starts from nothing when
there is none, and reads the model's ops after the snapshot straight from the `TW_OPS` log
(one message-get per op, by subject: no consumer is created). Each logged op is replayed in its
`seq_id` order through the ordinary cycle, in one of three modes, chosen by the outcome already
stored for it:

- `publish`: no final outcome yet (it never finished): run it and store its outcome;
- `quiet`: a final `done` outcome of an op that changes state (create, load, a training
  forward_backward, optim_step, unload): run it to rebuild the state, store nothing (the client
  has its result);
- `skip`: a final outcome of an op that changed nothing (an error: refused, invalid, or failed
  as a transaction; a forward-only pass; a save, which only wrote files): settle it, run nothing.

Where recovery is impossible (the log no longer reaches back to the snapshot, or a load's
checkpoint is gone), the replayed op fails and its model's next ops fail with it, clearly. The
log reaches back no further than its limits keep it: with no snapshot, its ops must start at
the model's creation (seq 0); with one, right after the snapshot's seq, unless the first ops
missing were never logged (a gateway that stopped between taking a seq and publishing: a gap
the sequencer fails on its own), which is told apart by the log having been trimmed past the
snapshot. Replaying on top of a hole would silently leave out a step the client saw succeed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Literal

import msgspec
from nats.js.errors import NotFoundError

from protocol import records, subjects
from protocol.jobs import (
    CreateModelJob,
    ForwardBackwardJob,
    Job,
    LoadWeightsJob,
    OptimStepJob,
    UnloadModelJob,
    decode_claim,
    decode_job,
    decode_outcome,
)
from protocol.records import SnapshotRecord
from workers.bus import WorkerBus

log = logging.getLogger(__name__)

Replay = Literal["", "publish", "quiet", "skip"]  # "": a live op from the shard consumer

# Requests that never change a model's adapter or optimizer state (`changes_state`).
_CHANGES_NOTHING = frozenset(
    {"forward", "save_weights", "save_weights_for_sampler", "save_weights_external", "tombstone"}
)
_CLAIMS_PER_READ = 256
_MAX_CLAIMS_READ = 100_000  # a hole wider than this is taken as lost without reading it


def changes_state(job: Job) -> bool:
    """Whether running the op changes the model's adapter or optimizer state."""
    if isinstance(job, ForwardBackwardJob):
        return not job.forward_only
    return isinstance(job, CreateModelJob | LoadWeightsJob | OptimStepJob | UnloadModelJob)


def replay_mode(job: Job, outcome_state: str | None) -> Replay:
    """How a logged op is replayed, from the state of its stored outcome (None: none stored)."""
    if outcome_state in (None, "pending"):
        return "publish"
    if outcome_state == "done" and changes_state(job):
        return "quiet"
    return "skip"


class ModelLog:
    """Reads a model's snapshot pointer and its logged ops."""

    def __init__(self, bus: WorkerBus, pool: str, n_shards: int) -> None:
        self.bus = bus
        self.pool = pool
        self.n_shards = n_shards

    async def snapshot(self, model_id: str) -> SnapshotRecord | None:
        data = await self.bus.get(subjects.BUCKET_RUNS, subjects.snapshot_key(model_id))
        return records.decode(data, SnapshotRecord) if data else None

    async def trimmed_after(self, stream_seq: int) -> bool:
        """Whether the log's limits (`ops_max_bytes`, `ops_max_age_s`: any tenant's traffic
        counts) dropped messages past `stream_seq`: the log no longer starts right after it."""
        js = self.bus.js
        assert js is not None

        async def first_seq() -> int:
            info = await js.stream_info(subjects.STREAM_OPS)
            return info.state.first_seq if info.state is not None else 0

        return await self.bus.retried(f"read {subjects.STREAM_OPS}", first_seq) > stream_seq + 1

    async def changed_between(self, model_id: str, start: int, end: int) -> bool:
        """Whether an op of seq `start` .. `end - 1`, gone from the log, may have changed the
        model's state. Each seq's claim (`tw_futures`, kept as long as futures) names its
        request: a sampler save, a forward-only pass or a refused call changed nothing, and
        neither did an op that failed (a failed op is a transaction). A seq whose claim or
        outcome is gone may have: so may any other."""
        if end - start > _MAX_CLAIMS_READ:
            return True
        for low in range(start, end, _CLAIMS_PER_READ):
            seqs = range(low, min(end, low + _CLAIMS_PER_READ))
            claims = await asyncio.gather(
                *(
                    self.bus.get(subjects.BUCKET_FUTURES, subjects.seq_key(model_id, s))
                    for s in seqs
                )
            )
            for data in claims:
                if data is None:
                    return True
                claim = decode_claim(data)
                if claim.request_type in _CHANGES_NOTHING:
                    continue
                outcome = await self.bus.get(
                    subjects.BUCKET_FUTURES, subjects.future_key(claim.request_id)
                )
                if outcome is None or decode_outcome(outcome).state != "error":
                    return True
        return False

    async def ops_after(self, model_id: str, stream_seq: int) -> AsyncIterator[tuple[Job, int]]:
        """The model's logged ops after `stream_seq`, in log order, with their positions."""
        assert self.bus.js is not None
        subject = subjects.ops_subject(self.pool, model_id, self.n_shards)
        position = stream_seq + 1
        while True:
            try:
                msg = await self.bus.js.get_msg(
                    subjects.STREAM_OPS, seq=position, subject=subject, next=True
                )
            except NotFoundError:
                return
            if msg.data is None or msg.seq is None:
                return
            position = msg.seq + 1
            try:
                job = decode_job(msg.data)
            except msgspec.DecodeError:
                # Its live delivery was dropped the same way (`TrainerService._on_msg`); raising
                # here would stop every worker that takes the model over.
                log.error(
                    "model %s: skipping the undecodable op at %d of the log", model_id, msg.seq
                )
                continue
            yield job, msg.seq

    async def mode(self, job: Job) -> Replay:
        data = await self.bus.get(subjects.BUCKET_FUTURES, subjects.future_key(job.request_id))
        return replay_mode(job, decode_outcome(data).state if data else None)
