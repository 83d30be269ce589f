"""Fault isolation in the trainer engine (fp32, CPU): a tenant whose step or loss goes non-finite
fails alone with a user error, its slot stays bit-identical to before the call, and every other
tenant of the same fused step or shared pass gets bit-identically what it gets without it.

Each test runs a faulty engine beside a reference engine in which the culprit behaves, and compares
whole slot rows bit for bit (NaN and the sign of zero included).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from protocol.api import AdamParams
from protocol.errors import ServerError, UserError
from protocol.tensors import FwdBwdOutput, FwdBwdRequest
from tests.engine_helpers import (
    Trainer,
    assert_same_bits,
    assert_same_output,
    explode_with,
    make_engine_fixture,  # noqa: F401  (the make_engine fixture)
    make_request,
    requests,
    slot_state,
    train_round,
    with_tenants,
)
from workers.engine.isolation import isolate

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)
CLIPPED = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.5)


@pytest.fixture
def make_tenants(make_engine: Callable[..., Trainer]) -> Callable[[], Trainer]:
    """Trainers holding the three tenants of `tests.engine_helpers.SPECS`, non-zero B matrices;
    "split" passes hold at most 9 token positions, so a failing request's datums can land in
    several passes and its slot's other requests must run again without it."""
    return lambda: with_tenants(make_engine(max_slots=3, max_rank=8))


# -- the fused optimizer step -------------------------------------------------------------------


@pytest.mark.parametrize("a_adam", [ADAM, CLIPPED], ids=["plain", "clipped"])
def test_overflowing_learning_rate_fails_alone(
    make_tenants: Callable[[], Trainer], a_adam: AdamParams
) -> None:
    faulty, reference = make_tenants(), make_tenants()
    for engine in (faulty, reference):
        train_round(engine, seed=1)
        engine.optim_step([("a", a_adam), ("b", ADAM)])
        train_round(engine, seed=2)
    b_before = slot_state(faulty, "b")

    a_result, b_result = faulty.optim_step(
        [("a", a_adam), ("b", AdamParams(learning_rate=1e38, grad_clip_norm=1.0))]
    )
    reference_a, reference_b = reference.optim_step([("a", a_adam), ("b", ADAM)])

    assert a_result == reference_a and isinstance(a_result, dict)
    assert_same_bits(slot_state(faulty, "a"), slot_state(reference, "a"))
    assert isinstance(b_result, UserError) and b_result.category == "user"
    assert "overflow float32" in b_result.message and "learning_rate" in b_result.message
    assert_same_bits(slot_state(faulty, "b"), b_before)
    # Nothing of B's was lost: retried with a sane rate, it takes the step the reference's B took.
    assert faulty.optim_step([("b", ADAM)]) == [reference_b]
    assert_same_bits(slot_state(faulty, "b"), slot_state(reference, "b"))


@pytest.mark.parametrize(
    ("poison", "adam", "fragment"),
    [
        (float("nan"), ADAM, "gradient is not finite"),
        (float("inf"), CLIPPED, "gradient is not finite (its L2 norm is inf)"),
        (1e25, ADAM, "update is not finite"),  # finite, but its square overflows exp_avg_sq
    ],
    ids=["nan-gradient", "inf-gradient-clipped", "overflowing-update"],
)
def test_non_finite_gradient_or_update_fails_alone(
    make_tenants: Callable[[], Trainer], poison: float, adam: AdamParams, fragment: str
) -> None:
    faulty, reference = make_tenants(), make_tenants()
    for engine in (faulty, reference):
        train_round(engine, seed=3)
        engine.optim_step([("a", CLIPPED), ("b", ADAM)])
        train_round(engine, seed=4)
    faulty.bank.grads[faulty.slot("b"), 7] = poison
    b_before = slot_state(faulty, "b")

    a_result, b_result = faulty.optim_step([("a", CLIPPED), ("b", adam)])
    reference_a, _ = reference.optim_step([("a", CLIPPED), ("b", adam)])

    assert a_result == reference_a and isinstance(a_result, dict)
    assert_same_bits(slot_state(faulty, "a"), slot_state(reference, "a"))
    assert isinstance(b_result, UserError) and fragment in b_result.message
    assert_same_bits(slot_state(faulty, "b"), b_before)


# -- the shared pass ----------------------------------------------------------------------------


def poisoned(request: FwdBwdRequest, scale: float, alternate: bool) -> FwdBwdRequest:
    """`request` with every loss weight at `scale` (signs alternating if `alternate`): finite
    inputs whose loss (1e38) or, with the signs cancelling in the loss, gradient (2.5e37)
    overflows float32."""
    for datum in request.datums:
        weights = np.full(datum.inputs["weights"].shape, scale, dtype=np.float32)
        if alternate:
            weights[1::2] *= -1
        datum.inputs["weights"] = weights
    return request


@pytest.mark.parametrize(
    ("scale", "alternate", "fragment"),
    [(1e38, False, "the loss is not finite"), (2.5e37, True, "the gradient is not finite")],
    ids=["overflowing-loss", "overflowing-gradient"],
)
def test_overflowing_item_fails_alone_in_a_shared_pass(
    make_tenants: Callable[[], Trainer], scale: float, alternate: bool, fragment: str
) -> None:
    faulty, reference = make_tenants(), make_tenants()
    for engine in (faulty, reference):
        train_round(engine, seed=5)  # pending gradients from an earlier pass, in both slots
    b_before = slot_state(faulty, "b")
    rng = np.random.default_rng(6)
    a_request = make_request("a", [5, 3], rng)
    b_request = poisoned(make_request("b", [4, 6], rng), scale, alternate)
    b_evaluation = make_request("b", [7], rng, forward_only=True)

    a_result, b_result, b_evaluated = faulty.forward_backward(
        [("a", a_request), ("b", b_request), ("b", b_evaluation)]
    )
    [a_solo] = reference.forward_backward([("a", a_request)])
    [b_evaluated_solo] = reference.forward_backward([("b", b_evaluation)])

    assert_same_output(a_result, a_solo)
    assert_same_bits(slot_state(faulty, "a"), slot_state(reference, "a"))
    assert isinstance(b_result, UserError) and b_result.category == "user"
    assert fragment in b_result.message and "weights" in b_result.message
    assert_same_output(b_evaluated, b_evaluated_solo)  # B's own evaluation still answers
    assert_same_bits(slot_state(faulty, "b"), b_before)


