"""The multi-slot model: one frozen base model, its LoRA bank, the shared pass and the fused step.

Job: everything that runs on the adapters' slots, and nothing about who holds them. It knows slot
numbers, never model ids: which tenant or snapshot holds a slot is the trainer's
(`workers.trainer.residency`), and the samplers bind slots through `bind`. Calls are synchronous,
on one dedicated thread; nothing here is thread-safe or asynchronous.

Step 1 (`validate`): a request is checked before it joins a pass and its loss looked up, once; a
        bad field is a `UserError` naming the datum and the field. What comes back (`Checked`)
        is what the pass takes.
Step 2 (`forward_backward`): rows are packed slot by slot (one contiguous segment per slot),
        right-padded, with an attention mask; the routing binds the segments; the pass's loss is
        the sum of every training item's own summed loss, so each slot receives exactly the
        gradient of its solo pass. Gradients accumulate in the slot until its optim_step.
Step 3 (`optim_step`): one fused AdamW step over the stepping slots, each with its own settings.

Transactions: one `forward_backward` or `optim_step` call (at most `max_slots` distinct slots) is a
transaction per slot. A training item whose loss or slot gradient is not finite fails alone
(`UserError`) and its slot's gradients are restored from a copy taken before the pass; a step that
cannot be applied fails alone and leaves its slot exactly as it was (`workers.engine.optimizer`).
A call that raises (a fault not pinned on one item) has changed no state, so the caller may re-run
its items in smaller groups to find the culprit (`workers.engine.isolation`). Slots a pass does not
train receive exact zeros from the backward: their values never change (a -0.0 may become +0.0).

Invariants: the base model is frozen and in eval mode (no dropout); adapters, gradients and
moments are fp32; a forward_only item contributes no gradient; a request that fails validation
changes no state.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from functools import partial

import numpy as np
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from protocol.api import AdamParams
from protocol.errors import TwinkleError, UserError
from protocol.images import VisionGeometry
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest, datum_too_long
from workers.engine.collective import Collective
from workers.engine.configs import load_config
from workers.engine.custom_loss import check_request as check_custom_request
from workers.engine.expert_parallel import split_experts
from workers.engine.frozen_shards import shard_frozen_linears
from workers.engine.lora import ExpertSlice, LoraBank, Segment, SlotRouting, lay_out_slot
from workers.engine.losses import check_inputs, get_loss, resolve_config
from workers.engine.memory import TokenPlan, free_memory, plan_slots, plan_tokens
from workers.engine.optimizer import SlotAdamW
from workers.engine.passes import (
    CUSTOM,
    Checked,
    OutputScaling,
    PassResults,
    PassRunner,
    not_finite,
    output_of,
)
from workers.engine.vision import VisionTower, no_images

log = logging.getLogger(__name__)


def load_causal_lm(base_model: str, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of `base_model`: its text model where transformers has a causal-LM class
    for it (a Qwen3.5 composite loads its language model so), else, for a vision-language
    model without one (Qwen3-VL, Kimi-K2.5, Inkling), the composite itself, whose decoder and
    output layer the passes run and whose vision tower `VisionTower` uses where it is
    Qwen-VL's (LoRA never adapts a tower or its projector: `workers.engine.lora`)."""
    config = load_config(base_model)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and hasattr(config, "vision_config"):
        composite: PreTrainedModel = AutoModelForImageTextToText.from_pretrained(
            base_model, config=config, dtype=dtype
        )
        return composite
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        base_model, config=config, dtype=dtype
    )
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


