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

Fusion: every update is one `torch._foreach_*` call over the stepping rows with per-row scalars,
so a step costs a fixed number of multi-tensor launches whatever the number of slots. The
denominator goes into a persistent scratch buffer rather than a fresh [k, P] allocation each step.
"""

from __future__ import annotations

import math

import torch

from protocol.api import AdamParams

GRAD_NORM_METRIC = "unclipped_grad_l2:mean"
_CLIP_EPS = 1e-6  # clip_grad_norm_'s guard against a zero norm


class SlotAdamW:
    """AdamW state for every slot of a bank: moments `exp_avg`/`exp_avg_sq` and step counts."""

    def __init__(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        self.weights = weights
        self.grads = grads
        self.exp_avg = torch.zeros_like(weights)
        self.exp_avg_sq = torch.zeros_like(weights)
        self.steps = [0] * weights.shape[0]
        self._denominators = weights.new_empty((0, weights.shape[1]))

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's moments and step count (fresh or released adapter)."""
        self.exp_avg[slot].zero_()
        self.exp_avg_sq[slot].zero_()
        self.steps[slot] = 0

    def step(self, slots: list[int], specs: list[AdamParams]) -> list[dict[str, float]]:
        """One AdamW step for each slot with its spec; returns each slot's metrics."""
        if len(set(slots)) != len(slots) or len(slots) != len(specs):
            raise ValueError(f"each slot steps once, with one spec: slots={slots}")
        if not slots:
            return []
        params = [self.weights[s] for s in slots]
        grads = [self.grads[s] for s in slots]
        exp_avgs = [self.exp_avg[s] for s in slots]
        exp_avg_sqs = [self.exp_avg_sq[s] for s in slots]
        metrics = self._clip(grads, specs)

        for slot in slots:
            self.steps[slot] += 1
        # Per-slot scalars, in the order torch.optim.AdamW applies them.
        counts = [self.steps[s] for s in slots]
        decays = [1.0 - spec.learning_rate * spec.weight_decay for spec in specs]
        bias_sqrt2 = [math.sqrt(1.0 - spec.beta2**t) for spec, t in zip(specs, counts, strict=True)]
        step_sizes = [
            -spec.learning_rate / (1.0 - spec.beta1**t)
            for spec, t in zip(specs, counts, strict=True)
        ]

        torch._foreach_mul_(params, decays)
        torch._foreach_lerp_(exp_avgs, grads, [1.0 - spec.beta1 for spec in specs])
        torch._foreach_mul_(exp_avg_sqs, [spec.beta2 for spec in specs])
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, [1.0 - spec.beta2 for spec in specs])
        denominators = self._scratch_rows(len(slots))
        torch._foreach_copy_(denominators, exp_avg_sqs)
        torch._foreach_sqrt_(denominators)
        torch._foreach_div_(denominators, bias_sqrt2)
        torch._foreach_add_(denominators, [spec.eps for spec in specs])
        torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)
        torch._foreach_zero_(grads)
        return metrics

    def _clip(self, grads: list[torch.Tensor], specs: list[AdamParams]) -> list[dict[str, float]]:
        """Clip each clipping slot's gradient row in place; report its pre-clip L2 norm."""
        metrics: list[dict[str, float]] = [{} for _ in specs]
        clipping = [i for i, spec in enumerate(specs) if spec.grad_clip_norm > 0]
        if not clipping:
            return metrics
        clipped_grads = [grads[i] for i in clipping]
        norms = torch.stack(torch._foreach_norm(clipped_grads))
        max_norms = torch.tensor(
            [specs[i].grad_clip_norm for i in clipping], dtype=norms.dtype, device=norms.device
        )
        coefs = (max_norms / (norms + _CLIP_EPS)).clamp(max=1.0)
        torch._foreach_mul_(clipped_grads, coefs.tolist())
        for i, norm in zip(clipping, norms.tolist(), strict=True):
            metrics[i][GRAD_NORM_METRIC] = norm
        return metrics

    def _scratch_rows(self, count: int) -> list[torch.Tensor]:
        # Grown to the largest number of slots stepped together, then reused.
        if self._denominators.shape[0] < count:
            self._denominators = self.weights.new_empty((count, self.weights.shape[1]))
        return [self._denominators[i] for i in range(count)]
