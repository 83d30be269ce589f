"""The trainer engine: tenants' LoRA adapters on one frozen base model, trained in shared passes.

Job: run decoded requests as one padded forward/backward over every tenant's rows, per-slot AdamW
steps, and PEFT checkpoints of a slot. The worker service calls it synchronously from one
dedicated thread; nothing here is thread-safe or asynchronous.

Step 1 (`create` / `load`): a model_id takes a free slot of the `LoraBank` (see "Slot pressure").
Step 2 (`validate`): a request is checked before it joins a pass; a bad field is a `UserError`
        naming the datum and the field.
Step 3 (`forward_backward`): rows are packed tenant by tenant (one contiguous segment per slot),
        right-padded, with an attention mask; the routing binds the segments; the pass's loss is
        the sum of every training item's own summed loss, so each slot receives exactly the
        gradient of its solo pass. Gradients accumulate in the slot until its optim_step.
Step 4 (`optim_step`): one fused AdamW step over the stepping slots, each with its own settings.
Step 5 (`save` / `load`): a slot to and from a PEFT-layout directory (`workers.checkpoints`).
Step 6 (`load_snapshot`): a sampler checkpoint into an inference-only slot that sampling passes
        (`workers.sampling_torch`) route rows to; idle slots keep snapshots until a tenant asks.

Slot pressure: a tenant that needs a slot takes a free one, else the least recently used
snapshot's, else the least recently used resident tenant's, which is *parked*: its whole slot state
(weights, both Adam moments, pending gradients, step count, scales, spec) is copied to host memory
(`ParkedAdapters`) and the slot is freed; a snapshot with no slot to take parks one too. Every call
that names a tenant accepts a parked one; those that need its slot (a pass, a step, a save, `slot`)
restore it first, bit-exactly, so training never notices a park. A call naming more tenants than
there are slots runs as several sub-passes (or sub-steps) of at most `max_slots` tenants, resident
tenants first, with results in request order. Without this a server would refuse new tenants once
`max_slots` had arrived, however idle the old ones. `max_parked` bounds host memory: beyond it the
oldest parked tenant is dropped (with a warning) and its later requests fail as not loaded.

Invariants: the base model is frozen and in eval mode (no dropout); adapters, gradients and
moments are fp32; a forward_only item contributes no gradient; a request that fails validation
changes no state; a snapshot slot is never trained, stepped or saved; a model_id is resident (in
`_tenants`, least recently used first) or parked, never both; a call's own tenants are never
parked to make room for each other.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from protocol.api import AdamParams, LoraConfig
from protocol.errors import NotFound, ServerError, UserError
from protocol.rules import check_adam, check_lora_config
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest
from workers.checkpoints import (
    MOMENTS,
    AdapterCheckpoint,
    adapter_key,
    match_layers,
    read_checkpoint,
    target_modules_for,
    write_checkpoint,
)
from workers.lora import LayerGroup, LoraBank, Segment, SlotRouting
from workers.losses import (
    TARGET_TOKENS,
    LossFn,
    Settings,
    check_inputs,
    get_loss,
    resolve_config,
)
from workers.optimizer import SlotAdamW
from workers.parking import GROUP_FLAGS, ParkedAdapters, Tenant, trained_groups

log = logging.getLogger(__name__)


class Engine:
    """Adapter slots over one base model; see the module docstring for the flow."""

    def __init__(
        self,
        base_model: str,
        *,
        max_slots: int = 8,
        max_rank: int = 32,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        lora_alpha: float = 32.0,
        max_parked: int | None = None,
    ) -> None:
        if max_slots < 1 or max_rank < 1:
            raise ValueError(f"max_slots={max_slots} and max_rank={max_rank} must be >= 1")
        if max_parked is not None and max_parked < 0:
            raise ValueError(f"max_parked={max_parked} must be >= 0 (or None: unbounded)")
        self.device = torch.device(device)
        # bf16 where it is fast; fp32 on the CPU, where results must match references exactly.
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=self.dtype)
        model.to(self.device)
        model.requires_grad_(False)
        model.eval()
        text_config = model.config.get_text_config()
        self.base_model = base_model
        self.vocab_size = int(text_config.vocab_size)
        self.max_context = int(text_config.max_position_embeddings)
        self.arch = str(model.config.model_type)
        self.max_slots = max_slots
        self.max_rank = max_rank
        self.lora_alpha = float(lora_alpha)
        self._linear_paths = [p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        self.routing = SlotRouting()
        self.bank = LoraBank(
            model, max_slots=max_slots, max_rank=max_rank, routing=self.routing, device=self.device
        )
        self.optimizer = SlotAdamW(self.bank.weights, self.bank.grads)
        self.parked = ParkedAdapters(self.bank, self.optimizer, max_parked=max_parked)
        self.model = model
        # Resident tenants, least recently used first; the parked ones are in `self.parked`.
        self._tenants: OrderedDict[str, Tenant] = OrderedDict()
        self._snapshots: OrderedDict[str, int] = OrderedDict()  # key → slot, least recent first

    # -- slots -------------------------------------------------------------------------------

    def create(self, model_id: str, spec: LoraConfig) -> None:
        """Give `model_id` a fresh adapter: A kaiming-uniform (seeded if `spec.seed`), B = 0."""
        if self.has(model_id):
            raise UserError(f"model_id {model_id!r} already has an adapter")
        check_lora_config(spec, self.max_rank)
        slot = self._slot_for_tenant(keep=())
        generator = torch.Generator()
        if spec.seed is None:
            generator.seed()
        else:
            generator.manual_seed(spec.seed)
        self.bank.init_slot(
            slot,
            rank=spec.rank,
            groups=trained_groups(spec),
            lora_alpha=self.lora_alpha,
            generator=generator,
        )
        self.optimizer.reset_slot(slot)
        self._tenants[model_id] = Tenant(slot, spec, self.lora_alpha)

    def has(self, model_id: str) -> bool:
        """Whether `model_id` has an adapter here, resident or parked."""
        return model_id in self._tenants or model_id in self.parked

    def spec(self, model_id: str) -> LoraConfig:
        return self._spec(model_id)

    def slot(self, model_id: str) -> int:
        """The bank row holding this model's adapter, restored first if it was parked."""
        [tenant] = self._make_resident([model_id])
        return tenant.slot

    def slots_used(self) -> int:
        """Slots holding training adapters (resident tenants; snapshots not counted)."""
        return len(self._tenants)

    def adapters_total(self) -> int:
        """Training adapters on this worker: resident plus parked."""
        return len(self._tenants) + len(self.parked)

    def release(self, model_id: str) -> None:
        """Forget the adapter: zero its slot, or drop its parked copy; unknown is a no-op."""
        tenant = self._tenants.pop(model_id, None)
        if tenant is not None:
            self.bank.clear_slot(tenant.slot)
            self.optimizer.reset_slot(tenant.slot)
        else:
            self.parked.pop(model_id)

    # -- requests ----------------------------------------------------------------------------

    def validate(self, model_id: str, req: FwdBwdRequest) -> None:
        """Raise a `UserError` naming the field if `req` cannot run; changes nothing."""
        self._spec(model_id)
        loss = get_loss(req.loss_fn)
        settings = resolve_config(loss, req.loss_fn_config)
        if not req.datums:
            raise UserError("datums: the request has no datums")
        for index, datum in enumerate(req.datums):
            self._check_tokens(index, datum)
            n_tokens = int(datum.tokens.shape[0])
            check_inputs(loss, settings, index, n_tokens, datum.inputs, self.vocab_size)

    def _check_tokens(self, index: int, datum: DatumArrays) -> None:
        field = f"datums[{index}].model_input"
        tokens = datum.tokens
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

    def forward_backward(self, batch: list[tuple[str, FwdBwdRequest]]) -> list[FwdBwdOutput]:
        """One shared pass over every item; gradients of training items accumulate per slot.

        Items of more tenants than there are slots run as several passes (see `_sub_calls`).
        """
        if not batch:
            return []
        for model_id, req in batch:
            self.validate(model_id, req)
        results: dict[int, FwdBwdOutput] = {}
        for indices in self._sub_calls([model_id for model_id, _ in batch]):
            sub_batch = [batch[index] for index in indices]
            results.update(zip(indices, self._shared_pass(sub_batch), strict=True))
        return [results[index] for index in range(len(batch))]

    def _shared_pass(self, batch: list[tuple[str, FwdBwdRequest]]) -> list[FwdBwdOutput]:
        """One pass over validated items of at most `max_slots` tenants."""
        tenants = self._make_resident([model_id for model_id, _ in batch])
        slots = [tenant.slot for tenant in tenants]
        segments, item_rows, rows = _pack_rows([req for _, req in batch], slots)
        input_ids, attention_mask = self._padded(rows)
        training = any(not req.forward_only for _, req in batch)

        with torch.set_grad_enabled(training), self.routing.bind(segments):
            logits = self.model(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).logits
            results: list[FwdBwdOutput] = []
            training_losses: list[torch.Tensor] = []
            for (_, req), rows_of_item in zip(batch, item_rows, strict=True):
                loss, result = self._item_loss(req, logits, rows_of_item)
                results.append(result)
                if not req.forward_only:
                    training_losses.append(loss)
        if training_losses:
            total = torch.stack(training_losses).sum()
            if total.requires_grad:
                # Each `.grad` is a strided view of the bank's flat gradient buffer by design;
                # autograd adds into it in place, so the layout advice does not apply.
                with torch.autograd.enforce_grad_layout_policy(False):
                    total.backward()
        return results

    def _padded(self, rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded token ids and the attention mask that hides the padding."""
        width = max(row.shape[0] for row in rows)
        input_ids = np.zeros((len(rows), width), dtype=np.int64)
        attention_mask = np.zeros((len(rows), width), dtype=np.int64)
        for index, row in enumerate(rows):
            input_ids[index, : row.shape[0]] = row
            attention_mask[index, : row.shape[0]] = 1
        return (
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(attention_mask).to(self.device),
        )

    def _item_loss(
        self, req: FwdBwdRequest, logits: torch.Tensor, rows: range
    ) -> tuple[torch.Tensor, FwdBwdOutput]:
        """A request's summed loss (a graph node) and its detached per-datum outputs."""
        loss_fn = get_loss(req.loss_fn)
        settings = resolve_config(loss_fn, req.loss_fn_config)
        datum_losses: list[torch.Tensor] = []
        outputs: list[dict[str, np.ndarray]] = []
        for datum, row in zip(req.datums, rows, strict=True):
            n_tokens = int(datum.tokens.shape[0])
            logprobs, elementwise = self._datum_loss(
                loss_fn, settings, datum, logits[row, :n_tokens]
            )
            datum_losses.append(elementwise.sum())
            outputs.append(
                {"logprobs": _to_numpy(logprobs), "elementwise_loss": _to_numpy(elementwise)}
            )
        loss = torch.stack(datum_losses).sum()
        metrics = {"loss:sum": float(loss.detach())}
        return loss, FwdBwdOutput(outputs, metrics, loss_fn.output_type)

    def _datum_loss(
        self, loss_fn: LossFn, settings: Settings, datum: DatumArrays, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {name: self._input_tensor(array) for name, array in datum.inputs.items()}
        targets = inputs[TARGET_TOKENS]
        logits = logits.float()
        # log-softmax at the targets only: gather minus logsumexp keeps no [N, V] output alive.
        normaliser = torch.logsumexp(logits, dim=-1)
        if targets.ndim == 1:
            logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
        else:
            logprobs = logits.gather(-1, targets) - normaliser.unsqueeze(-1)
        return logprobs, loss_fn.elementwise(logprobs, inputs, settings)

    def _input_tensor(self, array: np.ndarray) -> torch.Tensor:
        dtype = torch.int64 if array.dtype.kind in "iu" else torch.float32
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, dtype)

    def validate_optim_step(self, model_id: str, adam: AdamParams) -> None:
        """Raise a `UserError` (or `NotFound`) if this step cannot run; changes nothing.

        `optim_step` checks the same and fails as a whole, so callers fusing several tenants'
        steps check each one first.
        """
        self._spec(model_id)
        check_adam(adam)

    def optim_step(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float]]:
        """Apply and clear the accumulated gradients of each listed model, fused across them
        (in groups of at most `max_slots` tenants when more are listed)."""
        listed: set[str] = set()
        for model_id, adam in steps:
            self.validate_optim_step(model_id, adam)
            if model_id in listed:
                raise ServerError(f"optim_step lists model_id {model_id!r} twice in one step")
            listed.add(model_id)
        metrics: dict[int, dict[str, float]] = {}
        for indices in self._sub_calls([model_id for model_id, _ in steps]):
            tenants = self._make_resident([steps[index][0] for index in indices])
            slots = [tenant.slot for tenant in tenants]
            adams = [steps[index][1] for index in indices]
            metrics.update(zip(indices, self.optimizer.step(slots, adams), strict=True))
        return [metrics[index] for index in range(len(steps))]

    # -- checkpoints -------------------------------------------------------------------------

    def save(
        self,
        model_id: str,
        directory: Path,
        *,
        kind: Literal["weights", "sampler_weights"],
        meta: dict[str, Any],
    ) -> int:
        """Write the slot as a PEFT checkpoint (plus optimizer state for `weights`); bytes written."""
        [tenant] = self._make_resident([model_id])
        tensors = self._export_slot(tenant, self.bank.weights)
        moments: dict[str, torch.Tensor] | None = None
        if kind == "weights":
            moments = {}
            for moment in MOMENTS:
                buffer = getattr(self.optimizer, moment)
                moments.update(self._export_slot(tenant, buffer, suffix=f".{moment}"))
        groups = trained_groups(tenant.spec)
        trained_paths = [lay.path for lay in self.bank.layouts if lay.group in groups]
        checkpoint = AdapterCheckpoint(
            base_model=self.base_model,
            rank=tenant.spec.rank,
            lora_alpha=tenant.lora_alpha,
            target_modules=target_modules_for(trained_paths, self._linear_paths),
            tensors=tensors,
            spec=tenant.spec,
            moments=moments,
            step=self.optimizer.steps[tenant.slot],
            meta=meta,
        )
        return write_checkpoint(directory, checkpoint, kind=kind)

    def _export_slot(
        self, tenant: Tenant, buffer: torch.Tensor, *, suffix: str = ""
    ) -> dict[str, torch.Tensor]:
        """The trained layers' matrices of a slot in `buffer`, by PEFT key (+ suffix), on the CPU."""
        groups = trained_groups(tenant.spec)
        exported: dict[str, torch.Tensor] = {}
        for layout, a, b in self.bank.slot_views(buffer, tenant.slot, tenant.spec.rank):
            if layout.group in groups:
                exported[adapter_key(layout.path, "A") + suffix] = _exported(a)
                exported[adapter_key(layout.path, "B") + suffix] = _exported(b)
        return exported

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> LoraConfig:
        """Load a checkpoint into `model_id` (creating it if new); pending gradients are dropped."""
        checkpoint, spec, adapters = self._read_adapter(directory, with_optimizer=with_optimizer)
        tenant = self._tenants.get(model_id)
        if tenant is not None:
            slot = tenant.slot
        else:
            self.parked.pop(model_id)  # a parked state is replaced, never restored
            slot = self._slot_for_tenant(keep=())

        # Everything is checked; from here on the slot is overwritten.
        self.optimizer.reset_slot(slot)
        buffers = [("", self.bank.weights)]
        if with_optimizer:
            buffers += [(f".{moment}", getattr(self.optimizer, moment)) for moment in MOMENTS]
            self.optimizer.steps[slot] = checkpoint.step
        self._write_slot(slot, checkpoint, spec, adapters, buffers)
        self._tenants[model_id] = Tenant(slot, spec, checkpoint.lora_alpha)
        self._tenants.move_to_end(model_id)
        return spec

    def _read_adapter(
        self, directory: Path, *, with_optimizer: bool
    ) -> tuple[AdapterCheckpoint, LoraConfig, set[LayerGroup]]:
        """A checkpoint checked against this model: (checkpoint, LoRA spec, covered groups)."""
        checkpoint = read_checkpoint(directory, with_optimizer=with_optimizer)
        adapters = match_layers(checkpoint, self.bank.layouts, max_rank=self.max_rank)
        spec = checkpoint.spec or LoraConfig(
            rank=checkpoint.rank,
            **{flag: group in adapters for group, flag in GROUP_FLAGS.items()},
        )
        check_lora_config(spec, self.max_rank)
        if spec.rank != checkpoint.rank or set(adapters) != trained_groups(spec):
            raise UserError(f"{directory.name}: the adapter's layers do not match its LoRA spec")
        return checkpoint, spec, adapters

    def _write_slot(
        self,
        slot: int,
        checkpoint: AdapterCheckpoint,
        spec: LoraConfig,
        adapters: set[LayerGroup],
        buffers: list[tuple[str, torch.Tensor]],
    ) -> None:
        """Overwrite a slot's scales and `buffers` (weights, maybe moments) from a checkpoint."""
        self.bank.clear_slot(slot)
        self.bank.set_scales(
            slot, rank=spec.rank, groups=adapters, lora_alpha=checkpoint.lora_alpha
        )
        stored = {**checkpoint.tensors, **(checkpoint.moments or {})}
        for suffix, buffer in buffers:
            for layout, a, b in self.bank.slot_views(buffer, slot, spec.rank):
                if layout.group in adapters:
                    a.copy_(stored[adapter_key(layout.path, "A") + suffix])
                    b.copy_(stored[adapter_key(layout.path, "B") + suffix])

    # -- inference-only snapshots --------------------------------------------------------------
    # A snapshot is a sampler checkpoint in a slot of its own that only sampling passes read: it
    # is never trained, stepped or saved, so what it samples cannot change. Snapshots live in the
    # slots no tenant holds; a tenant that needs a slot takes the least recently used snapshot's.

    def load_snapshot(self, key: str, directory: Path) -> None:
        """Load a sampler checkpoint as snapshot `key`; a key already loaded is only marked used.

        Takes a free slot, else the least recently used snapshot's, else parks the least recently
        used tenant (restored on its next request): sampling keeps working on a full worker.
        """
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        checkpoint, spec, adapters = self._read_adapter(directory, with_optimizer=False)
        slot = self._slot_for_tenant(keep=())
        self._write_slot(slot, checkpoint, spec, adapters, [("", self.bank.weights)])
        self._snapshots[key] = slot

    def has_snapshot(self, key: str) -> bool:
        return key in self._snapshots

    def snapshot_slot(self, key: str) -> int:
        """The slot of snapshot `key`, marked as just used; `NotFound` if it is not loaded."""
        slot = self._snapshots.get(key)
        if slot is None:
            raise NotFound(f"snapshot {key!r} is not loaded on this worker")
        self._snapshots.move_to_end(key)
        return slot

    def snapshot_capacity(self) -> int:
        """How many snapshots fit at once: the slots no resident tenant holds."""
        return self.max_slots - len(self._tenants)

    def drop_snapshot(self, key: str) -> None:
        """Free a snapshot's slot and zero it; dropping an unknown key is a no-op."""
        slot = self._snapshots.pop(key, None)
        if slot is not None:
            self.bank.clear_slot(slot)

    # -- residency ---------------------------------------------------------------------------

    def _spec(self, model_id: str) -> LoraConfig:
        tenant = self._tenants.get(model_id)
        if tenant is not None:
            return tenant.spec
        parked = self.parked.get(model_id)
        if parked is None:
            raise NotFound(f"model_id {model_id!r} has no adapter on this worker")
        return parked.spec

    def _sub_calls(self, model_ids: list[str]) -> list[list[int]]:
        """A call's item indices split into runs of at most `max_slots` distinct tenants.

        Resident tenants go first, so a call that fits is one run and one that does not parks
        as few tenants as it can. Each run keeps its items in request order.
        """
        distinct = list(dict.fromkeys(model_ids))
        distinct.sort(key=lambda model_id: model_id not in self._tenants)  # stable
        run_of = {model_id: n // self.max_slots for n, model_id in enumerate(distinct)}
        runs: list[list[int]] = [[] for _ in range(-(-len(distinct) // self.max_slots))]
        for index, model_id in enumerate(model_ids):
            runs[run_of[model_id]].append(index)
        return runs

    def _make_resident(self, model_ids: list[str]) -> list[Tenant]:
        """Each listed model's tenant (per item), restoring parked ones; all marked just used.

        A restored tenant takes a free slot, else a snapshot's, else the slot of the least
        recently used resident tenant that is not listed (parked).
        """
        wanted = list(dict.fromkeys(model_ids))
        if len(wanted) > self.max_slots:
            raise ServerError(
                f"one pass needs {len(wanted)} adapters; this worker has {self.max_slots} slots"
            )
        for model_id in wanted:
            self._spec(model_id)  # NotFound before anything moves
        # Out of parking before any slot is freed, so parking others cannot drop these.
        returning = [
            (model_id, parked)
            for model_id in wanted
            if model_id not in self._tenants and (parked := self.parked.pop(model_id)) is not None
        ]
        for model_id in wanted:
            if model_id in self._tenants:
                self._tenants.move_to_end(model_id)
        for model_id, parked in returning:
            slot = self._slot_for_tenant(keep=wanted)
            self._tenants[model_id] = self.parked.restore(parked, slot)
            log.debug("restored model_id %s into slot %d", model_id, slot)
        return [self._tenants[model_id] for model_id in model_ids]

    def _slot_for_tenant(self, keep: Collection[str]) -> int:
        """A slot for a tenant: free, else a snapshot's, else a parked tenant's (not in `keep`)."""
        slot = self._free_slot()
        if slot is not None:
            return slot
        victim = next((model_id for model_id in self._tenants if model_id not in keep), None)
        if victim is None:
            raise ServerError(
                f"no free adapter slot: all {self.max_slots} slots are needed by this call"
            )
        tenant = self._tenants.pop(victim)
        self.parked.park(victim, tenant)
        log.debug("parked model_id %s from slot %d", victim, tenant.slot)
        return tenant.slot

    # -- helpers -----------------------------------------------------------------------------

    def _free_slot(self) -> int | None:
        """A slot nobody holds, else the least recently used snapshot's (evicted); None when
        resident tenants hold every slot."""
        used = {tenant.slot for tenant in self._tenants.values()}
        used.update(self._snapshots.values())
        for slot in range(self.max_slots):
            if slot not in used:
                return slot
        if self._snapshots:
            key, slot = next(iter(self._snapshots.items()))
            self.drop_snapshot(key)
            return slot
        return None


def _pack_rows(
    requests: list[FwdBwdRequest], slots: list[int]
) -> tuple[list[Segment], list[range], list[np.ndarray]]:
    """Order the pass's rows tenant by tenant: (segments, each request's rows, the rows)."""
    rows: list[np.ndarray] = []
    item_rows: list[range] = [range(0)] * len(requests)
    segments: list[Segment] = []
    for slot in dict.fromkeys(slots):  # each slot once, in order of first appearance
        start = len(rows)
        for index, (req, item_slot) in enumerate(zip(requests, slots, strict=True)):
            if item_slot == slot:
                first = len(rows)
                rows.extend(datum.tokens for datum in req.datums)
                item_rows[index] = range(first, len(rows))
        segments.append(Segment(slot, start, len(rows)))
    return segments, item_rows, rows


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()


def _exported(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 CPU copy, detached from the live buffer."""
    return tensor.detach().to("cpu", torch.float32).clone(memory_format=torch.contiguous_format)
