"""Loss functions of a forward_backward, by name: each turns target log-probs into a loss.

Job: the registry `LOSSES` (loss_fn name → `LossFn`), each loss's declared inputs and settings,
and the checks a request passes before it joins a pass. The engine computes the learner's
log-prob `lp` of every target token; a `LossFn` maps one datum's `lp` (plus its
`loss_fn_inputs` and resolved settings) to an elementwise loss.

Invariants (Tinker's semantics; docs/compatibility.md lists each loss):
- A datum's loss is a plain SUM of its elementwise loss over positions (and over K for [N, K]
  targets): no mean, no normalisation. A request's loss is the sum over its datums, so results
  do not depend on how the client chunked its data; normalising is the client's job.
- `logprobs` has the shape of `target_tokens` and is computed at every position, weight 0
  included; position i of `model_input` predicts `target_tokens[i]` (no shift here).
- Notation of the RL losses: `q` = the sampler's `logprobs` input, `A` = `advantages`,
  `r = exp(lp − q)` (exp of a difference, never a ratio of exps), `sg` = detach.
- A position with A = 0 adds exactly 0 to the loss and its gradient in IS/PPO/CISPO/GSPO. The
  ratio there is computed from a zeroed log-ratio, so a far off-policy masked token (q ≪ lp,
  r overflowing to inf) cannot turn `inf · 0` into NaN; elsewhere this equals the formula.
- Every request is checked before any pass: a bad one is a one-line `UserError` of the form
  `<field> (<loss_fn>): <problem>`, naming the datum index and the key.

Adding a loss: write its elementwise function and register a `LossFn` listing its inputs and
settings (with defaults).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from protocol.errors import UserError
from protocol.sampling import MAX_LOGPROBS_K
from protocol.tensors import TARGET_TOKENS

LossConfig = Mapping[str, float | str]  # a request's `loss_fn_config` as decoded
Settings = Mapping[str, float]  # the same, checked, with defaults filled in
ElementwiseLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Settings], torch.Tensor]
DatumCheck = Callable[["LossFn", str, Mapping[str, np.ndarray], Settings], None]

CLIP_LOW = "clip_low_threshold"
CLIP_HIGH = "clip_high_threshold"
TRUNCATION = "truncation"


@dataclass(frozen=True)
class LossInput:
    """One `loss_fn_inputs` entry a loss reads: integer ids or float values, shaped like targets."""

    name: str
    kind: Literal["int", "float"]
    required: bool


@dataclass(frozen=True)
class LossFn:
    """A loss by name: its inputs, its settings with their defaults, and its formula."""

    name: str
    inputs: tuple[LossInput, ...]
    elementwise: ElementwiseLoss
    output_type: str
    allows_k_targets: bool = False  # accepts [N, K] target_tokens (and inputs of that shape)
    settings: Mapping[str, float] = field(default_factory=dict)  # loss_fn_config key -> default
    check_datum: DatumCheck | None = None  # loss-specific checks beyond dtype and shape


def _fail(loss: LossFn, where: str, problem: str) -> UserError:
    return UserError(f"{where} ({loss.name}): {problem}")


# -- the formulas ----------------------------------------------------------------------------


def _log_ratio(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`lp − q` where the advantage is non-zero, 0 where it is (see the module invariants)."""
    active = inputs["advantages"] != 0
    return torch.where(active, logprobs - inputs["logprobs"], torch.zeros_like(logprobs))


