"""Twinkle's optimizer settings, lr schedulers and gradient-accumulation rule, without torch.

A twinkle client (twinkle-kit 0.5.1) names a torch optimizer and an lr scheduler by class name
with keyword arguments (`set_optimizer`, `set_lr_scheduler`), and steps them itself. The server
runs no torch optimizer: it checks those names and arguments here against an allow-list, and
computes per optimizer step the lr the named scheduler would set, for its own AdamW step.

Mirrored from twinkle (`twinkle/model/transformers/transformers.py`, `optimizer_group.py`,
`twinkle/module/scheduler/`) and torch 2.13 (`torch/optim/lr_scheduler.py`, `adam.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import msgspec

from protocol.errors import UserError

MAX_ACCUMULATION_STEPS = 1_000_000
MAX_STEPS = 10**9
# twinkle's `set_optimizer`: param groups get these unless the client passes `lr`/`weight_decay`
DEFAULT_LEARNING_RATE = 1e-5
DEFAULT_WEIGHT_DECAY = 0.01
# torch's Adam/AdamW defaults
DEFAULT_BETAS = (0.9, 0.999)
DEFAULT_EPS = 1e-8


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def grad_sync(cur_step: int, accumulation_steps: int) -> bool:
    """Twinkle's `do_grad_sync`: whether the backward pass numbered `cur_step` (from 1) syncs.

    `clip_grad_norm`, `step`, `zero_grad` and `lr_step` act only when it does. Twinkle's rule
    makes the first window one pass longer: with 2 it syncs at 3, 5, 7, ...
    """
    return accumulation_steps == 1 or ((cur_step - 1) % accumulation_steps == 0 and cur_step > 1)


def check_accumulation_steps(value: object) -> int:
    """A client's `gradient_accumulation_steps`: an int in [1, MAX_ACCUMULATION_STEPS]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"gradient_accumulation_steps must be an integer, got {_show(value)}")
    if not 1 <= value <= MAX_ACCUMULATION_STEPS:
        raise UserError(
            f"gradient_accumulation_steps must be in [1, {MAX_ACCUMULATION_STEPS}], got {value}"
        )
    return value


def _real(
    field: str,
    value: object,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{field} must be a number, got {_show(value)}")
    try:
        out = float(value)
    except OverflowError:
        raise UserError(f"{field} must be a finite number, got {_show(value)}") from None
    if not math.isfinite(out):
        raise UserError(f"{field} must be a finite number, got {out}")
    if out < low or out > high or (low_open and out == low) or (high_open and out == high):
        span = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise UserError(f"{field} must be in {span}, got {out}")
    return out


def _count(field: str, value: object, low: int, high: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{field} must be an integer, got {_show(value)}")
    if not low <= value <= high:
        raise UserError(f"{field} must be in [{low}, {high}], got {_show(value)}")
    return value


class _Arg(NamedTuple):
    """One numeric constructor argument: a step count or a real; no default means required."""

    is_count: bool
    default: float | None
    low: float
    high: float
    low_open: bool = False


def _steps(default: int | None = None, low: int = 0) -> _Arg:
    return _Arg(True, default, low, MAX_STEPS)


def _factor(default: float | None, low_open: bool = False) -> _Arg:
    return _Arg(False, default, 0.0, 1.0, low_open)


_SCHEDULER_ARGS: dict[str, dict[str, _Arg]] = {
    # factor 0 is refused: torch divides by it when total_iters is reached
    "ConstantLR": {"factor": _factor(1.0 / 3, low_open=True), "total_iters": _steps(5)},
    "LinearLR": {
        "start_factor": _factor(1.0 / 3, low_open=True),
        "end_factor": _factor(1.0),
        "total_iters": _steps(5),
    },
    "StepLR": {"step_size": _steps(low=1), "gamma": _factor(0.1)},
    "ExponentialLR": {"gamma": _factor(None)},
    "CosineAnnealingLR": {"T_max": _steps(low=1), "eta_min": _Arg(False, 0.0, 0.0, math.inf)},
    # twinkle.module.scheduler
    "CosineWarmupScheduler": {
        "num_warmup_steps": _steps(),
        "num_training_steps": _steps(),
        "num_cycles": _Arg(False, 0.5, 0.0, MAX_STEPS),
    },
    "LinearWarmupScheduler": {"num_warmup_steps": _steps(), "num_training_steps": _steps()},
}


class Scheduler(msgspec.Struct, frozen=True):
    """A checked lr scheduler: an allowed class name and all its arguments, defaults filled in."""

    cls: str
    kwargs: dict[str, float | int]


def check_scheduler(cls: object, kwargs: Mapping[str, object]) -> Scheduler:
    """Check a `set_lr_scheduler` class name and keyword arguments against the allow-list."""
    if not isinstance(cls, str) or cls not in _SCHEDULER_ARGS:
        raise UserError(
            f"scheduler_cls must be one of {', '.join(_SCHEDULER_ARGS)}, got {_show(cls)}"
        )
    spec = _SCHEDULER_ARGS[cls]
    for name in kwargs:
        if name not in spec:
            raise UserError(
                f"{cls} takes no argument {_show(name)}; it takes {', '.join(spec) or 'none'}"
            )
    out: dict[str, float | int] = {}
    for name, arg in spec.items():
        field = f"{cls} {name}"
        if name not in kwargs:
            if arg.default is None:
                raise UserError(f"{field} is required")
            out[name] = int(arg.default) if arg.is_count else arg.default
            continue
        if arg.is_count:
            out[name] = _count(field, kwargs[name], int(arg.low), int(arg.high))
            continue
        out[name] = _real(field, kwargs[name], arg.low, arg.high, low_open=arg.low_open)
    return Scheduler(cls=cls, kwargs=out)


def _linear_lr(kw: Mapping[str, float | int], base: float, n: int) -> float:
    start, end, total = float(kw["start_factor"]), float(kw["end_factor"]), int(kw["total_iters"])
    if total == 0:  # torch's chained form stays at start_factor
        return base * start
    return base * (start + (end - start) * min(total, n) / total)


def _constant_lr(kw: Mapping[str, float | int], base: float, n: int) -> float:
    factor, total = float(kw["factor"]), int(kw["total_iters"])
    # torch's chained form never restores the lr when total_iters is 0
    return base * factor if total == 0 or n < total else base


def _cosine_annealing_lr(kw: Mapping[str, float | int], base: float, n: int) -> float:
    eta_min, t_max = float(kw["eta_min"]), int(kw["T_max"])
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * n / t_max)) / 2


