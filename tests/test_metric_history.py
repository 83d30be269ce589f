"""A run's metric history entries (`protocol.metric_history`): what each finished op keeps."""

from __future__ import annotations

import math

import numpy as np

from protocol import api, metric_history
from protocol.jobs import ForwardBackwardJob, OptimStepJob, Outcome, SaveWeightsJob
from protocol.tensors import encode_forward_backward_output

FIELDS = {"request_id": "req-1", "model_id": "run:train:0", "tenant_id": "t", "seq_id": 7}


def _done(payload: bytes, payload_type: str = "json") -> Outcome:
    return Outcome(
        request_id="req-1",
        state="done",
        payload=payload,
        payload_type=payload_type,  # type: ignore[arg-type]
        finished_at=123.5,
    )


def test_a_pass_and_a_step_keep_their_metrics_in_request_order() -> None:
    payload = encode_forward_backward_output(
        [{"logprobs": np.zeros(3, dtype=np.float32)}], {"loss:sum": 2.5, "bad:mean": math.nan}
    )
    entry = metric_history.entry_of(
        ForwardBackwardJob(**FIELDS, n_tokens=96), _done(payload, "proto")
    )
    assert entry is not None
    assert (entry.step, entry.kind, entry.time, entry.tokens) == (7, "forward_backward", 123.5, 96)
    assert entry.metrics == {"bad:mean": None, "loss:sum": 2.5}
    forward = metric_history.entry_of(
        ForwardBackwardJob(**FIELDS, forward_only=True, n_tokens=12), _done(payload, "proto")
    )
    assert forward is not None and (forward.kind, forward.tokens) == ("forward", 12)
    step = api.encode(api.OptimStepResponse(metrics={"learning_rate:mean": 1e-3}))
    stepped = metric_history.entry_of(OptimStepJob(**FIELDS), _done(step))
    assert stepped is not None and stepped.metrics == {"learning_rate:mean": 1e-3}
    assert stepped.tokens == 0
    assert metric_history.decode(metric_history.encode(stepped)) == stepped


def test_failed_ops_and_other_ops_keep_nothing_and_entries_are_bounded() -> None:
    failed = Outcome(request_id="req-1", state="error", error="boom")
    assert metric_history.entry_of(OptimStepJob(**FIELDS), failed) is None
    assert metric_history.entry_of(SaveWeightsJob(**FIELDS), _done(b"{}")) is None
    discarded = api.encode(api.OptimStepResponse(metrics={}))
    assert metric_history.entry_of(OptimStepJob(**FIELDS, discard=True), _done(discarded)) is None
    many = {f"m{i:03d}" + "x" * 500: float(i) for i in range(500)}
    step = api.encode(api.OptimStepResponse(metrics=many))
    entry = metric_history.entry_of(OptimStepJob(**FIELDS), _done(step))
    assert entry is not None and len(entry.metrics) == metric_history.MAX_METRICS
    assert all(len(name) <= metric_history.MAX_NAME for name in entry.metrics)
    assert len(metric_history.encode(entry)) < 8 * 1024  # the stream's largest message
