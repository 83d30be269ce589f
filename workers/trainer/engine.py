"""The trainer engine: tenants' LoRA adapters on one frozen base model, trained in shared passes.

Job: the shared forward/backward pass and the fused optimizer step, nothing else. The worker
service calls it synchronously from one dedicated thread; nothing here is thread-safe or
asynchronous. Which slot each tenant holds, parking and snapshots are `workers.trainer.residency`'s
(`self.slots`); checkpoint files of a slot are `workers.trainer.slot_checkpoints`'s.

Step 1 (`create` / `load`, delegated to `self.slots`): a model_id takes a slot of the `LoraBank`.
Step 2 (`validate`): a request is checked before it joins a pass; a bad field is a `UserError`
        naming the datum and the field.
Step 3 (`forward_backward`): rows are packed tenant by tenant (one contiguous segment per slot),
        right-padded, with an attention mask; the routing binds the segments; the pass's loss is
        the sum of every training item's own summed loss, so each slot receives exactly the
        gradient of its solo pass. Gradients accumulate in the slot until its optim_step.
        A training item whose loss or slot gradient is not finite fails alone (`UserError`)
        and its slot's gradients are restored from a copy taken before the pass.
Step 4 (`optim_step`): one fused AdamW step over the stepping slots, each with its own settings;
        a step that cannot be applied (overflow, non-finite gradient or update) fails alone and
        leaves its slot exactly as it was (`workers.engine.optimizer`).

A call naming more tenants than there are slots runs as several sub-passes (or sub-steps) of at
most `max_slots` tenants (`sub_calls`), with results in request order.

Transactions: one sub-pass or sub-step is a transaction per tenant. A tenant's failure is its own
result and leaves its slot as it was; a sub-call that raises (a fault not pinned on one item) has
changed no state, so the caller may re-run its items in smaller groups to find the culprit
(`workers.engine.isolation`, used by the service one sub-call at a time). Slots a pass does not train
receive exact zeros from the backward: their values never change (a -0.0 may become +0.0).

Invariants: the base model is frozen and in eval mode (no dropout); adapters, gradients and
moments are fp32; a forward_only item contributes no gradient; a request that fails validation
changes no state; a snapshot slot is never trained, stepped or saved.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from protocol.api import AdamParams, LoraConfig
from protocol.errors import ServerError, TwinkleError, UserError
from protocol.images import VisionGeometry
from protocol.rules import check_adam
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest
from workers.engine.collective import Collective
from workers.engine.custom_loss import check_request as check_custom_request
from workers.engine.expert_parallel import split_experts
from workers.engine.frozen_shards import shard_frozen_linears
from workers.engine.lora import ExpertSlice, LoraBank, SlotRouting, lay_out_slot
from workers.engine.losses import check_inputs, get_loss, resolve_config
from workers.engine.optimizer import SlotAdamW
from workers.engine.passes import CUSTOM, PassResults, PassRunner, not_finite
from workers.engine.vision import VisionTower
from workers.trainer.layouts import own_state, whole_state
from workers.trainer.memory import free_memory, plan_slots
from workers.trainer.parking import ParkedAdapters, SlotState
from workers.trainer.residency import Residency
from workers.trainer.slot_checkpoints import SlotCheckpoints

log = logging.getLogger(__name__)


def load_causal_lm(base_model: str, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of `base_model`: its text model where transformers has a causal-LM class
    for it (a Qwen3.5 composite loads its language model so), else, for a vision-language
    model without one (Qwen3-VL), the composite itself, whose decoder and output layer the
    passes run and whose vision tower the engine's `VisionTower` uses."""
    config = AutoConfig.from_pretrained(base_model)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and hasattr(config, "vision_config"):
        composite: PreTrainedModel = AutoModelForImageTextToText.from_pretrained(
            base_model, dtype=dtype
        )
        return composite
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    return model