def _clip_bounds(
    inputs: Mapping[str, torch.Tensor], settings: Settings, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token thresholds where the datum sends them, else the request's settings.

    The SDK's dtype table lists `clip_low_threshold` / `clip_high_threshold` as per-token float32
    `loss_fn_inputs` (losses.md §1.1, [INF]); a datum's tensor takes precedence over the scalar.
    """
    low = inputs.get(CLIP_LOW)
    high = inputs.get(CLIP_HIGH)
    return (
        low if low is not None else torch.full_like(like, settings[CLIP_LOW]),
        high if high is not None else torch.full_like(like, settings[CLIP_HIGH]),
    )


def _cross_entropy(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], settings: Settings
) -> torch.Tensor:
    # ℓ = −w·lp. `weights` is optional (undocumented, §2.1 [INF]): absent means 1 everywhere.
    weights = inputs.get("weights")
    if weights is None:
        return -logprobs
    return -(weights * logprobs)


def _importance_sampling(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], settings: Settings
) -> torch.Tensor:
    # ℓ = −r·A, the ratio not detached: ∂ℓ/∂lp = −r·A.
    elementwise = -(torch.exp(_log_ratio(logprobs, inputs)) * inputs["advantages"])
    # Whether IS takes `weights` is unknown (§1.6): the docs' RL example sends them next to
    # `advantages` as the prompt/completion mask. We accept them and multiply, which equals the
    # documented formula whenever they agree with the advantages' masking.
    weights = inputs.get("weights")
    return elementwise if weights is None else weights * elementwise


def _ppo(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], settings: Settings
) -> torch.Tensor:
    # ℓ = −min(r·A, clamp(r, lo, hi)·A), token-wise; lo/hi are absolute ratio bounds.
    advantages = inputs["advantages"]
    ratio = torch.exp(_log_ratio(logprobs, inputs))
    low, high = _clip_bounds(inputs, settings, ratio)
    return -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def _cispo(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], settings: Settings
) -> torch.Tensor:
    # ℓ = −sg[clamp(r, lo, hi)]·lp·A: the gradient is bounded, never zeroed.
    ratio = torch.exp(_log_ratio(logprobs, inputs))
    low, high = _clip_bounds(inputs, settings, ratio)
    return -(torch.clamp(ratio, low, high).detach() * logprobs * inputs["advantages"])


def _dro(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], settings: Settings
) -> torch.Tensor:
    # ℓ = −(lp·A − ½β(lp − q)²). The penalty applies at A = 0 positions too (measured on the
    # live service, §2.5): a prompt padded with q = 0 adds ½β·lp². Reproduced, not "fixed".
    penalty = 0.5 * settings["beta"] * (logprobs - inputs["logprobs"]) ** 2
    return -(logprobs * inputs["advantages"] - penalty)


def _gspo(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], settings: Settings
) -> torch.Tensor:
    # GSPO-token (§2.6): one sequence ratio s per datum, the geometric mean of the token ratios
    # over the mask M; ρ_t = exp(log s + lp_t − sg[lp_t]) has value s and gradient s·∂lp_t.
    # ℓ_t = −min(ρ_t·A_t, clamp(ρ_t, lo, hi)·A_t), summed over all t (the clamp/min lines
    # follow the docs' objective, [INF]). One datum is one sequence, merged turns included.
    advantages = inputs["advantages"]
    selected = inputs["sequence_ratio_mask"] != 0  # a boolean mask, not weights
    detached = logprobs.detach()
    log_s = (detached - inputs["logprobs"])[selected].mean()
    log_rho = torch.where(advantages != 0, log_s + logprobs - detached, torch.zeros_like(logprobs))
    rho = torch.exp(log_rho)
    clipped = torch.clamp(rho, settings[CLIP_LOW], settings[CLIP_HIGH])
    return -torch.min(rho * advantages, clipped * advantages)


def _stable_reinforce(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], settings: Settings
) -> torch.Tensor:
    # Ours (the service's formula is unpublished; docs/compatibility.md): REINFORCE with a
    # token-level truncated importance weight w = min(r, C), r = exp(lp − q), q the sampler's
    # log-prob as the server recorded it (`protocol.stability`). ℓ = −sg(w)·exp(lp − sg(lp))·A:
    # its value is −w·A (importance_sampling's −r·A while r ≤ C) and its gradient −w·A·∂lp, so
    # a stale token's weight is bounded by C but never zeroed, and on-policy (r = 1) it is
    # exactly the policy gradient. The weight comes from a log-ratio clamped at log C before
    # the exp, so no far off-policy token can overflow.
    log_ratio = _log_ratio(logprobs, inputs).detach()
    weight = torch.exp(torch.clamp(log_ratio, max=math.log(settings[TRUNCATION])))
    return -(weight * torch.exp(logprobs - logprobs.detach()) * inputs["advantages"])


# -- loss-specific datum checks ----------------------------------------------------------------


def _check_clip_order(
    loss: LossFn, prefix: str, inputs: Mapping[str, np.ndarray], settings: Settings
) -> None:
    """Per-token thresholds: no position's low bound above its high one (the settings' own
    order is checked in `resolve_config`)."""
    if CLIP_LOW not in inputs and CLIP_HIGH not in inputs:
        return
    low = inputs.get(CLIP_LOW, np.float32(settings[CLIP_LOW]))
    high = inputs.get(CLIP_HIGH, np.float32(settings[CLIP_HIGH]))
    bad = np.flatnonzero(np.broadcast_to(low > high, np.broadcast_shapes(low.shape, high.shape)))
    if bad.size:
        key = CLIP_LOW if CLIP_LOW in inputs else CLIP_HIGH
        raise _fail(
            loss,
            f"{prefix}.{key}",
            f"{CLIP_LOW} above {CLIP_HIGH} at position {bad[0]}",
        )


def _check_sequence_mask(
    loss: LossFn, prefix: str, inputs: Mapping[str, np.ndarray], settings: Settings
) -> None:
    # An empty mask has no sequence ratio (the mean of nothing); rejected rather than guessed.
    if not np.any(inputs["sequence_ratio_mask"] != 0):
        raise _fail(
            loss,
            f"{prefix}.sequence_ratio_mask",
            "no non-zero entry; mark the sampled tokens with 1 or leave this datum out",
        )


def _check_truncation(
    loss: LossFn, prefix: str, inputs: Mapping[str, np.ndarray], settings: Settings
) -> None:
    if not settings[TRUNCATION] >= 1.0:
        raise _fail(
            loss,
            f"loss_fn_config.{TRUNCATION}",
            f"{settings[TRUNCATION]} must be >= 1 (the largest importance weight a token gets)",
        )


# -- the registry --------------------------------------------------------------------------------

_TARGETS = LossInput(TARGET_TOKENS, "int", True)
_RL_INPUTS = (
    _TARGETS,
    LossInput("logprobs", "float", True),
    LossInput("advantages", "float", True),
)
_CLIP_INPUTS = (LossInput(CLIP_LOW, "float", False), LossInput(CLIP_HIGH, "float", False))

CROSS_ENTROPY = LossFn(
    name="cross_entropy",
    inputs=(_TARGETS, LossInput("weights", "float", False)),
    elementwise=_cross_entropy,
    output_type="CrossEntropyLossReturn",
    allows_k_targets=True,
)
IMPORTANCE_SAMPLING = LossFn(
    name="importance_sampling",
    inputs=(*_RL_INPUTS, LossInput("weights", "float", False)),
    elementwise=_importance_sampling,
    output_type="ImportanceSamplingLossReturn",
    # [N, K] for all inputs is in the older docs (§2.2); the formula is the same, elementwise.
    allows_k_targets=True,
)
PPO = LossFn(
    name="ppo",
    inputs=(*_RL_INPUTS, *_CLIP_INPUTS),
    elementwise=_ppo,
    output_type="PPOLossReturn",
    settings={CLIP_LOW: 0.8, CLIP_HIGH: 1.2},
    check_datum=_check_clip_order,
)
CISPO = LossFn(
    name="cispo",
    inputs=(*_RL_INPUTS, *_CLIP_INPUTS),
    elementwise=_cispo,
    output_type="CISPOLossReturn",
    settings={CLIP_LOW: 0.0, CLIP_HIGH: 4.0},  # the current docs' defaults (§2.4)
    check_datum=_check_clip_order,
)
DRO = LossFn(
    name="dro",
    # `weights` is rejected, as the live service does (§2.5).
    inputs=_RL_INPUTS,
    elementwise=_dro,
    output_type="DROLossReturn",
    # The default beta is not confirmed (§2.5 [INF]): 0.05, the docs' example and the value
    # in a Thinking Machines recipe README.
    settings={"beta": 0.05},
)
GSPO = LossFn(
    name="gspo",
    inputs=(*_RL_INPUTS, LossInput("sequence_ratio_mask", "float", True)),
    elementwise=_gspo,
    output_type="GSPOLossReturn",
    # Key names as in the docs' code (PPO's names); the defaults are unpublished (§2.6). We use
    # the GSPO paper's bounds, 1 − 3e-4 and 1 + 4e-4, the only GSPO-specific defaults documented
    # (the cookbook's GSPO recipe); PPO's 0.8/1.2 would almost never clip a sequence ratio.
    settings={CLIP_LOW: 1.0 - 3e-4, CLIP_HIGH: 1.0 + 4e-4},
    check_datum=_check_sequence_mask,
)

STABLE_REINFORCE = LossFn(
    name="stable_reinforce",
    # `logprobs` is filled in by the server from its records (`protocol.stability`); a value the
    # client sends there is replaced.
    inputs=_RL_INPUTS,
    elementwise=_stable_reinforce,
    output_type="StableReinforceLossReturn",
    # C = 2, the truncation of truncated importance sampling for off-policy LLM RL (Yao et al.,
    # 2025, "Your efficient RL framework secretly brings you off-policy RL training").
    settings={TRUNCATION: 2.0},
    check_datum=_check_truncation,
)

LOSSES: dict[str, LossFn] = {
    loss.name: loss
    for loss in (CROSS_ENTROPY, IMPORTANCE_SAMPLING, PPO, CISPO, DRO, GSPO, STABLE_REINFORCE)
}


def get_loss(name: str) -> LossFn:
    """The registered loss, or a `UserError` naming the supported names."""
    loss = LOSSES.get(name)
    if loss is not None:
        return loss
    raise UserError(f"unknown loss_fn {name!r}; supported: {', '.join(LOSSES)}")


def resolve_config(loss: LossFn, config: LossConfig) -> dict[str, float]:
    """The loss's settings: `config` checked (no unknown key, finite numbers), defaults filled."""
    settings = dict(loss.settings)
    for key, value in config.items():
        where = f"loss_fn_config.{key}"
        if key not in loss.settings:
            accepted = ", ".join(loss.settings) or "none"
            raise _fail(loss, where, f"not a setting of {loss.name} (accepted: {accepted})")
        if isinstance(value, str) or not math.isfinite(value):
            raise _fail(loss, where, f"{value!r} is not a finite number")
        settings[key] = float(value)
    if CLIP_LOW in settings and settings[CLIP_LOW] > settings[CLIP_HIGH]:
        raise _fail(
            loss,
            f"loss_fn_config.{CLIP_LOW}",
            f"{settings[CLIP_LOW]} is above {CLIP_HIGH} {settings[CLIP_HIGH]}",
        )
    return settings


