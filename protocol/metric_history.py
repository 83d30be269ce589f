"""A training run's metric history: one entry for each finished `forward_backward`, `forward`
and `optim_step` of the run, with the metrics its answer carried (`loss:sum` and the rest, or
the step's gradient norm and learning rate), and the tokens a pass ran (what the run's usage
per day is summed from, `gateway/usage_views.py`).

The worker that finished the request publishes the entry to the `TW_METRICS` stream under the
run's subject (`subjects.metrics_subject`), with the request id as its message id, so an op
replayed on another worker is written once. The stream keeps at most
`topology.MetricsStreamSpec.max_per_run` entries a run (the oldest go first), each at most
`MAX_METRICS` metrics; it is stored on disk, so the history outlives any gateway or worker.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from protocol import api
from protocol import tinker_wire_pb2 as pb
from protocol.jobs import ForwardBackwardJob, Job, OptimStepJob, Outcome

MAX_METRICS = 64  # an entry's metrics, the first in name order
MAX_NAME = 64  # characters of a metric's name (64 of them fit one 8 KiB message)

Kind = Literal["forward_backward", "forward", "optim_step"]


class MetricEntry(msgspec.Struct, frozen=True):
    """One request's metrics: `step` is its seq_id in the run (the order the client sent it),
    `time` when it finished (Unix seconds); a metric that is not a finite number is null.
    `tokens`: the tokens of a `forward_backward` or `forward` (0 for an `optim_step`, and for
    an entry written before it was kept)."""

    step: int
    kind: Kind
    time: float
    metrics: dict[str, float | None]
    request_id: str = ""
    tokens: int = 0


def entry_of(job: Job, outcome: Outcome) -> MetricEntry | None:
    """The entry of a finished op, or None for an op that keeps none (or failed)."""
    if outcome.state != "done":
        return None
    metrics: dict[str, float]
    kind: Kind
    tokens = 0
    if isinstance(job, ForwardBackwardJob):
        kind = "forward" if job.forward_only else "forward_backward"
        metrics = dict(pb.ForwardBackwardOutput.FromString(outcome.payload).metrics)
        tokens = job.n_tokens
    elif isinstance(job, OptimStepJob) and not job.discard:  # a discard is no step
        kind = "optim_step"
        metrics = dict(api.decode(outcome.payload, api.OptimStepResponse).metrics or {})
    else:
        return None
    kept = {
        str(name)[:MAX_NAME]: (float(value) if math.isfinite(float(value)) else None)
        for name, value in sorted(metrics.items())[:MAX_METRICS]
    }
    return MetricEntry(
        step=job.seq_id,
        kind=kind,
        time=outcome.finished_at,
        metrics=kept,
        request_id=job.request_id,
        tokens=tokens,
    )


def encode(entry: MetricEntry) -> bytes:
    return msgspec.json.encode(entry)


def decode(data: bytes) -> MetricEntry:
    return msgspec.json.decode(data, type=MetricEntry)
