"""The Twinkle Client protocol (`twinkle_client` in twinkle-kit 0.5.1): its JSON bodies, and how
its calls map onto this server's training operations.

Twinkle's client drives a model as a torch training loop does: `forward_backward`, then
`clip_grad_norm`, `step`, `zero_grad` and `lr_step`, gated by `gradient_accumulation_steps`.
The server keeps, per (session, adapter), what that loop would hold (`TwinkleAdapterRecord`) and
runs the same operations a Tinker client's `forward_backward` and `optim_step` run.

- Loss: twinkle's `CrossEntropyLoss` averages over a batch's labelled tokens (`reduction='mean'`)
  or sums them (`'sum'`); Tinker's cross-entropy sums `weights * -logprob`. A batch's weights are
  `1 / labelled tokens` for the mean, 1 for the sum.
- Clipping: twinkle divides the accumulated gradients by what its loss counted since the last clip
  (one per batch for the mean, the labelled tokens for the sum) before taking their norm and
  clipping. The server's step clips the undivided gradients at `max_grad_norm * count`, answers
  the norm divided by `count`, and steps with `eps * count`: AdamW's update of gradients scaled
  by a constant is the same update with eps scaled by it. Adam's weight decay (coupled, an L2
  penalty added to the gradient) is scaled by `count` with it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import msgspec

from protocol import api, rules
from protocol.errors import UserError
from protocol.twinkle_schedule import OptimizerSettings, Scheduler

# A batch of encoded rows, as twinkle's DataLoader yields them: at most this many rows
MAX_ROWS = 4096
LABEL_IGNORED = -100  # twinkle's (and torch's) ignore_index
# LoRA target names of the attention and MLP projections (Qwen, Llama, DeepSeek naming)
_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"})
_MLP = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj"})
_LOSSES: dict[str, tuple[str, ...]] = {"CrossEntropyLoss": ("mean", "sum")}
Reduction = Literal["mean", "sum"]


class Body(msgspec.Struct, frozen=True):
    """A Twinkle request body: every call names its adapter; unknown fields are ignored."""

    adapter_name: str | None = None


class AddAdapterBody(Body, frozen=True):
    config: str | dict[str, Any] | None = None
    gradient_accumulation_steps: int = 1


class ForwardBackwardBody(Body, frozen=True):
    inputs: Any = None


class ClipBody(Body, frozen=True):
    max_grad_norm: float = 1.0
    norm_type: float = 2


class SetLossBody(Body, frozen=True):
    loss_cls: str = ""
    reduction: str = "mean"
    ignore_index: int = LABEL_IGNORED


class SaveBody(Body, frozen=True):
    name: str | None = None
    save_optimizer: bool = False


class LoadBody(Body, frozen=True):
    name: str = ""
    load_optimizer: bool = False


class TwinkleAdapterRecord(msgspec.Struct, frozen=True):
    """What a Twinkle client's training loop holds of one adapter, kept by the gateways."""

    session_id: str
    tenant_id: str
    adapter_name: str
    model_id: str  # the training run its operations go to
    base_model: str
    accumulation_steps: int = 1
    cur_step: int = 0  # backward passes so far (twinkle's `cur_step`)
    count: float = 0.0  # what the loss counted since the last step (see the module docstring)
    clipped: bool = False  # this sync's step already ran, from `clip_grad_norm`
    grad_norm: float = 0.0
    last_loss: float = 0.0
    lr_steps: int = 0  # `lr_step` calls that advanced the scheduler
    optimizer: OptimizerSettings | None = None
    scheduler: Scheduler | None = None
    reduction: Reduction = "mean"
    template_cls: str = ""
    processor_cls: str = ""
    created_at: float = 0.0


def check_adapter_name(value: str | None) -> str:
    if value is None:
        raise UserError("adapter_name: missing (add_adapter_to_model first)")
    return rules.check_checkpoint_name("adapter_name", value)


def lora_config(config: str | dict[str, Any] | None) -> api.LoraConfig:
    """A peft `LoraConfig` as twinkle's client serializes it (a JSON string), as our shape: `r`,
    and which projections `target_modules` names. `lora_alpha` and dropout are not ours to set:
    the adapter scale is the server's, as for Tinker clients."""
    if config is None:
        return api.LoraConfig(rank=8, train_unembed=False)
    fields: Any = config
    if isinstance(config, str):
        try:
            fields = json.loads(config)
        except (ValueError, RecursionError):
            raise UserError("config: not a JSON LoraConfig") from None
    if not isinstance(fields, dict):
        raise UserError("config: not a JSON object")
    rank = fields.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise UserError(f"config.r: {rank!r} is not an integer")
    targets = fields.get("target_modules")
    if targets is None or targets == "all-linear":
        return api.LoraConfig(rank=rank, train_unembed=False)
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError("config.target_modules: 'all-linear' or a list of module names")
    unknown = sorted(set(names) - _ATTENTION - _MLP - {"lm_head"})
    if unknown:
        raise UserError(
            f"config.target_modules: {unknown[:5]} unknown; this server trains"
            f" {sorted(_ATTENTION | _MLP)} and lm_head, or 'all-linear'"
        )
    return api.LoraConfig(
        rank=rank,
        train_attn=bool(_ATTENTION & set(names)),
        train_mlp=bool(_MLP & set(names)),
        train_unembed="lm_head" in names,
    )


