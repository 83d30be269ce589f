"""Per-slot AdamW over the adapter bank's rows, fused across the slots that step together.

Job: apply each stepping slot's accumulated gradient with that slot's own hyper-parameters,
exactly as `torch.optim.AdamW` (after `clip_grad_norm_` when `grad_clip_norm > 0`) would on that
slot alone, then zero those slots' gradients.

Invariants:
- A slot's state (parameters, gradients, both moments, step count) is row `slot` of `[S, P]`
  fp32 buffers; a step reads and writes only the stepping rows, so every other slot stays
  bit-identical.
- Bias correction uses the slot's own step count; clipping uses the L2 norm of the slot's own
  gradient row only (`coef = max_norm / (norm + 1e-6)`, clamped to 1, as `clip_grad_norm_`).
- A zero gradient on a zero parameter leaves it zero (decay multiplies, the Adam step adds
  0 / (0 + eps) with eps > 0), so rank padding and untrained layers stay exactly 0.
- A step is transactional per slot: a slot either takes exactly the step it would take alone or
  fails alone with a `UserError` (hyper-parameters that overflow float32, a non-finite gradient,
  a non-finite update) and keeps its weights, moments, step count and pending gradient bit for
  bit. One slot's failure never changes another slot's step.

In place, with a copy to fall back on only where a step could fail. One read of each stepping
slot's rows gives their largest magnitudes (and the second moment's smallest value); from them
and the slot's scalars, `_bounded` bounds every value the step computes. A slot whose bound stays
far inside float32 (`_SAFE`) cannot produce NaN or inf, so it steps in place with nothing saved
and nothing checked after. Every other slot (a non-finite gradient, huge weights, a learning rate
near overflow) takes the guarded path: its weights and moments (and its gradient when it clips)
are copied to scratch rows first; after the step its gradient and new rows are checked (a row's
sum is NaN or inf whenever a value is, so one summing read clears almost every row, and only a
row whose sum is not finite is checked value by value); a slot that fails gets its rows back
from the copy, bit for bit. Either way a slot's arithmetic is the same and reads only its own
rows, so each step is exactly the solo step. Scalars are checked first: the foreach kernels
convert them to float32 and raise on overflow, which would otherwise abort a fused step
half-way.

Fusion: where torch has the fused AdamW kernel (CPU and CUDA), each slot's rows are read and
written once (the step is memory-bound: a third of the traffic of one op at a time); elsewhere
one `torch._foreach_*` call per op over the stepping rows with per-row scalars. Slots step in
groups of as many as `scratch_bytes` of scratch rows hold. 16 slots of the bench model
(`bench/engine_merge.py`): 55 ms with a rehearsal on scratch before the step; 10.1 ms with a
copy of every slot; 7.4 ms with the bound (`bench/optimizer_step.py`, one thread). The scratch
rows persist between steps rather than being allocated each time.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from protocol.api import AdamParams
from protocol.errors import UserError
from protocol.jobs import StepAdam
from workers.engine.collective import Collective

GRAD_NORM_METRIC = "unclipped_grad_l2:mean"
LEARNING_RATE_METRIC = "learning_rate:mean"
_BAD_GRADIENT, _BAD_UPDATE = 2, 1  # a step's failure, most telling first (agreed by maximum)
_CLIP_EPS = 1e-6  # clip_grad_norm_'s guard against a zero norm
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_SCRATCH_ROWS = 5  # per stepping slot at most: 3 saved rows, a saved gradient, a denominator
_SAFE = 1e30  # a bound below this, computed in float64, leaves float32 (max 3.4e38) a wide margin
_NORM_SLACK = 1.01  # an L2 norm as computed may round below the largest magnitude it bounds
_NORM_FLOOR = 1e-18  # above any value whose square underflows float32 (sqrt(1.2e-38) = 1.1e-19)


@dataclass(frozen=True)
class _Scalars:
    """One slot's per-step scalars, named as the formulas that produce them."""

    decay: float  # 1 - learning_rate * weight_decay
    avg_weight: float  # 1 - beta1
    beta2: float
    avg_sq_weight: float  # 1 - beta2
    bias_sqrt2: float  # sqrt(1 - beta2**step)
    eps: float
    step_size: float  # -learning_rate / (1 - beta1**step)
    spec: AdamParams  # what the fused kernel takes, with the step number
    step: int

    @classmethod
    def of(cls, spec: AdamParams, step: int) -> _Scalars:
        """The scalars of step number `step` (1-based), in torch.optim.AdamW's arithmetic."""
        return cls(
            spec=spec,
            step=step,
            decay=1.0 if coupled(spec) else 1.0 - spec.learning_rate * spec.weight_decay,
            avg_weight=1.0 - spec.beta1,
            beta2=spec.beta2,
            avg_sq_weight=1.0 - spec.beta2,
            bias_sqrt2=math.sqrt(1.0 - spec.beta2**step),
            eps=spec.eps,
            step_size=-spec.learning_rate / (1.0 - spec.beta1**step),
        )

    def overflow(self) -> str | None:
        """The first scalar float32 cannot hold, described for the client; None if all fit."""
        for name, value in vars(self).items():
            if name in ("spec", "step"):
                continue
            if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
                return f"{_SCALAR_FORMULAS[name]} is {value:.6g}"
        return None


