"""Taking a model over: restore its latest snapshot, then queue its logged ops for replay.

A worker that meets an op of a model it has no line for (its shard was just gained: the
previous owner died or handed it over) calls `take_over` before offering that op. What the
snapshot, the log and the replay modes are is `workers.trainer.recovery`'s; this module puts
them together:

Step 1: read the model's snapshot record; restore its state into the engine (on the engine
        thread). A snapshot that cannot be restored is dropped, with what was half-adopted,
        and the model is rebuilt from its log alone.
Step 2: read the model's ops after the snapshot from the log, each with its replay mode; a
        settled op becomes a tombstone, an unload whose checkpoint exists saves nothing again.
Step 3: find a hole before the first logged op. A hole that changed nothing is skipped; one
        that lost ops the client saw succeed fails the model (its ops fail at once, saying so).
Step 4: offer the logged ops to the sequencer, which runs them in seq order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from protocol.jobs import TombstoneJob, UnloadModelJob, request_type_of
from workers.trainer.parking import SlotState
from workers.trainer.recovery import ModelLog
from workers.trainer.sequencer import Pending, Sequencer
from workers.trainer.snapshots import Snapshots

log = logging.getLogger(__name__)

Item = Pending[Any]


async def take_over(
    model_id: str,
    *,
    log_reader: ModelLog,
    sequencer: Sequencer[Any],
    snapshots: Snapshots,
    adopt: Callable[[str, SlotState], Awaitable[None]],
    release: Callable[[str], Awaitable[None]],
    failed: dict[str, str],
) -> int:
    """Steps 1-4 for `model_id`; how many logged ops the sequencer took. A model that cannot
    be recovered is entered in `failed` with the reason its requests answer."""
    started = time.perf_counter()
    snapshot = await log_reader.snapshot(model_id)
    after = 0
    if snapshot is not None:
        try:
            state = await asyncio.to_thread(snapshots.read, snapshot)
            await adopt(model_id, state)
        except Exception:
            log.exception("model %s: its snapshot cannot be restored; replaying its log", model_id)
            snapshot = None
            await release(model_id)  # nothing half-adopted stays: the replay starts from creation
        else:
            sequencer.start(model_id, applied_seq=snapshot.applied_seq)
            after = snapshot.stream_seq
    if snapshot is None:
        sequencer.start(model_id, applied_seq=-1)
    logged: list[Item] = []
    async for job, stream_seq in log_reader.ops_after(model_id, after):
        mode = await log_reader.mode(job)
        if mode == "skip":
            job = TombstoneJob(
                request_id=job.request_id,
                model_id=job.model_id,
                tenant_id=job.tenant_id,
                seq_id=job.seq_id,
                request_type=request_type_of(job),
            )
        elif mode == "quiet" and isinstance(job, UnloadModelJob):
            job = msgspec.structs.replace(job, save_as="")  # its checkpoint exists
        logged.append(
            Pending(
                job=job,
                handle=None,
                received_at=time.monotonic(),
                stream_seq=stream_seq,
                replay=mode,
            )
        )
    first_seq = min((item.job.seq_id for item in logged), default=0)
    expected = 0 if snapshot is None else snapshot.applied_seq + 1
    # A hole the log's limits made (one before the first op ever logged, with no snapshot,
    # is one too); other holes are ops never published, which the sequencer fails alone.
    hole = first_seq > expected and (
        snapshot is None or await log_reader.trimmed_after(snapshot.stream_seq)
    )
    if (
        hole
        and snapshot is not None
        and not await log_reader.changed_between(model_id, expected, first_seq)
    ):
        # What the log lost past the snapshot changed nothing (sampler saves, forward-only
        # passes, refused calls): the snapshot is the state before `first_seq`.
        sequencer.start(model_id, applied_seq=first_seq - 1)
    elif hole:
        # The log no longer reaches back to the model's creation or to its snapshot: ops
        # the client saw succeed are gone with it. Its ops fail at once, saying so.
        failed[model_id] = (
            "could not be recovered after its worker stopped (its ops log no longer reaches"
            " back to its last snapshot)"
        )
        sequencer.start(model_id, applied_seq=first_seq - 1)
        log.error(
            "model %s cannot be recovered: it needs its logged ops from seq %d (%s),"
            " the log starts at seq %d (ops_max_bytes / ops_max_age_s dropped the rest)",
            model_id,
            expected,
            "it has no snapshot" if snapshot is None else "after its snapshot",
            first_seq,
        )
    replayed = sum(sequencer.offer(item) for item in logged)
    log.info(
        "took model %s over: snapshot at seq %s, %d logged ops to replay (%.0f ms)",
        model_id,
        snapshot.applied_seq if snapshot else "none",
        replayed,
        (time.perf_counter() - started) * 1e3,
    )
    return replayed