def _cosine_warmup(kw: Mapping[str, float | int], base: float, n: int) -> float:
    warmup, training = int(kw["num_warmup_steps"]), int(kw["num_training_steps"])
    if n < warmup:
        return base * (float(n) / float(max(1, warmup)))
    progress = float(n - warmup) / float(max(1, training - warmup))
    cycles = float(kw["num_cycles"])
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))


def _linear_warmup(kw: Mapping[str, float | int], base: float, n: int) -> float:
    warmup, training = int(kw["num_warmup_steps"]), int(kw["num_training_steps"])
    if n < warmup:
        return base * (float(n) / float(max(1, warmup)))
    return base * max(0.0, float(training - n) / float(max(1, training - warmup)))


_LR: dict[str, Callable[[Mapping[str, float | int], float, int], float]] = {
    "ConstantLR": _constant_lr,
    "LinearLR": _linear_lr,
    "StepLR": lambda kw, base, n: base * float(kw["gamma"]) ** (n // int(kw["step_size"])),
    "ExponentialLR": lambda kw, base, n: base * float(kw["gamma"]) ** n,
    "CosineAnnealingLR": _cosine_annealing_lr,
    "CosineWarmupScheduler": _cosine_warmup,
    "LinearWarmupScheduler": _linear_warmup,
}


def learning_rate(scheduler: Scheduler | None, base_lr: float, steps_done: int) -> float:
    """The lr of the optimizer step after `steps_done` `scheduler.step()` calls.

    That is the `param_group["lr"]` torch's scheduler sets, built on an optimizer created with
    `base_lr`, in closed form (torch chains some; they differ by float rounding only).
    """
    if steps_done < 0:
        raise ValueError(f"steps_done must be >= 0, got {steps_done}")
    if scheduler is None:
        return base_lr
    return _LR[scheduler.cls](scheduler.kwargs, base_lr, steps_done)


class OptimizerSettings(msgspec.Struct, frozen=True):
    """The Adam hyper-parameters a twinkle client's LoRA weights get."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    coupled: bool = False  # Adam's weight decay: an L2 penalty in the gradient, not AdamW's


_IGNORED = frozenset({"foreach", "fused", "capturable", "differentiable"})
_MUST_BE_FALSE = frozenset({"amsgrad", "maximize"})
_OPTIMIZER_ARGS = frozenset({"lr", "betas", "eps", "weight_decay"}) | _IGNORED | _MUST_BE_FALSE


def check_optimizer(cls: object, kwargs: Mapping[str, object]) -> OptimizerSettings:
    """Check a `set_optimizer` class name (`Adam`, `AdamW`) and its keyword arguments.

    Twinkle gives LoRA weights `lr` 1e-5 and `weight_decay` 0.01 unless the client passes them,
    for Adam too, where torch applies it as a coupled L2 penalty (`coupled`), as the step here
    then does.
    """
    if cls not in ("Adam", "AdamW"):
        raise UserError(f"optimizer_cls must be Adam or AdamW, got {_show(cls)}")
    allowed = _OPTIMIZER_ARGS | ({"decoupled_weight_decay"} if cls == "Adam" else set())
    for name, value in kwargs.items():
        if name not in allowed:
            raise UserError(f"{cls} takes no argument {_show(name)}; it takes {sorted(allowed)}")
        if name in _IGNORED and value is not None and not isinstance(value, bool):
            raise UserError(f"{name} must be a bool or null, got {_show(value)}")
        if name in _MUST_BE_FALSE and value is not False:
            raise UserError(f"{name} must be false (not supported), got {_show(value)}")
    lr = _real("lr", kwargs.get("lr", DEFAULT_LEARNING_RATE), 0.0)
    betas = kwargs.get("betas", DEFAULT_BETAS)
    if not isinstance(betas, list | tuple) or len(betas) != 2:
        raise UserError(f"betas must be a list of two numbers, got {_show(betas)}")
    beta1, beta2 = (_real(f"betas[{i}]", betas[i], 0.0, 1.0, high_open=True) for i in (0, 1))
    eps = _real("eps", kwargs.get("eps", DEFAULT_EPS), 0.0, low_open=True)
    weight_decay = _real("weight_decay", kwargs.get("weight_decay", DEFAULT_WEIGHT_DECAY), 0.0)
    decoupled = kwargs.get("decoupled_weight_decay", cls == "AdamW")
    if not isinstance(decoupled, bool):
        raise UserError(f"decoupled_weight_decay must be a bool, got {_show(decoupled)}")
    return OptimizerSettings(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        coupled=weight_decay > 0 and not decoupled,
    )
