"""Custom losses in the trainer engine (fp32, CPU): a custom loss trains exactly like the built-in
loss it spells out, and one that raises or goes non-finite fails its own request alone, leaving
its slot bit-identical and every other tenant of the shared pass as it would be without it."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from protocol.errors import UserError
from protocol.sampling import MAX_LOGPROBS_K
from protocol.tensors import FwdBwdOutput, FwdBwdRequest
from tests.custom_loss_helpers import on_meta, scalar_chain, unchecked, upload
from tests.engine_helpers import (
    SPECS,
    Trainer,
    assert_same_bits,
    assert_same_output,
    count_passes,
    make_engine_fixture,  # noqa: F401  (the make_engine fixture)
    make_request,
    slot_state,
    train_round,
    with_tenants,
)
from workers.engine.custom_loss import BUDGET_FACTOR, MIN_NODE_COST, LossProgram
from workers.engine.isolation import isolate

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture
def make_tenants(make_engine: Callable[..., Trainer]) -> Callable[[], Trainer]:
    """Trainers holding the fault-isolation tenants (`tests.engine_helpers.SPECS`); "split"
    cuts passes at 9 token positions, so a request's datums land in several passes."""
    return lambda: with_tenants(make_engine(max_slots=3, max_rank=8))


def weighted_nll(logprobs, weights):  # type: ignore[no-untyped-def]
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/tokens:mean": torch.ones_like(weights).sum()}


def out_of_range(logprobs, weights):  # type: ignore[no-untyped-def]
    return -(logprobs[40] * weights[0]), {}


def not_finite(logprobs, weights):  # type: ignore[no-untyped-def]
    return torch.sqrt(logprobs).sum() + weights.sum(), {}


def as_custom(req: FwdBwdRequest, fn: Callable[..., Any]) -> FwdBwdRequest:
    loss = upload(fn, {"logprobs": 1, "weights": 1})
    return dataclasses.replace(
        req, loss_fn="custom", loss_fn_config={"loss_id": loss.loss_id}, custom_loss=loss
    )


def test_a_custom_loss_trains_like_the_builtin_it_spells_out(
    make_tenants: Callable[[], Trainer],
) -> None:
    custom_engine, builtin_engine = make_tenants(), make_tenants()
    rng = np.random.default_rng(4)
    builtin = make_request("a", [5, 3, 6], rng)
    other = make_request("b", [4], rng)
    [got, got_other] = custom_engine.forward_backward(
        [("a", as_custom(builtin, weighted_nll)), ("b", other)]
    )
    [want, want_other] = builtin_engine.forward_backward([("a", builtin), ("b", other)])

    assert isinstance(got, FwdBwdOutput) and isinstance(want, FwdBwdOutput)
    assert got.loss_fn_output_type == "CustomLossReturn"
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], abs=1e-5)
    assert got.metrics["custom/nll:sum"] == pytest.approx(want.metrics["loss:sum"], abs=1e-5)
    assert got.metrics["custom/tokens:mean"] == pytest.approx((5 + 3 + 6) / 3)
    for mine, theirs in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        assert set(mine) == {"logprobs"}
        np.testing.assert_allclose(mine["logprobs"], theirs["logprobs"], atol=1e-6)
    torch.testing.assert_close(
        custom_engine.bank.grads[custom_engine.slot("a")],
        builtin_engine.bank.grads[builtin_engine.slot("a")],
        rtol=0,
        atol=1e-6,
    )
    assert_same_output(got_other, want_other)