def test_a_pass_that_raises_changes_no_gradient(
    make_tenants: Callable[[], Trainer], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_tenants()
    train_round(engine, seed=7)  # pending gradients in every slot, to be protected
    before = engine.bank.grads.clone()
    explode_with(engine, "b", monkeypatch)

    with pytest.raises(RuntimeError, match="injected fault"):
        engine.forward_backward(requests(seed=8))
    assert torch.equal(engine.bank.grads.view(torch.int32), before.view(torch.int32))


def test_bisection_fails_only_the_culprit_of_a_raising_pass(
    make_tenants: Callable[[], Trainer], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, reference = make_tenants(), make_tenants()
    for each in (engine, reference):
        train_round(each, seed=9)
    b_before = slot_state(engine, "b")
    explode_with(engine, "b", monkeypatch)
    batch = requests(seed=10)

    a_result, b_result, c_result = isolate(
        engine.forward_backward, batch, describe=lambda item: f"req-{item[0]}"
    )
    a_expected, c_expected = reference.forward_backward([item for item in batch if item[0] != "b"])

    assert_same_output(a_result, a_expected)
    assert_same_output(c_result, c_expected)
    assert isinstance(b_result, ServerError) and "req-b" in b_result.message
    for model_id in ("a", "c"):
        assert_same_bits(slot_state(engine, model_id), slot_state(reference, model_id))
    assert_same_bits(slot_state(engine, "b"), b_before)


def test_a_request_failing_after_part_of_it_ran_leaves_its_slot_clean(
    make_tenants: Callable[[], Trainer],
) -> None:
    """A's first request overflows in its second datum only, after its first datum's gradient
    is in (in "split", that datum ran in an earlier pass). A's slot gets its copy back and A's
    healthy request runs again, so A ends with exactly the healthy request's gradient."""
    faulty, reference = make_tenants(), make_tenants()
    for engine in (faulty, reference):
        train_round(engine, seed=9)
    rng = np.random.default_rng(10)
    sick = make_request("a", [6, 4], rng)
    sick.datums[1].inputs["weights"] = np.full(4, 1e38, dtype=np.float32)
    healthy = make_request("a", [5, 3], rng)
    b_request = make_request("b", [4], rng)

    sick_result, healthy_result, b_result = faulty.forward_backward(
        [("a", sick), ("a", healthy), ("b", b_request)]
    )
    healthy_want, b_want = reference.forward_backward([("a", healthy), ("b", b_request)])

    assert isinstance(sick_result, UserError) and "loss is not finite" in sick_result.message
    for got, want in ((healthy_result, healthy_want), (b_result, b_want)):
        assert isinstance(got, FwdBwdOutput) and isinstance(want, FwdBwdOutput)
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
        for left, right in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(left["logprobs"], right["logprobs"], atol=1e-5)
    for model_id in ("a", "b"):
        got_grads = faulty.bank.grads[faulty.slot(model_id)]
        want_grads = reference.bank.grads[reference.slot(model_id)]
        assert (got_grads - want_grads).abs().max() <= 1e-5, model_id


def test_finite_gradients_whose_sum_overflows_are_not_failed(
    make_tenants: Callable[[], Trainer],
) -> None:
    """The pass's finiteness check sums each row first; a row of finite values whose sum
    overflows float32 is checked value by value and kept."""
    engine = make_tenants()
    slot = engine.slot("b")
    engine.bank.grads[slot, 3] = 3e38
    engine.bank.grads[slot, 5] = 3e38  # finite values, an infinite sum
    rng = np.random.default_rng(11)
    [result] = engine.forward_backward([("b", make_request("b", [4], rng))])
    assert isinstance(result, FwdBwdOutput)
    assert float(engine.bank.grads[slot, 3]) == pytest.approx(3e38, rel=1e-6)


@pytest.mark.parametrize("scratch_bytes", [1, 2**28], ids=["one-slot-groups", "one-group"])
def test_a_clipping_slot_whose_update_overflows_gets_every_row_back(
    make_tenants: Callable[[], Trainer], scratch_bytes: int
) -> None:
    """B clips (so its gradient is scaled in place) and its first moment is near float32's
    limit, so its new weights overflow: B's rows, its pending gradient included, come back bit
    for bit, and A (stepping in the same or another group) takes its solo step."""
    faulty, reference = make_tenants(), make_tenants()
    for engine in (faulty, reference):
        engine.optimizer.scratch_bytes = scratch_bytes
        train_round(engine, seed=12)
    faulty.optimizer.exp_avg[faulty.slot("b"), 9] = 3e38
    b_before = slot_state(faulty, "b")

    a_result, b_result = faulty.optim_step([("a", ADAM), ("b", CLIPPED)])
    [reference_a] = reference.optim_step([("a", ADAM)])

    assert a_result == reference_a
    assert_same_bits(slot_state(faulty, "a"), slot_state(reference, "a"))
    assert isinstance(b_result, UserError) and "update is not finite" in b_result.message
    assert_same_bits(slot_state(faulty, "b"), b_before)
