"""`protocol.twinkle_schedule` against torch 2.13 and the real twinkle-kit 0.5.1.

Torch's schedulers run here; twinkle's classes (its schedulers, `do_grad_sync`, the param groups
`set_optimizer` builds) run in twinkle's own virtualenv (`.venv-sdk/twinkle-0.5.1`), in a
subprocess that prints JSON (`make install` builds that virtualenv).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.errors import UserError
from protocol.twinkle_schedule import (
    check_accumulation_steps,
    check_optimizer,
    check_scheduler,
    grad_sync,
    learning_rate,
)

ROOT = Path(__file__).resolve().parent.parent
TWINKLE_PYTHON = ROOT / ".venv-sdk" / "twinkle-0.5.1" / "bin" / "python"
STEPS = 30

TORCH_CASES: list[tuple[str, dict[str, Any], float]] = [
    ("LinearLR", {}, 1e-3),
    ("LinearLR", {"start_factor": 0.1, "end_factor": 0.5, "total_iters": 10}, 2e-4),
    ("LinearLR", {"start_factor": 1.0, "end_factor": 0.0, "total_iters": 7}, 3e-5),
    ("LinearLR", {"start_factor": 0.5, "total_iters": 0}, 1e-4),
    ("ConstantLR", {}, 1e-3),
    ("ConstantLR", {"factor": 0.5, "total_iters": 3}, 2e-4),
    ("ConstantLR", {"factor": 0.25, "total_iters": 0}, 2e-4),
    ("StepLR", {"step_size": 3}, 1e-3),
    ("StepLR", {"step_size": 1, "gamma": 0.5}, 5e-4),
    ("StepLR", {"step_size": 4, "gamma": 0.0}, 5e-4),
    ("ExponentialLR", {"gamma": 0.9}, 1e-3),
    ("ExponentialLR", {"gamma": 1.0}, 1e-4),
    ("CosineAnnealingLR", {"T_max": 10}, 1e-3),
    ("CosineAnnealingLR", {"T_max": 7, "eta_min": 1e-5}, 2e-4),
    ("CosineAnnealingLR", {"T_max": 1}, 1e-4),
    ("CosineAnnealingLR", {"T_max": 30, "eta_min": 2e-4}, 1e-4),
]
TWINKLE_CASES: list[tuple[str, dict[str, Any], float]] = [
    ("CosineWarmupScheduler", {"num_warmup_steps": 5, "num_training_steps": 25}, 1e-4),
    (
        "CosineWarmupScheduler",
        {"num_warmup_steps": 0, "num_training_steps": 10, "num_cycles": 1.5},
        2e-4,
    ),
    ("CosineWarmupScheduler", {"num_warmup_steps": 10, "num_training_steps": 5}, 1e-3),
    ("LinearWarmupScheduler", {"num_warmup_steps": 3, "num_training_steps": 20}, 1e-4),
    ("LinearWarmupScheduler", {"num_warmup_steps": 0, "num_training_steps": 0}, 1e-4),
]
OPTIMIZER_CASES: list[tuple[str, dict[str, Any]]] = [
    ("AdamW", {}),
    ("AdamW", {"lr": 2e-4}),
    (
        "AdamW",
        {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "foreach": False},
    ),
    ("Adam", {"lr": 1e-4, "weight_decay": 0}),
    ("Adam", {"lr": 1e-4, "weight_decay": 0.05, "decoupled_weight_decay": True}),
    ("Adam", {"lr": 1e-4}),  # the article's call: twinkle's weight decay 0.01, coupled (L2)
]

# Runs in twinkle's virtualenv: reads the cases as JSON on stdin, prints what twinkle does.
TWINKLE_SCRIPT = """
import inspect, json, sys, types, torch
from twinkle.model.optimizer_group import BaseOptimizerGroup
from twinkle.model.transformers import transformers as tf
from twinkle.module import scheduler as ts
cases = json.load(sys.stdin)
def sync(gas, cur):
    return BaseOptimizerGroup(gradient_accumulation_steps=gas, cur_step=cur).do_grad_sync()