def test_a_custom_loss_with_recomputed_layers_trains_as_with_kept_ones(
    make_tenants: Callable[[], Trainer],
) -> None:
    """Decoder layers recomputed in the backward (`workers/engine/recompute.py`) under a custom
    loss's graph: its metrics, logprobs and the slot's gradient equal those of the pass that
    keeps its activations (≤ 1e-6), beside a built-in tenant's."""
    rng = np.random.default_rng(5)
    custom = as_custom(make_request("a", [7, 4], rng), weighted_nll)
    other = make_request("b", [6], rng)
    runs = []
    for recompute_tokens in (2**62, 0):
        engine = make_tenants()
        engine.core.passes.recompute_tokens = recompute_tokens
        runs.append((engine, engine.forward_backward([("a", custom), ("b", other)])))
    (kept, [kept_a, kept_b]), (again, [again_a, again_b]) = runs
    assert isinstance(kept_a, FwdBwdOutput) and isinstance(again_a, FwdBwdOutput)
    for name, value in kept_a.metrics.items():
        assert again_a.metrics[name] == pytest.approx(value, abs=1e-6), name
    for mine, theirs in zip(again_a.loss_fn_outputs, kept_a.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(mine["logprobs"], theirs["logprobs"], atol=1e-6)
    assert isinstance(kept_b, FwdBwdOutput) and isinstance(again_b, FwdBwdOutput)
    for model_id in ("a", "b"):
        torch.testing.assert_close(
            again.bank.grads[again.slot(model_id)],
            kept.bank.grads[kept.slot(model_id)],
            rtol=0,
            atol=1e-6,
        )


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (out_of_range, "node 'getitem' (operator.getitem) raised IndexError"),
        (not_finite, "the loss is not finite"),
    ],
    ids=["raises", "non-finite"],
)
def test_a_failing_custom_loss_fails_alone(
    make_tenants: Callable[[], Trainer], fn: Callable[..., Any], fragment: str
) -> None:
    faulty, reference = make_tenants(), make_tenants()
    for engine in (faulty, reference):
        train_round(engine, seed=5)  # pending gradients from an earlier pass, in both slots
    b_before = slot_state(faulty, "b")
    rng = np.random.default_rng(6)
    a_request = make_request("a", [5, 3], rng)
    b_request = as_custom(make_request("b", [4, 6], rng), fn)
    b_evaluation = make_request("b", [7], rng, forward_only=True)

    a_result, b_result, b_evaluated = faulty.forward_backward(
        [("a", a_request), ("b", b_request), ("b", b_evaluation)]
    )
    [a_solo] = reference.forward_backward([("a", a_request)])
    [b_evaluated_solo] = reference.forward_backward([("b", b_evaluation)])

    assert_same_output(a_result, a_solo)
    assert_same_bits(slot_state(faulty, "a"), slot_state(reference, "a"))
    assert isinstance(b_result, UserError) and b_result.category == "user"
    assert fragment in b_result.message, b_result.message
    assert_same_output(b_evaluated, b_evaluated_solo)
    assert_same_bits(slot_state(faulty, "b"), b_before)


def test_a_custom_request_must_carry_what_its_loss_reads(
    make_tenants: Callable[[], Trainer],
) -> None:
    engine = make_tenants()
    rng = np.random.default_rng(7)
    request = as_custom(make_request("a", [5], rng), weighted_nll)
    no_inputs = dataclasses.replace(
        request, datums=[dataclasses.replace(request.datums[0], inputs={})]
    )
    targets = {"target_tokens": request.datums[0].inputs["target_tokens"]}
    no_weights = dataclasses.replace(
        request, datums=[dataclasses.replace(request.datums[0], inputs=targets)]
    )
    wrong_rank = dataclasses.replace(
        request,
        datums=[
            dataclasses.replace(
                request.datums[0],
                inputs={**request.datums[0].inputs, "weights": np.zeros((5, 2), np.float32)},
            )
        ],
    )
    wide_k = MAX_LOGPROBS_K + 1  # [N, K] targets, K one too many, under a rank-2 loss
    rank_2 = upload(weighted_nll, {"logprobs": 2, "weights": 2})
    too_wide = dataclasses.replace(
        request,
        custom_loss=rank_2,
        loss_fn_config={"loss_id": rank_2.loss_id},
        datums=[
            dataclasses.replace(
                request.datums[0],
                inputs={
                    "target_tokens": np.zeros((5, wide_k), np.int64),
                    "weights": np.ones((5, wide_k), np.float32),
                },
            )
        ],
    )
    unresolved = dataclasses.replace(request, custom_loss=None)
    extra_setting = dataclasses.replace(
        request, loss_fn_config={**request.loss_fn_config, "beta": 0.1}
    )
    cases = [
        (no_inputs, "datums[0].loss_fn_inputs.target_tokens: missing"),
        (no_weights, "datums[0].loss_fn_inputs.weights: missing; loss 'weighted_nll' takes it"),
        (wrong_rank, "datums[0].loss_fn_inputs.weights: shape (5, 2)"),
        (too_wide, f"target_tokens: shape (5, {wide_k}); K must be in 1..{MAX_LOGPROBS_K}"),
        (unresolved, "loss_fn_config.loss_id"),
        (extra_setting, "takes only loss_id"),
    ]
    for bad, fragment in cases:
        with pytest.raises(UserError, match=re.escape(fragment)):
            engine.validate("a", bad)


