"""Loss functions of a forward_backward, by name: each turns target log-probs into a loss.

Job: the registry `LOSSES` (loss_fn name → `LossFn`) and the per-datum input checks each loss
declares. The engine computes the learner's log-prob of every target token; a `LossFn` only
maps those (plus its `loss_fn_inputs` and `loss_fn_config`) to an elementwise loss.

Invariants (Tinker semantics, reference/losses.md §1):
- A datum's loss is a plain SUM of its elementwise loss over positions (and over K for [N, K]
  targets): no mean, no normalisation. A request's loss is the sum over its datums, so results
  do not depend on how the client chunked its data; normalising is the client's job (weights).
- `logprobs` has the shape of `target_tokens` and is computed at every position, weight 0
  included; position i of `model_input` predicts `target_tokens[i]` (no shift here).
- Inputs are checked before any pass: a bad one is a `UserError` naming the datum and field.

Adding a loss: write its elementwise function and register a `LossFn` listing its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from protocol.errors import UserError

LossConfig = Mapping[str, float | str]
ElementwiseLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], LossConfig], torch.Tensor]

TARGET_TOKENS = "target_tokens"


@dataclass(frozen=True)
class LossInput:
    """One `loss_fn_inputs` entry a loss reads: integer ids or float values, shaped like targets."""

    name: str
    kind: Literal["int", "float"]
    required: bool


@dataclass(frozen=True)
class LossFn:
    """A loss by name: its inputs, its settings, and its elementwise formula."""

    name: str
    inputs: tuple[LossInput, ...]
    elementwise: ElementwiseLoss
    output_type: str
    allows_k_targets: bool = False  # accepts [N, K] target_tokens
    config_keys: frozenset[str] = frozenset()


def _cross_entropy(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: LossConfig
) -> torch.Tensor:
    weights = inputs.get("weights")
    if weights is None:
        return -logprobs
    return -(weights * logprobs)


CROSS_ENTROPY = LossFn(
    name="cross_entropy",
    inputs=(LossInput(TARGET_TOKENS, "int", True), LossInput("weights", "float", False)),
    elementwise=_cross_entropy,
    output_type="CrossEntropyLossReturn",
    allows_k_targets=True,
)

LOSSES: dict[str, LossFn] = {loss.name: loss for loss in (CROSS_ENTROPY,)}


def get_loss(name: str) -> LossFn:
    """The registered loss, or a `UserError` listing the supported names."""
    loss = LOSSES.get(name)
    if loss is None:
        raise UserError(f"unknown loss_fn {name!r}; supported: {', '.join(sorted(LOSSES))}")
    return loss


def check_config(loss: LossFn, config: LossConfig) -> None:
    """Reject settings the loss does not have (a typo would otherwise be silently ignored)."""
    for key in config:
        if key not in loss.config_keys:
            accepted = ", ".join(sorted(loss.config_keys)) or "none"
            raise UserError(
                f"loss_fn_config.{key}: not a setting of {loss.name} (accepted: {accepted})"
            )


def check_inputs(
    loss: LossFn, index: int, n_tokens: int, inputs: Mapping[str, np.ndarray], vocab_size: int
) -> None:
    """Check one datum's `loss_fn_inputs` against what `loss` reads; raise a `UserError`."""
    prefix = f"datums[{index}].loss_fn_inputs"
    declared = {spec.name: spec for spec in loss.inputs}
    for name in inputs:
        if name not in declared:
            raise UserError(
                f"{prefix}.{name}: not an input of {loss.name} (accepted: {', '.join(declared)})"
            )
    target_shape: tuple[int, ...] | None = None
    for spec in loss.inputs:
        array = inputs.get(spec.name)
        field = f"{prefix}.{spec.name}"
        if array is None:
            if spec.required:
                raise UserError(f"{field}: missing, required by {loss.name}")
            continue
        if spec.kind == "int" and array.dtype.kind not in "iu":
            raise UserError(f"{field}: dtype {array.dtype}, expected integer token ids")
        if spec.kind == "float" and array.dtype.kind != "f":
            raise UserError(f"{field}: dtype {array.dtype}, expected float32")
        _check_shape(loss, field, array, n_tokens)
        if target_shape is None:
            target_shape = array.shape
        elif array.shape != target_shape:
            raise UserError(
                f"{field}: shape {array.shape} differs from target_tokens {target_shape}"
            )
        if spec.kind == "float" and not np.isfinite(array).all():
            raise UserError(f"{field}: contains NaN or infinity")
    targets = inputs.get(TARGET_TOKENS)
    if targets is not None and targets.size:
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise UserError(
                f"{prefix}.{TARGET_TOKENS}: id {bad} outside the vocabulary [0, {vocab_size})"
            )


def _check_shape(loss: LossFn, field: str, array: np.ndarray, n_tokens: int) -> None:
    if array.ndim == 2 and not loss.allows_k_targets:
        raise UserError(f"{field}: shape {array.shape}; {loss.name} takes one value per token")
    if array.ndim not in (1, 2):
        raise UserError(f"{field}: shape {array.shape}, expected [N] or [N, K]")
    if array.shape[0] != n_tokens:
        raise UserError(f"{field}: length {array.shape[0]} != {n_tokens} model_input tokens")
    if array.ndim == 2 and array.shape[1] == 0:
        raise UserError(f"{field}: shape {array.shape} has no targets per position")