def check_inputs(
    loss: LossFn,
    settings: Settings,
    index: int,
    n_tokens: int,
    inputs: Mapping[str, np.ndarray],
    vocab_size: int,
) -> None:
    """Check one datum's `loss_fn_inputs` against what `loss` reads; raise a `UserError`."""
    prefix = f"datums[{index}].loss_fn_inputs"
    declared = {spec.name: spec for spec in loss.inputs}
    for name in inputs:
        if name not in declared:
            hint = "; mask positions with advantages = 0" if name == "weights" else ""
            raise _fail(
                loss,
                f"{prefix}.{name}",
                f"not an input of {loss.name} (accepted: {', '.join(declared)}){hint}",
            )
    target_shape: tuple[int, ...] | None = None
    for spec in loss.inputs:
        array = inputs.get(spec.name)
        where = f"{prefix}.{spec.name}"
        if array is None:
            if spec.required:
                required = ", ".join(s.name for s in loss.inputs if s.required)
                raise _fail(loss, where, f"missing; {loss.name} requires {required}")
            continue
        if spec.kind == "int" and array.dtype.kind not in "iu":
            raise _fail(loss, where, f"dtype {array.dtype}, expected integer token ids (int64)")
        if spec.kind == "float" and array.dtype.kind != "f":
            raise _fail(loss, where, f"dtype {array.dtype}, expected float32")
        _check_shape(loss, where, array, n_tokens)
        if target_shape is None:
            target_shape = array.shape
        elif array.shape != target_shape:
            raise _fail(
                loss, where, f"shape {array.shape} differs from target_tokens {target_shape}"
            )
        if spec.kind == "float" and not np.isfinite(array).all():
            raise _fail(loss, where, "contains NaN or infinity")
    targets = inputs[TARGET_TOKENS]
    if targets.size:
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise _fail(
                loss,
                f"{prefix}.{TARGET_TOKENS}",
                f"id {bad} outside the vocabulary [0, {vocab_size})",
            )
    if loss.check_datum is not None:
        loss.check_datum(loss, prefix, inputs, settings)


def _check_shape(loss: LossFn, where: str, array: np.ndarray, n_tokens: int) -> None:
    if array.ndim == 2 and not loss.allows_k_targets:
        raise _fail(loss, where, f"shape {array.shape}; {loss.name} takes one value per token")
    if array.ndim not in (1, 2):
        raise _fail(loss, where, f"shape {array.shape}, expected [N] or [N, K]")
    if array.shape[0] != n_tokens:
        raise _fail(loss, where, f"length {array.shape[0]} != {n_tokens} model_input tokens")
    if array.ndim == 2 and not 1 <= array.shape[1] <= MAX_LOGPROBS_K:
        # The gateway refuses it too (`protocol.tensors.check_target_width`); this guards a
        # job that did not come through it: a pass pads every datum to the widest K it holds.
        raise _fail(
            loss,
            where,
            f"shape {array.shape} has K = {array.shape[1]} values per position;"
            f" K must be in 1..{MAX_LOGPROBS_K}",
        )