class MultiSlotModel:
    """One base model, its adapter bank, the shared pass and the fused step; see the module
    docstring."""

    def __init__(
        self,
        base_model: str,
        *,
        max_slots: int | None = 8,
        max_rank: int = 32,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        pass_tokens: int = 16384,
        logits_chunk_elements: int | None = None,
        collective: Collective | None = None,
        memory_limit: int | None = None,
    ) -> None:
        if (max_slots is not None and max_slots < 1) or max_rank < 1:
            raise ValueError(f"max_slots={max_slots} and max_rank={max_rank} must be >= 1")
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
        # the ids the model scores: a padded vocabulary's tail is not (`passes.output_of`)
        self.vocab_size = (output_of(model) or OutputScaling()).vocab or int(text_config.vocab_size)
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
        # The trained slots' gradient rows as a pass found them (see `forward_backward`): one
        # buffer for the life of the model, so a pass neither allocates nor faults it in.
        self._pending = torch.empty_like(self.bank.grads)
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
        # why an image is refused, when it is (a text model, or a tower the engine cannot run)
        self.no_images = None if self.vision else no_images(base_model, model.config)
        self.passes = PassRunner(
            model,
            self.routing,
            self.device,
            pass_tokens=pass_tokens,
            chunk_tokens=max(least, logits_chunk_elements // self.vocab_size),
            vision=self.vision,
            collective=self.collective,
            sum_over_ranks=self.bank.sum_over_ranks,
        )
        # The longest datum a pass trains and the longest sequence the sampler runs, planned
        # from what the device has left now (at most `memory_limit` bytes, where set); a group
        # plans with its tightest rank's memory, and with a long datum split over its ranks
        # where the model allows (`context_parallel.py`)
        free = free_memory(self.device)
        if memory_limit is not None:
            free = min(free, memory_limit)
        free = -self.collective.agree_max([-free])[0]
        tokens = partial(
            plan_tokens,
            model.config,
            dtype_bytes=torch.finfo(self.dtype).bits // 8,
            free_bytes=free,
            max_context=self.max_context,
        )
        self.token_plan: TokenPlan = tokens(
            ranks=self.collective.world if self.passes.context.supported else 1
        )
        self.passes.context.whole_tokens = tokens(ranks=1).train_tokens
        log.info("%s: %s", base_model, self.token_plan.describe())

    # -- what the samplers run a step with ---------------------------------------------------

    @property
    def decoder(self) -> nn.Module:
        """Every layer but the output one (the sampler's prefill and decode)."""
        return self.passes.decoder

    @property
    def head(self) -> nn.Module:
        """The output layer, its LoRA term per slot included."""
        return self.passes.head

    def bind(self, segments: Sequence[Segment]) -> AbstractContextManager[None]:
        """Route each segment's rows through its slot's adapter for the calls inside."""
        return self.routing.bind(segments)

    @property
    def geometry(self) -> VisionGeometry | None:
        """The image geometry and limits of the requests this model takes images in (None:
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

    # -- requests ----------------------------------------------------------------------------

    def validate(self, req: FwdBwdRequest) -> Checked:
        """Step 1: the request with its loss looked up, or a `UserError` naming the field if it
        cannot run; changes nothing."""
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
        return Checked(req, None if loss is None else (loss, settings))

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
        if tokens.shape[0] > self.token_plan.train_tokens:
            raise UserError(datum_too_long(index, tokens.shape[0], self.token_plan.train_tokens))
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
            raise UserError(f"{field}: {self.no_images}")
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
        self, items: Sequence[Checked], slots: Sequence[int]
    ) -> list[FwdBwdOutput | TwinkleError]:
        """Step 2, one transaction: item i runs on slot `slots[i]` (at most `max_slots` distinct).

        Per item: its outputs, or the `UserError` of a training item whose loss or gradient is
        not finite. The pending gradient rows of the slots this call trains are copied first. A
        training item that fails (a non-finite loss) after some of its datums already added
        gradient gives its slot its copy back, and that slot's other training items run again
        without it. After the backward, a slot whose row is not finite fails its training items
        and gets its copy back, as does a slot none of whose training items succeeded (so not
        even the sign of a zero changes); a call that raises restores every one of them first.
        """
        if not items:
            return []
        training_items: dict[int, list[int]] = {}  # slot → its training items
        for index, (item, slot) in enumerate(zip(items, slots, strict=True)):
            if not item.request.forward_only:
                training_items.setdefault(slot, []).append(index)
        trained = sorted(training_items)
        pending = self._pending[: len(trained)]
        if trained:
            rows = torch.tensor(trained, dtype=torch.long, device=self.bank.grads.device)
            torch.index_select(self.bank.grads, 0, rows, out=pending)
        row_of = {slot: row for row, slot in enumerate(trained)}
        try:
            ran = self.passes.run(items, slots)
            results = ran.results
            tainted = {
                slots[index]
                for index in ran.contributed
                if isinstance(results[index], TwinkleError)
            }
            if tainted:
                self._run_again(items, slots, training_items, tainted, pending, row_of, results)
            # each rank's share of the experts' shared factors, summed (expert parallelism)
            self.bank.reduce_expert_gradients(trained, pending)
            failed_rows = self._failed_rows(trained)
            for row, slot in enumerate(trained):
                training = training_items[slot]
                if slot in failed_rows:
                    for index in training:
                        if not isinstance(results[index], TwinkleError):
                            results[index] = not_finite("gradient", "an overflow in float32")
                if all(isinstance(results[index], TwinkleError) for index in training):
                    self.bank.grads[slot].copy_(pending[row])
            return results
        except BaseException:
            for row, slot in enumerate(trained):
                self.bank.grads[slot].copy_(pending[row])
            raise

    def _run_again(
        self,
        items: Sequence[Checked],
        slots: Sequence[int],
        training_items: dict[int, list[int]],
        tainted: set[int],
        pending: torch.Tensor,
        row_of: dict[int, int],
        results: list[FwdBwdOutput | TwinkleError],
    ) -> None:
        """The tainted slots get their copies back; their items that did not fail run again."""
        again = [
            index
            for slot in sorted(tainted)
            for index in training_items[slot]
            if not isinstance(results[index], TwinkleError)
        ]
        for slot in tainted:
            self.bank.grads[slot].copy_(pending[row_of[slot]])
        if not again:
            return
        rerun: PassResults = self.passes.run([items[i] for i in again], [slots[i] for i in again])
        for index, result in zip(again, rerun.results, strict=True):
            results[index] = result
        for position, index in enumerate(again):
            if position in rerun.contributed and isinstance(rerun.results[position], TwinkleError):
                # Failed only in the second run (rounding at the edge of float32): the whole
                # slot fails rather than keep part of its gradient.
                for other in training_items[slots[index]]:
                    results[other] = not_finite("loss", "float32 overflow")

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

    def discard_gradients(self, slots: Sequence[int]) -> list[None]:
        """Clear the accumulated gradients of each listed slot without a step."""
        for slot in slots:
            self.bank.grads[slot].zero_()
        return [None] * len(slots)

    def optim_step(
        self, slots: Sequence[int], adams: Sequence[AdamParams]
    ) -> list[dict[str, float] | TwinkleError]:
        """Step 3, one transaction: apply and clear the accumulated gradients of each listed
        slot (distinct, at most `max_slots`), fused across them, each with its own settings
        (checked beforehand: `protocol.rules.check_adam`).

        Per slot: its metrics, or the `UserError` of a step that could not be applied (see
        `SlotAdamW.step`); that slot is then exactly as it was, and the others' steps are
        unaffected.
        """
        return list(self.optimizer.step(list(slots), list(adams)))
