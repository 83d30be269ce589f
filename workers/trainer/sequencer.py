"""Per-model ordering: ops are released strictly in `seq_id` order, whatever the arrival order.

The SDK posts the chunks of a large forward_backward concurrently (first chunk last) and
pipelines optim_step before results exist, so arrival order is not execution order. Creation
(create_model or create-via-load) is seq 0. An op at or below the applied seq is a duplicate
(a redelivery or a re-publish): the caller acks it and re-serves nothing, its result is in KV
already. A model waiting on a missing seq for a few seconds is reported by `gapped` (its op may
have been delivered to a connection that died with a NATS node: the caller has it delivered
again); one stuck for longer than the gap timeout has its buffered ops failed loudly rather
than hanging.

Pure bookkeeping: no I/O, no clocks of its own (callers pass `now`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from protocol.jobs import Job

H = TypeVar("H")  # the transport's message handle (acked after the outcome is written)


@dataclass
class Pending(Generic[H]):
    """A received op and the handle to ack once its outcome is stored.

    `stream_seq` is the op's position in the ops log (a snapshot records it); `replay` says how
    an op read back from the log while taking a model over is run (see `workers.trainer.recovery`; ""
    for an op delivered live).
    """

    job: Job
    handle: H
    received_at: float
    stream_seq: int = 0
    replay: str = ""


@dataclass
class ModelLine(Generic[H]):
    """One model's position: last applied seq and the ops waiting for their turn."""

    applied_seq: int = -1
    buffer: dict[int, Pending[H]] = field(default_factory=dict)
    stalled_since: float | None = None


class Sequencer(Generic[H]):
    """All models' lines on one worker."""

    def __init__(self) -> None:
        self.lines: dict[str, ModelLine[H]] = {}

    def offer(self, pending: Pending[H]) -> bool:
        """Buffer an op; False if it is a duplicate (already applied or already buffered)."""
        job = pending.job
        line = self.lines.setdefault(job.model_id, ModelLine())
        if job.seq_id <= line.applied_seq or job.seq_id in line.buffer:
            return False
        line.buffer[job.seq_id] = pending
        return True

    def ready(self) -> dict[str, list[Pending[H]]]:
        """For each model, the run of consecutive ops that can execute now, in order."""
        out: dict[str, list[Pending[H]]] = {}
        for model_id, line in self.lines.items():
            run: list[Pending[H]] = []
            seq = line.applied_seq + 1
            while seq in line.buffer:
                run.append(line.buffer[seq])
                seq += 1
            if run:
                out[model_id] = run
        return out

    def applied(self, job: Job) -> None:
        """Mark an op done (successfully or not): the next seq may run. A line dropped while
        its op ran (the shard moved: `forget`) has nothing left to move."""
        line = self.lines.get(job.model_id)
        if line is None:
            return
        line.buffer.pop(job.seq_id, None)
        line.applied_seq = max(line.applied_seq, job.seq_id)
        line.stalled_since = None

    def attach(self, job: Job, handle: H) -> bool:
        """Give a buffered op read back from the log the handle of its live copy, so the live
        message is acked only once the op has run (a crash before then redelivers it)."""
        line = self.lines.get(job.model_id)
        waiting = line.buffer.get(job.seq_id) if line is not None else None
        if waiting is None or waiting.handle is not None:
            return False
        waiting.handle = handle
        return True

    def holds(self, pending: Pending[H]) -> bool:
        """Whether this very op still waits in its model's line: False once the line was
        dropped (its shard moved to another worker), even if the model has a new line since."""
        line = self.lines.get(pending.job.model_id)
        return line is not None and line.buffer.get(pending.job.seq_id) is pending

    def known(self, model_id: str) -> bool:
        """Whether the model has a line here (it was created, or taken over, on this worker)."""
        return model_id in self.lines

    def start(self, model_id: str, applied_seq: int) -> None:
        """Open a model's line at `applied_seq` (its state was restored up to there)."""
        self.lines[model_id] = ModelLine(applied_seq=applied_seq)

    def pending(self, model_id: str) -> bool:
        """Whether any op of the model waits in its line."""
        line = self.lines.get(model_id)
        return line is not None and bool(line.buffer)

    def buffered(self, job: Job) -> bool:
        """Whether this op (same seq) is waiting in its model's line."""
        line = self.lines.get(job.model_id)
        return line is not None and job.seq_id in line.buffer

    def forget(self, model_id: str) -> list[Pending[H]]:
        """Drop a model's line (its shard moved to another worker); returns what was buffered."""
        line = self.lines.pop(model_id, None)
        return list(line.buffer.values()) if line else []

    def close(self, model_id: str) -> list[Pending[H]]:
        """End a model's line (unloaded) but keep its position, so a late copy of an op it
        already ran is a duplicate rather than a reason to take the model over again; returns
        what was still buffered."""
        line = self.lines.get(model_id)
        if line is None:
            return []
        stale = list(line.buffer.values())
        line.buffer.clear()
        line.stalled_since = None
        return stale

    def stalled(self, now: float, gap_timeout_s: float) -> dict[str, list[Pending[H]]]:
        """Models whose next seq has been missing for longer than `gap_timeout_s`.

        Their buffered ops are removed and returned, and the line skips past them, so that the
        caller fails them with an error naming the missing seq.
        """
        out: dict[str, list[Pending[H]]] = {}
        for model_id, line in self.lines.items():
            if not line.buffer or (line.applied_seq + 1) in line.buffer:
                line.stalled_since = None
                continue
            if line.stalled_since is None:
                line.stalled_since = min(p.received_at for p in line.buffer.values())
            if now - line.stalled_since >= gap_timeout_s:
                dropped = [line.buffer[s] for s in sorted(line.buffer)]
                line.applied_seq = max(line.buffer)
                line.buffer.clear()
                line.stalled_since = None
                out[model_id] = dropped
        return out

    def gapped(self, now: float, after_s: float) -> list[str]:
        """Models whose next seq has been missing for at least `after_s` (as `stalled` saw
        them: call it first), oldest gap first. Nothing is removed."""
        waiting = [
            (line.stalled_since, model_id)
            for model_id, line in self.lines.items()
            if line.stalled_since is not None and now - line.stalled_since >= after_s
        ]
        return [model_id for _, model_id in sorted(waiting)]

    def held(self) -> list[Any]:
        """Handles of every buffered op (to keep them from being redelivered while they wait);
        replayed ops have none."""
        return [
            p.handle
            for line in self.lines.values()
            for p in line.buffer.values()
            if p.handle is not None
        ]

    def missing_seq(self, model_id: str) -> int:
        return self.lines[model_id].applied_seq + 1 if model_id in self.lines else 0