_SCALAR_FORMULAS = {
    "decay": "the decay factor 1 - learning_rate * weight_decay",
    "avg_weight": "1 - beta1",
    "beta2": "beta2",
    "avg_sq_weight": "1 - beta2",
    "bias_sqrt2": "the bias correction sqrt(1 - beta2**step)",
    "eps": "eps",
    "step_size": "the step size learning_rate / (1 - beta1**step)",
}

StepResult = dict[str, float] | UserError


class SlotAdamW:
    """AdamW state for every slot of a bank: moments `exp_avg`/`exp_avg_sq` and step counts."""

    def __init__(
        self,
        weights: torch.Tensor,
        grads: torch.Tensor,
        *,
        scratch_bytes: int = 2**28,
        collective: Collective | None = None,
        per_expert_start: int | None = None,
    ) -> None:
        self.weights = weights
        # A rank of a worker group holds the columns from `per_expert_start` on for its own
        # experts only; the ones before are the same on every rank (`workers.engine.lora`).
        self.collective = collective or Collective()
        self.split = weights.shape[1] if per_expert_start is None else per_expert_start
        self.scratch_bytes = scratch_bytes  # bounds the slots stepped at once
        self.grads = grads
        self.exp_avg = torch.zeros_like(weights)
        self.exp_avg_sq = torch.zeros_like(weights)
        self.steps = [0] * weights.shape[0]
        self._scratch = weights.new_empty((0, weights.shape[1]))

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's moments and step count (fresh or released adapter)."""
        self.exp_avg[slot].zero_()
        self.exp_avg_sq[slot].zero_()
        self.steps[slot] = 0

    def step(self, slots: list[int], specs: list[AdamParams]) -> list[StepResult]:
        """One AdamW step for each slot with its spec: its metrics, or why it did not step."""
        if len(set(slots)) != len(slots) or len(slots) != len(specs):
            raise ValueError(f"each slot steps once, with one spec: slots={slots}")
        if not slots:
            return []
        scalars = [
            _Scalars.of(spec, self.steps[s] + 1) for s, spec in zip(slots, specs, strict=True)
        ]
        results, coefs = self._clip_coefficients(slots, specs)
        for i, slot_scalars in enumerate(scalars):
            overflow = slot_scalars.overflow()
            if overflow is not None and not isinstance(results[i], UserError):
                results[i] = UserError(
                    f"optim_step: adam_params overflow float32: {overflow}; "
                    "lower learning_rate (or weight_decay)"
                )
        candidates = [i for i, result in enumerate(results) if not isinstance(result, UserError)]
        group = self._group_size()
        for first in range(0, len(candidates), group):
            chosen = candidates[first : first + group]
            verdicts = self._step_group(
                [slots[i] for i in chosen], [coefs[i] for i in chosen], [scalars[i] for i in chosen]
            )
            for i, verdict in zip(chosen, verdicts, strict=True):
                if verdict is not None:
                    results[i] = verdict
        return results

    def _step_group(
        self, slots: list[int], coefs: list[float | None], scalars: list[_Scalars]
    ) -> list[UserError | None]:
        """Step the slots in place, fused; a slot whose step could fail is copied first and, if
        its gradient or result is not finite, gets its rows back. Returns why each slot did not
        step (None: it did)."""
        n = len(slots)
        weights = [self.weights[s] for s in slots]
        exp_avgs = [self.exp_avg[s] for s in slots]
        exp_avg_sqs = [self.exp_avg_sq[s] for s in slots]
        grads = [self.grads[s] for s in slots]
        safe = _bounded(weights, exp_avgs, exp_avg_sqs, grads, coefs, scalars)
        # a slot whose step could fail on any rank is guarded on every rank, to be put back
        unsure = self.collective.agree([not ok for ok in safe])
        guarded = [i for i in range(n) if unsure[i]]
        guarded_clips = [i for i in guarded if coefs[i] is not None]
        g = len(guarded)
        # Scratch first: an allocation failure must come before the first in-place write.
        rows = self._scratch_rows(n + 3 * g + len(guarded_clips))
        denominators, saved = rows[:n], rows[n:]
        if guarded:
            state = [t[i] for t in (weights, exp_avgs, exp_avg_sqs) for i in guarded]
            torch._foreach_copy_(saved, state + [grads[i] for i in guarded_clips])
        clipped = [(i, coef) for i, coef in enumerate(coefs) if coef is not None]
        if clipped:
            torch._foreach_mul_([grads[i] for i, _ in clipped], [coef for _, coef in clipped])
        if guarded:
            grad_sums = torch.stack([grads[i].sum() for i in guarded])
        _adamw(weights, grads, exp_avgs, exp_avg_sqs, denominators, scalars)
        verdicts: list[UserError | None] = [None] * n
        if guarded:
            new_sums = torch.stack(
                [
                    torch.stack([weights[i].sum(), exp_avgs[i].sum(), exp_avg_sqs[i].sum()])
                    for i in guarded
                ]
            )
            grad_ok, update_ok = (
                grad_sums.isfinite().tolist(),
                new_sums.isfinite().all(dim=1).tolist(),
            )  # one device sync
            codes = []
            for j, i in enumerate(guarded):
                # A sum is NaN or inf whenever a value is; only a sum that is not finite (its
                # finite values may overflow it) needs a look at every value.
                if not grad_ok[j] and not _finite(grads[i]):
                    codes.append(_BAD_GRADIENT)
                elif not update_ok[j] and not (
                    _finite(weights[i]) and _finite(exp_avgs[i]) and _finite(exp_avg_sqs[i])
                ):
                    codes.append(_BAD_UPDATE)
                else:
                    codes.append(0)
            # what any rank found in its part of a row holds for the whole row
            for i, code in zip(guarded, self.collective.agree_max(codes), strict=True):
                if code == _BAD_GRADIENT:
                    verdicts[i] = _gradient_error("it holds NaN or inf")
                elif code == _BAD_UPDATE:
                    verdicts[i] = UserError(
                        "optim_step: the update is not finite (the new weights or Adam moments "
                        "overflow float32); lower learning_rate, or check the gradients' scale"
                    )
        failed = [i for i in guarded if verdicts[i] is not None]
        if failed:
            row = {i: j for j, i in enumerate(guarded)}  # slot index -> its saved rows
            clip_row = {i: 3 * g + k for k, i in enumerate(guarded_clips)}
            targets = [t[i] for t in (weights, exp_avgs, exp_avg_sqs) for i in failed]
            sources = [saved[k * g + row[i]] for k in range(3) for i in failed]
            targets += [grads[i] for i in failed if i in clip_row]
            sources += [saved[clip_row[i]] for i in failed if i in clip_row]
            torch._foreach_copy_(targets, sources)
        passing = [i for i, verdict in enumerate(verdicts) if verdict is None]
        if passing:
            torch._foreach_zero_([grads[i] for i in passing])
        for i in passing:
            self.steps[slots[i]] += 1
        return verdicts

    def _group_size(self) -> int:
        """Slots stepped together: as many as `scratch_bytes` of scratch rows hold (at least 1)."""
        row_bytes = self.weights.shape[1] * self.weights.element_size()
        return max(1, self.scratch_bytes // (_SCRATCH_ROWS * max(1, row_bytes)))

    def _clip_coefficients(
        self, slots: list[int], specs: list[AdamParams]
    ) -> tuple[list[StepResult], list[float | None]]:
        """Each slot's metrics (its gradient's L2 norm before clipping, and the learning rate it
        steps with) and clip coefficient (None: no clipping), or, when clipping, a `UserError`
        for a gradient whose norm is not finite (without clipping the step's own guard fails
        it). Changes nothing."""
        results: list[StepResult] = [
            {LEARNING_RATE_METRIC: float(spec.learning_rate)} for spec in specs
        ]
        coefs: list[float | None] = [None] * len(specs)
        norms = self._norms([self.grads[slot] for slot in slots])
        max_norms = torch.tensor(
            [max(spec.grad_clip_norm, 0.0) for spec in specs],
            dtype=norms.dtype,
            device=norms.device,
        )
        clip_coefs = (max_norms / (norms + _CLIP_EPS)).clamp(max=1.0)
        for i, (norm, coef) in enumerate(zip(norms.tolist(), clip_coefs.tolist(), strict=True)):
            clipping = specs[i].grad_clip_norm > 0
            if not math.isfinite(norm):
                if clipping:
                    results[i] = _gradient_error(f"its L2 norm is {norm}")
                continue
            results[i] = {GRAD_NORM_METRIC: norm, LEARNING_RATE_METRIC: specs[i].learning_rate}
            if clipping:
                coefs[i] = coef
        return results, coefs

    def _norms(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Each gradient row's L2 norm; in a worker group over the whole row across the ranks,
        every column counted once: the columns every rank holds alike from rank 0, each rank's
        own experts' columns from it (the same result on every rank)."""
        if not self.collective.parallel:
            return torch.stack(torch._foreach_norm(rows))
        shared = torch.stack(torch._foreach_norm([row[: self.split] for row in rows]))
        own = torch.stack(torch._foreach_norm([row[self.split :] for row in rows]))
        if self.collective.rank:
            shared = torch.zeros_like(shared)
        squares = torch.cat([shared.double() ** 2, own.double() ** 2])
        self.collective.all_reduce_sum(squares)
        return (squares[: len(rows)] + squares[len(rows) :]).sqrt().to(rows[0].dtype)

    def _scratch_rows(self, count: int) -> list[torch.Tensor]:
        # Grown to the largest number of rows needed at once, then reused.
        if self._scratch.shape[0] < count:
            self._scratch = self.weights.new_empty((count, self.weights.shape[1]))
        return [self._scratch[i] for i in range(count)]


def _adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    denominators: list[torch.Tensor],
    scalars: list[_Scalars],
) -> None:
    """The AdamW update in place, as torch.optim.AdamW computes it; `grads` is read only.

    Where torch has the fused AdamW kernel for the device (`torch._fused_adamw_`: CPU and CUDA),
    one call per slot reads each row once and writes it once; otherwise the same arithmetic as
    a sequence of foreach ops over all slots. Both phases run the same path, so a rehearsal
    predicts its step bit for bit.
    """
    if (
        _FUSED_ADAMW is not None
        and _FUSED_ADAM is not None
        and params
        and params[0].device.type in ("cpu", "cuda")
    ):
        for param, grad, exp_avg, exp_avg_sq, s in zip(
            params, grads, exp_avgs, exp_avg_sqs, scalars, strict=True
        ):
            spec = s.spec
            (_FUSED_ADAM if coupled(spec) else _FUSED_ADAMW)(
                [param],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                [],
                [torch.tensor(float(s.step), device=param.device)],
                lr=spec.learning_rate,
                beta1=spec.beta1,
                beta2=spec.beta2,
                weight_decay=spec.weight_decay,
                eps=spec.eps,
                amsgrad=False,
                maximize=False,
            )
        return
    torch._foreach_mul_(params, [s.decay for s in scalars])
    grads = [  # Adam's L2 penalty: the decay added to a copy of the gradient
        g.add(p, alpha=s.spec.weight_decay) if coupled(s.spec) else g
        for g, p, s in zip(grads, params, scalars, strict=True)
    ]
    torch._foreach_lerp_(exp_avgs, grads, [s.avg_weight for s in scalars])
    torch._foreach_mul_(exp_avg_sqs, [s.beta2 for s in scalars])
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, [s.avg_sq_weight for s in scalars])
    torch._foreach_copy_(denominators, exp_avg_sqs)
    torch._foreach_sqrt_(denominators)
    torch._foreach_div_(denominators, [s.bias_sqrt2 for s in scalars])
    torch._foreach_add_(denominators, [s.eps for s in scalars])
    torch._foreach_addcdiv_(params, exp_avgs, denominators, [s.step_size for s in scalars])


