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

Two phases. Phase 1 (`_rehearse`) runs each slot's step on scratch copies of its rows and checks
every result row is finite; it writes nothing but scratch. Phase 2 runs the same op sequence
(`_adamw`) in place, fused over the slots that passed, so a passing slot's result is exactly its
rehearsal's and exactly its solo step's. Scalars are checked before either phase: the foreach
kernels convert them to float32 and raise on overflow, which would otherwise abort the whole
fused step half-way.

Fusion: where torch has the fused AdamW kernel (CPU and CUDA), each slot's row is read and
written once per phase (a third of the memory traffic of one op at a time: the step is
memory-bound); elsewhere phase 2 is one `torch._foreach_*` call per op over the stepping rows
with per-row scalars. Phase 1 runs
slot by slot on five scratch rows, so the check costs at most five rows of memory, not five per
slot; its launches are small next to the step's memory traffic. The scratch rows (also phase 2's
denominators) persist between steps rather than being allocated each time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol.api import AdamParams
from protocol.errors import UserError

GRAD_NORM_METRIC = "unclipped_grad_l2:mean"
_CLIP_EPS = 1e-6  # clip_grad_norm_'s guard against a zero norm
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_REHEARSAL_ROWS = 5  # gradient, exp_avg, exp_avg_sq, parameters, denominator


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
            decay=1.0 - spec.learning_rate * spec.weight_decay,
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

    def __init__(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        self.weights = weights
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
        verdicts = self._rehearse(
            [slots[i] for i in candidates],
            [coefs[i] for i in candidates],
            [scalars[i] for i in candidates],
        )
        for i, verdict in zip(candidates, verdicts, strict=True):
            if verdict is not None:
                results[i] = verdict
        passing = [i for i, result in enumerate(results) if not isinstance(result, UserError)]
        if passing:
            self._apply(
                [slots[i] for i in passing],
                [coefs[i] for i in passing],
                [scalars[i] for i in passing],
            )
        return results

    def _clip_coefficients(
        self, slots: list[int], specs: list[AdamParams]
    ) -> tuple[list[StepResult], list[float | None]]:
        """Each slot's metrics (pre-clip L2 norm when clipping) and clip coefficient (None: no
        clipping), or a `UserError` for a gradient whose norm is not finite. Changes nothing."""
        results: list[StepResult] = [{} for _ in specs]
        coefs: list[float | None] = [None] * len(specs)
        clipping = [i for i, spec in enumerate(specs) if spec.grad_clip_norm > 0]
        if not clipping:
            return results, coefs
        norms = torch.stack(torch._foreach_norm([self.grads[slots[i]] for i in clipping]))
        max_norms = torch.tensor(
            [specs[i].grad_clip_norm for i in clipping], dtype=norms.dtype, device=norms.device
        )
        clip_coefs = (max_norms / (norms + _CLIP_EPS)).clamp(max=1.0)
        for i, norm, coef in zip(clipping, norms.tolist(), clip_coefs.tolist(), strict=True):
            if not math.isfinite(norm):
                results[i] = _gradient_error(f"its L2 norm is {norm}")
                continue
            results[i] = {GRAD_NORM_METRIC: norm}
            coefs[i] = coef
        return results, coefs

    def _rehearse(
        self, slots: list[int], coefs: list[float | None], scalars: list[_Scalars]
    ) -> list[UserError | None]:
        """Phase 1: each slot's step on scratch copies of its rows; why it must not be applied
        (None: it may). Writes nothing but scratch."""
        if not slots:
            return []
        grad, exp_avg, exp_avg_sq, param, denominator = self._scratch_rows(_REHEARSAL_ROWS)
        finite: list[torch.Tensor] = []
        for slot, coef, slot_scalars in zip(slots, coefs, scalars, strict=True):
            torch._foreach_copy_(
                [grad, exp_avg, exp_avg_sq, param],
                [self.grads[slot], self.exp_avg[slot], self.exp_avg_sq[slot], self.weights[slot]],
            )
            if coef is not None:
                torch._foreach_mul_([grad], [coef])
            _adamw([param], [grad], [exp_avg], [exp_avg_sq], [denominator], [slot_scalars])
            # Queued on the device in order, before the next slot reuses the scratch rows.
            update_finite = param.isfinite().all() & exp_avg.isfinite().all()
            finite.append(
                torch.stack([grad.isfinite().all(), update_finite & exp_avg_sq.isfinite().all()])
            )
        verdicts: list[UserError | None] = []
        for grad_finite, update_finite in torch.stack(finite).tolist():  # one device sync
            if not grad_finite:
                verdicts.append(_gradient_error("it holds NaN or inf"))
            elif not update_finite:
                verdicts.append(
                    UserError(
                        "optim_step: the update is not finite (the new weights or Adam moments "
                        "overflow float32); lower learning_rate, or check the gradients' scale"
                    )
                )
            else:
                verdicts.append(None)
        return verdicts

    def _apply(self, slots: list[int], coefs: list[float | None], scalars: list[_Scalars]) -> None:
        """Phase 2: clip, step and clear the gradients of slots whose rehearsal passed, fused."""
        # Scratch first: an allocation failure must come before the first in-place write.
        denominators = self._scratch_rows(len(slots))
        grads = [self.grads[s] for s in slots]
        clipped = [(grads[i], coef) for i, coef in enumerate(coefs) if coef is not None]
        if clipped:
            torch._foreach_mul_([g for g, _ in clipped], [coef for _, coef in clipped])
        _adamw(
            [self.weights[s] for s in slots],
            grads,
            [self.exp_avg[s] for s in slots],
            [self.exp_avg_sq[s] for s in slots],
            denominators,
            scalars,
        )
        torch._foreach_zero_(grads)
        for slot in slots:
            self.steps[slot] += 1

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
    if _FUSED_ADAMW is not None and params and params[0].device.type in ("cpu", "cuda"):
        for param, grad, exp_avg, exp_avg_sq, s in zip(
            params, grads, exp_avgs, exp_avg_sqs, scalars, strict=True
        ):
            spec = s.spec
            _FUSED_ADAMW(
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
    torch._foreach_lerp_(exp_avgs, grads, [s.avg_weight for s in scalars])
    torch._foreach_mul_(exp_avg_sqs, [s.beta2 for s in scalars])
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, [s.avg_sq_weight for s in scalars])
    torch._foreach_copy_(denominators, exp_avg_sqs)
    torch._foreach_sqrt_(denominators)
    torch._foreach_div_(denominators, [s.bias_sqrt2 for s in scalars])
    torch._foreach_add_(denominators, [s.eps for s in scalars])
    torch._foreach_addcdiv_(params, exp_avgs, denominators, [s.step_size for s in scalars])


_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)


def _gradient_error(detail: str) -> UserError:
    return UserError(
        f"optim_step: the accumulated gradient is not finite ({detail}); check the loss inputs "
        "(weights, advantages, logprobs) of the forward_backward calls since the last step"
    )