def check_loss(body: SetLossBody) -> Reduction:
    reductions = _LOSSES.get(body.loss_cls)
    if reductions is None:
        raise UserError(f"loss_cls: {body.loss_cls[:60]!r} is not supported ({sorted(_LOSSES)})")
    if body.reduction not in reductions:
        raise UserError(f"reduction: {body.reduction[:20]!r} is not one of {list(reductions)}")
    if body.ignore_index != LABEL_IGNORED:
        raise UserError(f"ignore_index: only {LABEL_IGNORED} is supported")
    return "sum" if body.reduction == "sum" else "mean"


class Batch(msgspec.Struct, frozen=True):
    """A twinkle batch as Tinker datums: each row's ids, targets and weights (scaled)."""

    rows: list[tuple[list[int], list[int], list[float]]]
    labelled: int  # the rows' labelled tokens


def twinkle_batch(inputs: Any, reduction: Reduction) -> tuple[Batch, float]:
    """A twinkle batch (a list of encoded rows, or one row) as datums, and what twinkle's loss
    counts for it (see the module docstring).

    A row is an `InputFeature`: `input_ids`, and `labels` already shifted by twinkle's template
    (`labels[i]` is the token after `input_ids[i]`, -100 where nothing is learnt), as twinkle's
    own `input_feature_to_datum` reads it.
    """
    rows = [inputs] if isinstance(inputs, dict) else inputs
    if not isinstance(rows, list) or not rows:
        raise UserError("inputs: a non-empty list of encoded rows (input_ids, labels)")
    if len(rows) > MAX_ROWS:
        raise UserError(f"inputs: {len(rows)} rows; at most {MAX_ROWS} in one call")
    data, labelled = [], 0
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "input_ids" not in row:
            raise UserError(
                f"inputs[{i}]: not an encoded row with input_ids and labels; this server takes"
                " the batches twinkle's template encodes, not trajectories"
            )
        ids, labels = _ints(row["input_ids"], f"inputs[{i}].input_ids"), row.get("labels")
        targets = _ints(labels, f"inputs[{i}].labels") if labels is not None else None
        if targets is None or len(targets) != len(ids):
            raise UserError(f"inputs[{i}].labels: one label per input id")
        if not ids:
            raise UserError(f"inputs[{i}].input_ids: empty")
        weights = [0.0 if t == LABEL_IGNORED else 1.0 for t in targets]
        labelled += int(sum(weights))
        data.append((ids, [0 if t == LABEL_IGNORED else t for t in targets], weights))
    scale = 1.0 / max(labelled, 1) if reduction == "mean" else 1.0
    scaled = [(ids, targets, [w * scale for w in weights]) for ids, targets, weights in data]
    count = 1.0 if reduction == "mean" else float(max(labelled, 1))
    return Batch(rows=scaled, labelled=labelled), count


def tinker_forward_backward(batch: Batch, model_id: str, seq_id: int) -> bytes:
    """The JSON `ForwardBackwardRequest` of `batch` (cross-entropy), as a tinker SDK sends it."""
    body = {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": ids}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": targets, "dtype": "int64", "shape": [len(ids)]},
                        "weights": {"data": weights, "dtype": "float32", "shape": [len(ids)]},
                    },
                }
                for ids, targets, weights in batch.rows
            ],
        },
    }
    return json.dumps(body).encode()


def _ints(value: Any, field: str) -> list[int]:
    if isinstance(value, list) and value and isinstance(value[0], list) and len(value) == 1:
        value = value[0]  # a row of a batch of one
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31 for v in value
    ):
        raise UserError(f"{field}: a list of token ids (32-bit integers)")
    return value


def step_params(record: TwinkleAdapterRecord, lr: float, max_grad_norm: float) -> api.AdamParams:
    """The AdamW step of a sync: the client's settings (torch's defaults), the scheduler's rate,
    and the clip scaled as the module docstring says (`max_grad_norm` 0: no clip)."""
    settings = record.optimizer
    if settings is None:
        raise UserError("step: no optimizer; call set_optimizer first")
    count = record.count if max_grad_norm > 0 and record.count > 0 else 1.0
    if not math.isfinite(max_grad_norm) or max_grad_norm < 0:
        raise UserError(f"max_grad_norm: {max_grad_norm} must be a finite number >= 0")
    return rules.check_adam(
        api.AdamParams(
            learning_rate=lr,
            beta1=settings.beta1,
            beta2=settings.beta2,
            eps=settings.eps * count,
            # Adam's L2 penalty joins the gradient, which is `count` times twinkle's here
            weight_decay=settings.weight_decay * (count if settings.coupled else 1.0),
            grad_clip_norm=max_grad_norm * count,
        )
    )