def test_a_long_graph_over_many_datums_is_refused_before_it_runs(
    random_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2000 scalar nodes over 64 datums produce almost no elements but took 15 s of the shared
    engine (0.23 s a datum): node evaluations count against the budget, checked up front."""
    engine = Trainer(str(random_qwen3), max_slots=3, max_rank=8)
    engine.create("b", SPECS["b"])
    ran: list[object] = []
    monkeypatch.setattr(LossProgram, "_evaluate", lambda *args: ran.append(args))
    monkeypatch.setattr(engine.passes, "run", lambda *args: ran.append(args))
    request = as_custom(make_request("b", [3] * 64, np.random.default_rng(8)), scalar_chain)
    steps = len(LossProgram(request.custom_loss).steps)  # type: ignore[arg-type]
    limit = request.max_elements * BUDGET_FACTOR
    assert steps * 64 * MIN_NODE_COST > limit  # the default budget: 2 Ki nodes × 16 datums

    message = (
        f"64 datums × {steps} nodes cost at least {64 * steps * MIN_NODE_COST} of the"
        f" request's custom-loss budget of {limit} tensor elements"
    )
    with pytest.raises(UserError, match=re.escape(message)):
        engine.validate("b", request)
    with pytest.raises(UserError, match=re.escape(message)):
        engine.forward_backward([("b", request)])
    assert ran == []
    few = dataclasses.replace(request, datums=request.datums[: limit // (steps * MIN_NODE_COST)])
    engine.validate("b", few)  # a budget, not a ban


def test_a_loss_off_the_pass_device_fails_alone_in_one_pass(
    make_tenants: Callable[[], Trainer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss on meta used to reach the pass's stacking of losses, outside the per-datum guard:
    the whole pass raised and bisection re-ran it (four passes for three tenants)."""
    faulty, reference = make_tenants(), make_tenants()
    passes = count_passes(faulty, monkeypatch)
    rng = np.random.default_rng(9)
    a_request = make_request("a", [5, 3], rng)
    b_request = make_request("b", [4, 6], rng)
    loss = unchecked(on_meta, {"logprobs": 1, "weights": 1})
    b_request = dataclasses.replace(
        b_request, loss_fn="custom", loss_fn_config={"loss_id": loss.loss_id}, custom_loss=loss
    )
    c_request = make_request("c", [7], rng)
    batch = [("a", a_request), ("b", b_request), ("c", c_request)]

    a_result, b_result, c_result = isolate(
        faulty.forward_backward, batch, describe=lambda item: f"req-{item[0]}"
    )
    a_solo, c_solo = reference.forward_backward([("a", a_request), ("c", c_request)])

    assert passes == [3]
    assert isinstance(b_result, UserError), b_result
    assert "the loss is on device meta" in b_result.message, b_result.message
    assert_same_output(a_result, a_solo)
    assert_same_output(c_result, c_solo)
    for model_id in ("a", "c"):
        assert_same_bits(slot_state(faulty, model_id), slot_state(reference, model_id))