def lrs(cls, kwargs, base):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched, out = getattr(ts, cls)(opt, **kwargs), []
    for _ in range(cases["steps"] + 1):
        out.append(opt.param_groups[0]["lr"]); opt.step(); sched.step()
    return out
def group(cls, kwargs):  # the param group set_optimizer gives a LoRA weight
    lora = torch.nn.Module(); lora.lora_A = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)})
    fake = types.SimpleNamespace(model=lora, strategy=object(), optimizer_group={"a": types.SimpleNamespace()})
    fake._get_default_group, fake._ensure_optimizer_dp_groups = lambda: "a", lambda: None
    fake._get_trainable_parameters = lambda name: {"lora_A.a.weight": lora.lora_A["a"].weight}
    fake._create_param_group = lambda *a, **k: tf.TransformersModel._create_param_group(fake, *a, **k)
    tf.TransformersModel.set_optimizer(fake, cls, **kwargs)
    g = fake.optimizer_group["a"].optimizer.param_groups[0]
    return {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")}
def defaults(cls):
    ps = list(inspect.signature(getattr(ts, cls)).parameters.values())[1:-1]
    return {p.name: None if p.default is p.empty else p.default for p in ps}
print(json.dumps({
    "sync": {gas: [sync(gas, c) for c in range(1, 21)] for gas in range(1, 5)},
    "lrs": [lrs(*case) for case in cases["schedulers"]],
    "groups": [group(*case) for case in cases["optimizers"]],
    "defaults": {c: defaults(c) for c in ("CosineWarmupScheduler", "LinearWarmupScheduler")},
    "constants": [tf.DEFAULT_LEARNING_RATE, tf.DEFAULT_WEIGHT_DECAY],
}))
"""


@pytest.fixture(scope="module")
def twinkle() -> dict[str, Any]:
    assert TWINKLE_PYTHON.exists(), f"{TWINKLE_PYTHON} is missing: `make install` builds it"
    cases = {"steps": STEPS, "schedulers": TWINKLE_CASES, "optimizers": OPTIMIZER_CASES}
    done = subprocess.run(
        [str(TWINKLE_PYTHON), "-c", TWINKLE_SCRIPT],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def reference_grad_sync(cur_step: int, gradient_accumulation_steps: int) -> bool:
    """twinkle 0.5.1 `BaseOptimizerGroup.do_grad_sync`, as written there."""
    return gradient_accumulation_steps == 1 or (
        (cur_step - 1) % gradient_accumulation_steps == 0 and cur_step > 1
    )


def test_grad_sync_is_twinkles_rule() -> None:
    for gas in range(1, 5):
        ours = [grad_sync(cur, gas) for cur in range(1, 21)]
        assert ours == [reference_grad_sync(cur, gas) for cur in range(1, 21)]
    assert [cur for cur in range(1, 12) if grad_sync(cur, 2)] == [3, 5, 7, 9, 11]
    assert [cur for cur in range(1, 12) if grad_sync(cur, 3)] == [4, 7, 10]
    assert all(grad_sync(cur, 1) for cur in range(1, 12))


def test_grad_sync_is_real_twinkles(twinkle: dict[str, Any]) -> None:
    for gas in range(1, 5):
        assert [grad_sync(cur, gas) for cur in range(1, 21)] == twinkle["sync"][str(gas)]


@pytest.mark.parametrize("value", [1, 7, 1_000_000])
def test_accumulation_steps_accepted(value: int) -> None:
    assert check_accumulation_steps(value) == value


@pytest.mark.parametrize("value", [0, -1, 1_000_001, True, 2.0, "2", None, math.nan, [2]])
def test_accumulation_steps_refused(value: object) -> None:
    with pytest.raises(UserError, match="gradient_accumulation_steps"):
        check_accumulation_steps(value)


def torch_lrs(cls: str, kwargs: dict[str, Any], base_lr: float) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=base_lr)
    scheduler = getattr(torch.optim.lr_scheduler, cls)(optimizer, **kwargs)
    out = []
    for _ in range(STEPS + 1):
        out.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return out


def assert_lrs(cls: str, kwargs: dict[str, Any], base_lr: float, expected: list[float]) -> None:
    scheduler = check_scheduler(cls, kwargs)
    ours = [learning_rate(scheduler, base_lr, k) for k in range(STEPS + 1)]
    assert ours == pytest.approx(expected, rel=1e-6, abs=base_lr * 1e-12)


@pytest.mark.parametrize(("cls", "kwargs", "base_lr"), TORCH_CASES)
def test_torch_schedulers(cls: str, kwargs: dict[str, Any], base_lr: float) -> None:
    assert_lrs(cls, kwargs, base_lr, torch_lrs(cls, kwargs, base_lr))


def test_twinkle_schedulers(twinkle: dict[str, Any]) -> None:
    for (cls, kwargs, base_lr), expected in zip(TWINKLE_CASES, twinkle["lrs"], strict=True):
        assert_lrs(cls, kwargs, base_lr, expected)
        scheduler = check_scheduler(cls, kwargs)  # LambdaLR: no chaining, so exact
        assert [learning_rate(scheduler, base_lr, k) for k in range(STEPS + 1)] == expected


def test_no_scheduler_and_late_steps() -> None:
    assert learning_rate(None, 3e-4, 10**6) == 3e-4
    linear = check_scheduler("LinearLR", {"start_factor": 0.5, "total_iters": 10})
    assert learning_rate(linear, 1e-4, 10**9) == pytest.approx(1e-4)
    cosine = check_scheduler("CosineAnnealingLR", {"T_max": 10})
    assert learning_rate(cosine, 1e-4, 10) == pytest.approx(0.0, abs=1e-20)


def check_signature(cls: str, defaults: dict[str, Any]) -> None:
    required = {name: 1 for name, default in defaults.items() if default is None}
    filled = check_scheduler(cls, required).kwargs
    assert filled == {**defaults, **required}


@pytest.mark.parametrize("cls", sorted({case[0] for case in TORCH_CASES}))
def test_torch_defaults(cls: str) -> None:
    params = list(inspect.signature(getattr(torch.optim.lr_scheduler, cls)).parameters.values())
    assert params[0].name == "optimizer" and params[-1].name == "last_epoch"
    empty = inspect.Parameter.empty
    check_signature(cls, {p.name: None if p.default is empty else p.default for p in params[1:-1]})


def test_twinkle_defaults(twinkle: dict[str, Any]) -> None:
    for cls, defaults in twinkle["defaults"].items():
        check_signature(cls, defaults)


def test_integral_float_counts() -> None:
    assert check_scheduler("StepLR", {"step_size": 3.0}).kwargs == {"step_size": 3, "gamma": 0.1}


BAD_COUNTS: list[object] = ["5", -1, 10**9 + 1, True, 2.5, math.nan, math.inf, None, [1]]
BAD_REALS: list[object] = ["0.5", -0.5, math.nan, math.inf, -math.inf, 10**400, True, None, [0.5]]
# (class, the argument under test, the other required arguments)
SCHEDULER_COUNTS = [
    ("LinearLR", "total_iters", {}),
    ("ConstantLR", "total_iters", {}),
    ("StepLR", "step_size", {}),
    ("CosineAnnealingLR", "T_max", {}),
    ("CosineWarmupScheduler", "num_warmup_steps", {"num_training_steps": 9}),
    ("LinearWarmupScheduler", "num_training_steps", {"num_warmup_steps": 1}),
]
SCHEDULER_REALS = [
    ("LinearLR", "start_factor", {}),
    ("LinearLR", "end_factor", {}),
    ("ConstantLR", "factor", {}),
    ("StepLR", "gamma", {"step_size": 2}),
    ("ExponentialLR", "gamma", {}),
    ("CosineAnnealingLR", "eta_min", {"T_max": 5}),
    ("CosineWarmupScheduler", "num_cycles", {"num_warmup_steps": 1, "num_training_steps": 9}),
]
SCHEDULER_REFUSED = [
    *[(c, {**o, name: v}, name) for c, name, o in SCHEDULER_COUNTS for v in BAD_COUNTS],
    *[(c, {**o, name: v}, name) for c, name, o in SCHEDULER_REALS for v in BAD_REALS],
    *[(cls, {}, "scheduler_cls") for cls in ("os.system", "", "LambdaLR", "ReduceLROnPlateau")],
    ("torch.optim.lr_scheduler.LinearLR", {}, "scheduler_cls"),
    (None, {}, "scheduler_cls"),
    (["LinearLR"], {}, "scheduler_cls"),
    ("LinearLR", {"last_epoch": 3}, "last_epoch"),
    ("LinearLR", {"verbose": True}, "verbose"),
    ("LinearLR", {"__class__": 1}, "__class__"),
    ("LinearLR", {"start_factor": 0}, "start_factor"),
    ("LinearLR", {"end_factor": 1.5}, "end_factor"),
    ("ConstantLR", {"factor": 0}, "factor"),
    ("StepLR", {}, "step_size"),
    ("StepLR", {"step_size": 0}, "step_size"),
    ("ExponentialLR", {"gamma": 1.01}, "gamma"),
    ("CosineAnnealingLR", {"T_max": 0}, "T_max"),
    ("CosineWarmupScheduler", {"num_training_steps": 10}, "num_warmup_steps"),
    ("LinearWarmupScheduler", {"num_warmup_steps": 1, "num_training_steps": 10**12}, "num_tr"),
]


@pytest.mark.parametrize(("cls", "kwargs", "field"), SCHEDULER_REFUSED)
def test_scheduler_refused(cls: object, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(UserError, match=field):
        check_scheduler(cls, kwargs)


def test_optimizer_defaults_are_torchs_and_twinkles(twinkle: dict[str, Any]) -> None:
    for cls in (torch.optim.AdamW, torch.optim.Adam):
        torch_defaults = cls([torch.nn.Parameter(torch.zeros(1))]).defaults
        settings = check_optimizer(cls.__name__, {"weight_decay": 0})
        assert (settings.beta1, settings.beta2) == torch_defaults["betas"]
        assert settings.eps == torch_defaults["eps"]
    settings = check_optimizer("AdamW", {})
    assert [settings.lr, settings.weight_decay] == twinkle["constants"] == [1e-5, 0.01]


def test_optimizer_settings_are_twinkles_param_group(twinkle: dict[str, Any]) -> None:
    for (cls, kwargs), group in zip(OPTIMIZER_CASES, twinkle["groups"], strict=True):
        settings = check_optimizer(cls, kwargs)
        assert settings.lr == group["lr"] and settings.eps == group["eps"]
        assert [settings.beta1, settings.beta2] == group["betas"]
        assert settings.weight_decay == group["weight_decay"]
        # torch's Adam adds weight decay to the gradient; this server's step decouples it
        coupled = not group["decoupled_weight_decay"] and group["weight_decay"] > 0
        assert settings.coupled == coupled


OPTIMIZER_REFUSED = [
    *[("AdamW", {name: v}, name) for name in ("lr", "eps", "weight_decay") for v in BAD_REALS],
    *[("AdamW", {"betas": [v, 0.9]}, r"betas\[0\]") for v in BAD_REALS],
    *[("AdamW", {"betas": [0.9, v]}, r"betas\[1\]") for v in BAD_REALS],
    *[(cls, {}, "optimizer_cls") for cls in ("SGD", "adamw", "torch.optim.AdamW", None, ["Adam"])],
    ("AdamW", {"betas": [0.9]}, "betas"),
    ("AdamW", {"betas": "ab"}, "betas"),
    ("AdamW", {"betas": [0.9, 1.0]}, r"betas\[1\]"),
    ("AdamW", {"eps": 0}, "eps"),
    ("AdamW", {"amsgrad": True}, "amsgrad"),
    ("AdamW", {"maximize": True}, "maximize"),
    ("AdamW", {"params": []}, "params"),
    ("AdamW", {"momentum": 0.9}, "momentum"),
    ("AdamW", {"foreach": "yes"}, "foreach"),
    ("AdamW", {"decoupled_weight_decay": True}, "decoupled_weight_decay"),
    ("Adam", {"weight_decay": 0, "decoupled_weight_decay": "yes"}, "decoupled_weight_decay"),
]


@pytest.mark.parametrize(("cls", "kwargs", "field"), OPTIMIZER_REFUSED)
def test_optimizer_refused(cls: object, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(UserError, match=field):
        check_optimizer(cls, kwargs)
