"""Fault isolation through the official SDK and a real cluster: two tenants submit their
optim_steps together so the worker can fuse them; one asks for a learning rate that overflows
float32. Its step fails alone as a user error and changes nothing of its adapter; the other's
step is bit-identical to the same run beside a well-behaved neighbour."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from tests.sdk_helpers import toy_batch

pytestmark = pytest.mark.e2e

SANE = types.AdamParams(learning_rate=1e-2)
OVERFLOWING = types.AdamParams(learning_rate=1e38)


def logprobs(client: tinker.TrainingClient, batch: list[types.Datum]) -> list[np.ndarray]:
    out = client.forward(batch, "cross_entropy").result()
    return [np.asarray(o["logprobs"].data, dtype=np.float32) for o in out.loss_fn_outputs]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        np.testing.assert_array_equal(left, right)


def test_an_overflowing_optim_step_fails_alone(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    batch_a, batch_b = toy_batch(n=3, seed=41), toy_batch(n=3, seed=42)
    runs = {}
    for name, b_adam in (("faulty", OVERFLOWING), ("reference", SANE)):
        a = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=41)
        b = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=42)
        client_a, client_b = a.result(), b.result()
        b_before = logprobs(client_b, batch_b)
        # Everything submitted before any result is read: one cycle fuses both steps.
        fwd_a = client_a.forward_backward(batch_a, "cross_entropy")
        fwd_b = client_b.forward_backward(batch_b, "cross_entropy")
        step_a = client_a.optim_step(SANE)
        step_b = client_b.optim_step(b_adam)
        fwd_a.result(), fwd_b.result()
        assert step_a.result().metrics is not None
        runs[name] = (client_a, client_b, b_before, step_b)

    faulty_a, faulty_b, b_before, failed_step = runs["faulty"]
    reference_a, reference_b, _, reference_step = runs["reference"]
    with pytest.raises(tinker.RequestFailedError) as err:
        failed_step.result()
    assert err.value.category == RequestErrorCategory.User
    assert "overflow float32" in str(err.value) and "learning_rate" in str(err.value)
    reference_step.result()

    assert_same(logprobs(faulty_a, batch_a), logprobs(reference_a, batch_a))
    assert_same(logprobs(faulty_b, batch_b), b_before)
    # B's pending gradient survived the failed step: retried sane, B catches up bit for bit.
    faulty_b.optim_step(SANE).result()
    assert_same(logprobs(faulty_b, batch_b), logprobs(reference_b, batch_b))