_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)
_FUSED_ADAM = getattr(torch, "_fused_adam_", None)  # the decay added to the gradient, not stored


def coupled(spec: AdamParams) -> bool:
    """Whether the step decays as torch's `Adam` (the decay in the gradient), not `AdamW`."""
    return isinstance(spec, StepAdam) and spec.coupled_weight_decay


def _bounded(
    weights: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    grads: list[torch.Tensor],
    coefs: list[float | None],
    scalars: list[_Scalars],
) -> list[bool]:
    """For each slot, whether its step is sure to stay finite: every value the AdamW arithmetic
    computes is bounded, in float64, below `_SAFE`, with the scalars as float32 holds them (an
    eps that rounds to 0, a beta that rounds to 1, a second moment below 0, or any NaN or inf is
    not sure). A row's largest magnitude is bounded by its L2 norm (on CPU one foreach call
    reads rows 2x faster than `aminmax` and 30x faster than an inf-norm), raised by
    `_NORM_SLACK` for the sum's rounding and floored at `_NORM_FLOOR` in case squares underflow
    (a float32 accumulator on GPU). One read of each row and one device sync."""
    norms = torch._foreach_norm(weights + exp_avgs + exp_avg_sqs + grads)
    lows = [v.amin() for v in exp_avg_sqs]
    values = torch.stack(list(norms) + lows).tolist()
    n = len(weights)
    sure = []
    for i, s in enumerate(scalars):
        w, m, v, g = (max(values[k * n + i] * _NORM_SLACK, _NORM_FLOOR) for k in range(4))
        v_low = values[4 * n + i]
        sure.append(_step_is_bounded(w, m, g * (coefs[i] or 1.0), v_low, v, s))
    return sure


