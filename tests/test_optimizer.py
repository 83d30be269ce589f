"""SlotAdamW on hostile states: slots whose step is sure to stay finite skip the copy and the
checks, and that must never let a NaN or inf in, nor change what any slot's step is."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocol.api import AdamParams
from protocol.errors import UserError
from workers.engine import optimizer as optimizer_module
from workers.engine.optimizer import SlotAdamW, _bounded

P = 64  # values per slot


def hostile_row(rng: np.random.Generator, *, non_negative: bool = False) -> torch.Tensor:
    """A row whose scale is drawn from 1e-40 to 1e38, sometimes zero, sometimes with a NaN
    or an inf in it."""
    scale = 10.0 ** rng.uniform(-40, 38)
    row = rng.standard_normal(P) * scale
    kind = rng.integers(0, 8)
    if kind == 0:
        row[:] = 0.0
    elif kind == 1:
        row[rng.integers(0, P)] = rng.choice([np.nan, np.inf, -np.inf])
    if non_negative:
        row = np.abs(row)
        if rng.integers(0, 6) == 0:
            row[rng.integers(0, P)] = -1.0  # a second moment AdamW never writes
    with np.errstate(over="ignore", invalid="ignore"):
        return torch.from_numpy(row.astype(np.float32))


def hostile_spec(rng: np.random.Generator) -> AdamParams:
    return AdamParams(
        learning_rate=float(10.0 ** rng.uniform(-8, 36)),
        beta1=float(rng.choice([0.0, 0.9, 1 - 1e-9, rng.uniform(0, 1)])),
        beta2=float(rng.choice([0.0, 0.95, 0.999, 1 - 1e-9, rng.uniform(0, 1)])),
        eps=float(10.0 ** rng.uniform(-60, 2)),
        weight_decay=float(rng.choice([0.0, 0.01, 10.0 ** rng.uniform(-4, 30)])),
        grad_clip_norm=float(rng.choice([0.0, 0.0, 1.0, 10.0 ** rng.uniform(-10, 30)])),
    )


def snapshot(opt: SlotAdamW, slot: int) -> dict[str, torch.Tensor | int]:
    return {
        "weights": opt.weights[slot].clone(),
        "grads": opt.grads[slot].clone(),
        "exp_avg": opt.exp_avg[slot].clone(),
        "exp_avg_sq": opt.exp_avg_sq[slot].clone(),
        "step": opt.steps[slot],
    }


def same_bits(a: dict[str, torch.Tensor | int], b: dict[str, torch.Tensor | int]) -> bool:
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor)
            if not torch.equal(value.view(torch.int32), other.view(torch.int32)):
                return False
        elif value != other:
            return False
    return True


def build(rng: np.random.Generator, slots: int) -> SlotAdamW:
    weights = torch.stack([hostile_row(rng) for _ in range(slots)])
    grads = torch.stack([hostile_row(rng) for _ in range(slots)])
    opt = SlotAdamW(weights, grads)
    opt.exp_avg.copy_(torch.stack([hostile_row(rng) for _ in range(slots)]))
    opt.exp_avg_sq.copy_(torch.stack([hostile_row(rng, non_negative=True) for _ in range(slots)]))
    opt.steps = [int(rng.integers(0, 5)) for _ in range(slots)]
    return opt


def solo_guarded(opt: SlotAdamW, slot: int, spec: AdamParams) -> tuple[object, dict]:
    """The slot stepped alone, every check on (no slot trusted to stay finite)."""
    alone = SlotAdamW(opt.weights[slot : slot + 1].clone(), opt.grads[slot : slot + 1].clone())
    alone.exp_avg.copy_(opt.exp_avg[slot : slot + 1])
    alone.exp_avg_sq.copy_(opt.exp_avg_sq[slot : slot + 1])
    alone.steps = [opt.steps[slot]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimizer_module, "_bounded", lambda *args: [False] * len(args[0]))
        (result,) = alone.step([0], [spec])
    return result, snapshot(alone, 0)


@pytest.mark.parametrize("seed", range(12))
def test_hostile_slots_step_exactly_as_guarded_solo_steps_and_never_hold_nan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    slots = 16
    opt = build(rng, slots)
    specs = [hostile_spec(rng) for _ in range(slots)]
    stepping = [s for s in range(slots) if rng.integers(0, 4)]  # the others must not change
    before = {s: snapshot(opt, s) for s in range(slots)}
    wants = {s: solo_guarded(opt, s, specs[s]) for s in stepping}
    results = opt.step(stepping, [specs[s] for s in stepping])
    for slot, result in zip(stepping, results, strict=True):
        want_result, want_state = wants[slot]
        assert type(result) is type(want_result), (slot, result, want_result)
        assert same_bits(snapshot(opt, slot), want_state), (slot, specs[slot])
        if isinstance(result, UserError):
            assert same_bits(snapshot(opt, slot), before[slot])
        else:
            assert result == want_result
            for name in ("weights", "exp_avg", "exp_avg_sq"):
                assert bool(getattr(opt, name)[slot].isfinite().all()), (slot, name)
    for slot in set(range(slots)) - set(stepping):
        assert same_bits(snapshot(opt, slot), before[slot])


def test_ordinary_training_states_are_bounded_and_hostile_ones_are_not() -> None:
    rng = np.random.default_rng(0)
    ordinary = AdamParams(learning_rate=1e-4, weight_decay=0.01)
    row = torch.from_numpy(rng.standard_normal(P).astype(np.float32))
    zeros = torch.zeros(P)

    def bounded(w, m, v, g, spec, coef=None) -> bool:  # type: ignore[no-untyped-def]
        scalars = optimizer_module._Scalars.of(spec, 1)
        return _bounded([w], [m], [v], [g], [coef], [scalars])[0]

    assert bounded(row, row * 1e-3, row.abs() * 1e-6, row, ordinary)
    assert bounded(zeros, zeros, zeros, zeros, ordinary)  # rank padding: 0 / (0 + eps)
    assert not bounded(row, row, row.abs(), row * math.inf, ordinary)
    assert not bounded(row, row, row.abs(), row * 1e25, ordinary)  # its square overflows
    assert not bounded(zeros, zeros, zeros, zeros, AdamParams(eps=1e-50))  # eps rounds to 0
    assert not bounded(row, row, -row.abs(), row, ordinary)  # a negative second moment
    assert not bounded(row, row, row.abs(), row, AdamParams(learning_rate=1e30))
