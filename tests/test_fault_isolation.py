"""Fault isolation in the trainer engine (fp32, CPU): a tenant whose step or loss goes non-finite
fails alone with a user error, its slot stays bit-identical to before the call, and every other
tenant of the same fused step or shared pass gets bit-identically what it gets without it.

Each test runs a faulty engine beside a reference engine in which the culprit behaves, and compares
whole slot rows bit for bit (NaN and the sign of zero included).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.api import AdamParams, LoraConfig
from protocol.errors import UserError
from protocol.tensors import FwdBwdOutput, FwdBwdRequest
from tests.test_engine import make_request, perturb_b
from workers.engine import Engine

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)
CLIPPED = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.5)
SPECS = {"a": LoraConfig(rank=4, seed=1), "b": LoraConfig(rank=8, seed=2, train_mlp=False)}


@pytest.fixture
def make_engine(random_qwen3: Path) -> Callable[[], Engine]:
    """An engine holding tenants "a" and "b" with non-zero B matrices (so A gets gradient)."""

    def make() -> Engine:
        engine = Engine(str(random_qwen3), max_slots=3, max_rank=8)
        for index, (model_id, spec) in enumerate(SPECS.items()):
            engine.create(model_id, spec)
            perturb_b(engine, model_id, seed=10 + index)
        return engine

    return make


def slot_state(engine: Engine, model_id: str) -> dict[str, torch.Tensor | int]:
    """Copies of everything a tenant's slot holds: whole rows, padding included."""
    slot = engine.slot(model_id)
    return {
        "weights": engine.bank.weights[slot].clone(),
        "grads": engine.bank.grads[slot].clone(),
        "exp_avg": engine.optimizer.exp_avg[slot].clone(),
        "exp_avg_sq": engine.optimizer.exp_avg_sq[slot].clone(),
        "step": engine.optimizer.steps[slot],
    }


def assert_same_bits(a: dict[str, torch.Tensor | int], b: dict[str, torch.Tensor | int]) -> None:
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor)
            assert torch.equal(value.view(torch.int32), other.view(torch.int32)), key
        else:
            assert value == other, key


def requests(seed: int) -> list[tuple[str, FwdBwdRequest]]:
    rng = np.random.default_rng(seed)
    return [("a", make_request("a", [5, 3], rng)), ("b", make_request("b", [4, 6], rng))]


def train_round(engine: Engine, seed: int) -> None:
    results = engine.forward_backward(requests(seed))
    assert all(isinstance(result, FwdBwdOutput) for result in results)


# -- the fused optimizer step -------------------------------------------------------------------


@pytest.mark.parametrize("a_adam", [ADAM, CLIPPED], ids=["plain", "clipped"])
def test_overflowing_learning_rate_fails_alone(
    make_engine: Callable[[], Engine], a_adam: AdamParams
) -> None:
    faulty, reference = make_engine(), make_engine()
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
    make_engine: Callable[[], Engine], poison: float, adam: AdamParams, fragment: str
) -> None:
    faulty, reference = make_engine(), make_engine()
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