def _step_is_bounded(
    w: float, m: float, g: float, v_low: float, v_high: float, s: _Scalars
) -> bool:
    """Whether one slot's step stays below `_SAFE`, from its rows' largest magnitudes (`w`,
    `m`, `g` after clipping, `v_high`) and its second moment's smallest value `v_low`."""
    spec = s.spec
    try:
        beta1, beta2, eps = (_float32(x) for x in (spec.beta1, spec.beta2, spec.eps))
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps > 0.0 and v_low >= 0.0):
            return False  # also False for NaN
        if coupled(spec):  # the gradient Adam sees, the decay in it; the weights keep theirs
            g, shrink = g + spec.weight_decay * w, 0.0
        else:
            shrink = spec.learning_rate * spec.weight_decay * w
        m_new = m + g  # |lerp(m, g, 1 - beta1)| <= max(|m|, |g|), and |g - m| <= |g| + |m|
        square = g * g
        v_new = v_high + square
        ratio = m_new / eps  # |m / (sqrt(v) / bias + eps)| <= |m| / eps
        scaled = math.sqrt(v_new) / s.bias_sqrt2
        update = abs(s.step_size) * ratio
        bounds = (w, m_new, square, v_new, shrink, ratio, scaled, update, w + shrink + update)
    except (OverflowError, ZeroDivisionError, ValueError, struct.error):
        return False
    return all(b <= _SAFE for b in bounds)  # False for NaN


def _float32(value: float) -> float:
    """`value` rounded to float32, as the kernels take it (OverflowError beyond its range)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _finite(row: torch.Tensor) -> bool:
    return bool(row.isfinite().all())


def _gradient_error(detail: str) -> UserError:
    return UserError(
        f"optim_step: the accumulated gradient is not finite ({detail}); check the loss inputs "
        "(weights, advantages, logprobs) of the forward_backward calls since the last step"
    )