def _load(
    base_model: str, dtype: torch.dtype, device: torch.device, collective: Collective
) -> tuple[PreTrainedModel, dict[str, ExpertSlice]]:
    """The frozen base model on `device`, with this rank's share of it: a MoE model's experts
    (`workers.engine.expert_parallel`), else a dense model's decoder linears
    (`workers.engine.frozen_shards`); the whole model on one device. Loaded on the host and cut
    there, so a device never holds more than its share."""
    model = load_causal_lm(base_model, dtype)
    model.requires_grad_(False)
    model.eval()  # type: ignore[no-untyped-call]
    slices = split_experts(model, collective)
    if not slices:  # a dense model: its frozen decoder linears are split instead
        shard_frozen_linears(model, collective)
    model.to(device)  # type: ignore[arg-type]  # transformers types `to` as a decorator
    gc.collect()  # the parts of the model other ranks hold, before the next rank loads
    return model, slices


class Engine:
    """One base model, its adapter bank, the shared pass and the fused step."""

    def __init__(
        self,
        base_model: str,
        *,
        max_slots: int | None = 8,
        max_rank: int = 32,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        lora_alpha: float = 32.0,
        max_parked: int | None = None,
        pass_tokens: int = 16384,
        logits_chunk_elements: int | None = None,
        collective: Collective | None = None,
    ) -> None:
        if (max_slots is not None and max_slots < 1) or max_rank < 1:
            raise ValueError(f"max_slots={max_slots} and max_rank={max_rank} must be >= 1")
        if max_parked is not None and max_parked < 0:
            raise ValueError(f"max_parked={max_parked} must be >= 0 (or None: unbounded)")
        self.device = torch.device(device)
        # bf16 where it is fast; fp32 on the CPU, where results must match references exactly.
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        # A rank of a worker group keeps its share of the model; the ranks load in turns, so
        # the host holds one whole model at a time (`_load`).
        self.collective = collective or Collective()
        model, slices = self.collective.in_turns(
            lambda: _load(base_model, self.dtype, self.device, self.collective)
        )
        text_config = model.config.get_text_config()
        self.base_model = base_model
        self.vocab_size = int(text_config.vocab_size)
        self.max_context = int(text_config.max_position_embeddings)
        self.arch = str(model.config.model_type)
        if max_slots is None:
            # planned from what the device holds once the base model is on it
            plan = plan_slots(free_memory(self.device), lay_out_slot(model, max_rank, slices)[1])
            log.info("%s: %s", base_model, plan.describe())
            # the ranks of a group hold as many slots as the fullest of them holds
            max_slots = -self.collective.agree_max([-plan.max_slots])[0]
        self.max_slots = max_slots
        self.max_rank = max_rank
        self.lora_alpha = float(lora_alpha)
        self.routing = SlotRouting()
        self.bank = LoraBank(
            model,
            max_slots=max_slots,
            max_rank=max_rank,
            routing=self.routing,
            device=self.device,
            slices=slices,
            collective=self.collective,
        )
        self.optimizer = SlotAdamW(
            self.bank.weights,
            self.bank.grads,
            collective=self.collective,
            per_expert_start=self.bank.per_expert_start,
        )
        # The trained slots' gradient rows as a pass found them (see `_shared_pass`): one
        # buffer for the life of the engine, so a pass neither allocates nor faults it in.
        self._pending = torch.empty_like(self.bank.grads)
        files = SlotCheckpoints(
            self.bank,
            self.optimizer,
            base_model=base_model,
            linear_paths=[p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)],
        )
        self.slots = Residency(
            self.bank, self.optimizer, files, lora_alpha=self.lora_alpha, max_parked=max_parked
        )
        self.model = model
        least = 1
        if logits_chunk_elements is None:
            # One chunk's fp32 logits: 8 MiB on the CPU (under `tune_malloc`'s threshold: the
            # heap reuses it), 256 MiB on a GPU; at least 64 tokens (a large vocabulary's
            # output layer is read once a chunk).
            logits_chunk_elements = 2**26 if self.device.type == "cuda" else 2**21
            least = 64
        # A vision-language model's frozen vision tower, beside its text model (None: text)
        self.vision = VisionTower.load(base_model, self.dtype, str(self.device), model=model)
        self.passes = PassRunner(
            model,
            self.routing,
            self.device,
            pass_tokens=pass_tokens,
            chunk_tokens=max(least, logits_chunk_elements // self.vocab_size),
            vision=self.vision,
        )

    @property
    def geometry(self) -> VisionGeometry | None:
        """The image geometry and limits of the requests this engine takes images in (None:
        a text model, which takes none)."""
        return None if self.vision is None else self.vision.geometry

    @property
    def pass_tokens(self) -> int:
        """The most token positions one pass computes (a longer datum runs alone)."""
        return self.passes.pass_tokens

    @pass_tokens.setter
    def pass_tokens(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"pass_tokens={value} must be >= 1")
        self.passes.pass_tokens = value

    # -- slots, snapshots and checkpoints: `self.slots` ----------------------------------------
    # Thin delegates: the service and the samplers hold one engine handle on the engine thread.

    @property
    def parked(self) -> ParkedAdapters:
        return self.slots.parked

    def create(self, model_id: str, spec: LoraConfig) -> None:
        self.slots.create(model_id, spec)

    def has(self, model_id: str) -> bool:
        return self.slots.has(model_id)

    def spec(self, model_id: str) -> LoraConfig:
        return self.slots.spec(model_id)

    def slot(self, model_id: str) -> int:
        return self.slots.slot(model_id)

    def slots_used(self) -> int:
        return self.slots.slots_used()

    def adapters_total(self) -> int:
        return self.slots.adapters_total()

    def release(self, model_id: str) -> None:
        self.slots.release(model_id)

    def save(
        self,
        model_id: str,
        directory: Path,
        *,
        kind: Literal["weights", "sampler_weights"],
        meta: dict[str, Any],
    ) -> int:
        return self.slots.save(model_id, directory, kind=kind, meta=meta)

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> LoraConfig:
        return self.slots.load(model_id, directory, with_optimizer=with_optimizer)

    def load_snapshot(self, key: str, directory: Path) -> None:
        self.slots.load_snapshot(key, directory)

    def capture(self, model_id: str) -> SlotState:
        """A host copy of the adapter's whole state, in one device's layout whatever this
        engine's share of the experts (`workers.trainer.layouts`): what a snapshot holds."""
        state = self.slots.capture(model_id)
        return whole_state(self.bank, state) if self.collective.parallel else state

    def adopt(self, model_id: str, state: SlotState) -> None:
        """Take a state in one device's layout (a snapshot) as this model's adapter."""
        self.slots.adopt(model_id, own_state(self.bank, state) if self.bank.slices else state)

    def has_snapshot(self, key: str) -> bool:
        return self.slots.has_snapshot(key)

    def snapshot_slot(self, key: str) -> int:
        return self.slots.snapshot_slot(key)

    def snapshot_capacity(self) -> int:
        return self.slots.snapshot_capacity()

    def drop_snapshot(self, key: str) -> None:
        self.slots.drop_snapshot(key)

    # -- requests ----------------------------------------------------------------------------

    def validate(self, model_id: str, req: FwdBwdRequest) -> None:
        """Raise a `UserError` naming the field if `req` cannot run; changes nothing."""
        self.slots.spec(model_id)
        custom = req.loss_fn == CUSTOM  # its checks need the datums' tokens checked first
        loss = None if custom else get_loss(req.loss_fn)
        settings = {} if loss is None else resolve_config(loss, req.loss_fn_config)
        if not req.datums:
            raise UserError("datums: the request has no datums")
        for index, datum in enumerate(req.datums):
            self._check_tokens(index, datum)
            if loss is not None:
                n_tokens = int(datum.tokens.shape[0])
                check_inputs(loss, settings, index, n_tokens, datum.inputs, self.vocab_size)
        if custom:
            check_custom_request(req, self.vocab_size)

    def _check_tokens(self, index: int, datum: DatumArrays) -> None:
        field = f"datums[{index}].model_input"
        tokens = datum.tokens
        self._check_images(field, datum)
        if tokens.dtype.kind not in "iu":
            raise UserError(f"{field}: dtype {tokens.dtype}, expected integer token ids")
        if tokens.ndim != 1:
            raise UserError(f"{field}: shape {tokens.shape}, expected one token sequence")
        if tokens.shape[0] == 0:
            raise UserError(f"{field}: empty")
        if tokens.shape[0] > self.max_context:
            raise UserError(
                f"{field}: {tokens.shape[0]} tokens exceed the model's context of {self.max_context}"
            )
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise UserError(
                f"{field}: token id {bad} outside the vocabulary [0, {self.vocab_size})"
            )

    def _check_images(self, field: str, datum: DatumArrays) -> None:
        """A text model takes no image; a VL model's image placeholder tokens stand exactly
        where its images are (a stray one would take another tenant's pass down)."""
        if datum.images and self.vision is None:
            raise UserError(f"{field}: {self.base_model} is a text model and takes no images")
        if self.vision is None:
            return
        where = np.zeros(datum.tokens.shape[0], dtype=bool)
        for image in datum.images:
            if image.start < 0 or image.start + image.n_tokens > where.shape[0]:
                raise UserError(f"{field}: an image outside the datum's tokens")
            where[image.start : image.start + image.n_tokens] = True
        placeholders = datum.tokens == self.vision.image_token_id
        if not np.array_equal(placeholders, where):
            at = int(np.flatnonzero(placeholders != where)[0])
            raise UserError(
                f"{field}: token {at} is the image placeholder id "
                f"{self.vision.image_token_id} outside an image, or an image's token is not it"
            )

    def forward_backward(
        self, batch: list[tuple[str, FwdBwdRequest]]
    ) -> list[FwdBwdOutput | TwinkleError]:
        """One shared pass over every item; gradients of training items accumulate per slot.

        Per item: its outputs, or the `UserError` of a training item whose loss or gradient is
        not finite (its slot's gradients are then exactly as before). Items of more tenants than
        there are slots run as several passes (see `sub_calls`), each its own transaction.
        """
        if not batch:
            return []
        for model_id, req in batch:
            self.validate(model_id, req)
        results: dict[int, FwdBwdOutput | TwinkleError] = {}
        for indices in self.sub_calls([model_id for model_id, _ in batch]):
            sub_batch = [batch[index] for index in indices]
            results.update(zip(indices, self._shared_pass(sub_batch), strict=True))
        return [results[index] for index in range(len(batch))]

    def sub_calls(self, model_ids: list[str]) -> list[list[int]]:
        """A call's item indices in runs of at most `max_slots` tenants, resident ones first.

        Each run is one pass (or one fused step) and one transaction: a call of one run that
        raises has changed no state, so a caller may retry its items in smaller groups.
        """
        return self.slots.sub_calls(model_ids)

    def _shared_pass(
        self, batch: list[tuple[str, FwdBwdRequest]]
    ) -> list[FwdBwdOutput | TwinkleError]:
        """The passes over validated items of at most `max_slots` tenants, as a transaction.

        The pending gradient rows of the slots this call trains are copied first. A training
        item that fails (a non-finite loss) after some of its datums already added gradient
        gives its slot its copy back, and that slot's other training items run again without
        it. After the backward, a slot whose row is not finite fails its training items and
        gets its copy back, as does a slot none of whose training items succeeded (so not even
        the sign of a zero changes); a call that raises restores every one of them first.
        """
        tenants = self.slots.resident([model_id for model_id, _ in batch])
        slots = [tenant.slot for tenant in tenants]
        training_items: dict[int, list[int]] = {}  # slot → its training items
        for index, ((_, req), slot) in enumerate(zip(batch, slots, strict=True)):
            if not req.forward_only:
                training_items.setdefault(slot, []).append(index)
        trained = sorted(training_items)
        pending = self._pending[: len(trained)]
        if trained:
            rows = torch.tensor(trained, dtype=torch.long, device=self.bank.grads.device)
            torch.index_select(self.bank.grads, 0, rows, out=pending)
        row_of = {slot: row for row, slot in enumerate(trained)}
        try:
            ran = self._run_pass(batch, slots)
            results = ran.results
            tainted = {
                slots[index]
                for index in ran.contributed
                if isinstance(results[index], TwinkleError)
            }
            if tainted:
                again = [
                    index
                    for slot in sorted(tainted)
                    for index in training_items[slot]
                    if not isinstance(results[index], TwinkleError)
                ]
                for slot in tainted:
                    self.bank.grads[slot].copy_(pending[row_of[slot]])
                if again:
                    rerun = self._run_pass([batch[i] for i in again], [slots[i] for i in again])
                    for index, result in zip(again, rerun.results, strict=True):
                        results[index] = result
                    for position, index in enumerate(again):
                        if position in rerun.contributed and isinstance(
                            rerun.results[position], TwinkleError
                        ):
                            # Failed only in the second run (rounding at the edge of float32):
                            # the whole slot fails rather than keep part of its gradient.
                            for other in training_items[slots[index]]:
                                results[other] = not_finite("loss", "float32 overflow")
            # each rank's share of the experts' shared factors, summed (expert parallelism)
            self.bank.reduce_expert_gradients(trained, pending)
            failed_rows = self._failed_rows(trained)
            for row, slot in enumerate(trained):
                items = training_items[slot]
                if slot in failed_rows:
                    for index in items:
                        if not isinstance(results[index], TwinkleError):
                            results[index] = not_finite("gradient", "an overflow in float32")
                if all(isinstance(results[index], TwinkleError) for index in items):
                    self.bank.grads[slot].copy_(pending[row])
            return results
        except BaseException:
            for row, slot in enumerate(trained):
                self.bank.grads[slot].copy_(pending[row])
            raise

    def _run_pass(self, batch: list[tuple[str, FwdBwdRequest]], slots: list[int]) -> PassResults:
        """Forward, losses and backward of every item, in passes of `pass_tokens` positions."""
        return self.passes.run(batch, slots)

    def _failed_rows(self, slots: list[int]) -> set[int]:
        """The slots whose gradient row holds NaN or inf (one device sync).

        A row's sum is NaN or inf whenever one of its values is, so one summing read clears
        almost every row; only a row whose sum is not finite (its finite values may overflow
        the sum) is checked value by value.
        """
        if not slots:
            return set()
        sums = torch.stack([self.bank.grads[slot].sum() for slot in slots]).isfinite().tolist()
        failed = [
            not ok and not bool(self.bank.grads[slot].isfinite().all())
            for slot, ok in zip(slots, sums, strict=True)
        ]
        # in a worker group a row is whole only over the ranks: a slot fails on all or none
        return {slot for slot, bad in zip(slots, self.collective.agree(failed), strict=True) if bad}

    def validate_optim_step(self, model_id: str, adam: AdamParams) -> None:
        """Raise a `UserError` (or `NotFound`) if this step cannot run; changes nothing.

        `optim_step` checks the same and fails as a whole, so callers fusing several tenants'
        steps check each one first.
        """
        self.slots.spec(model_id)
        check_adam(adam)

    def optim_step(
        self, steps: list[tuple[str, AdamParams]]
    ) -> list[dict[str, float] | TwinkleError]:
        """Apply and clear the accumulated gradients of each listed model, fused across them
        (in groups of at most `max_slots` tenants when more are listed).

        Per step: its metrics, or the `UserError` of a step that could not be applied (see
        `SlotAdamW.step`); that model's slot is then exactly as it was, and the others' steps
        are unaffected. A request that fails validation fails the whole call, changing nothing.
        """
        listed: set[str] = set()
        for model_id, adam in steps:
            self.validate_optim_step(model_id, adam)
            if model_id in listed:
                raise ServerError(f"optim_step lists model_id {model_id!r} twice in one step")
            listed.add(model_id)
        results: dict[int, dict[str, float] | TwinkleError] = {}
        for indices in self.slots.sub_calls([model_id for model_id, _ in steps]):
            tenants = self.slots.resident([steps[index][0] for index in indices])
            slots = [tenant.slot for tenant in tenants]
            adams = [steps[index][1] for index in indices]
            results.update(zip(indices, self.optimizer.step(slots, adams), strict=True))
        return [results[index] for index in range(len(steps))]
