"""Slot residency: which tenant or snapshot holds each row of the adapter bank, and who is parked.

Job: give each model_id a slot of the multi-slot model's bank (`workers.engine.model`) when it
is created or loaded, bring parked tenants back when a call needs them, keep inference-only
snapshots in the slots no tenant holds, and save or load a tenant's slot through
`workers.trainer.slot_checkpoints`. The trainer's operations ask this class for slots
(`resident`, `sub_calls`) and hand them to the model's passes and steps; nothing else assigns
rows. It implements the samplers' `workers.sampler.snapshots.SnapshotSlots`.

Slot pressure: a tenant that needs a slot takes a free one, else the least recently used
snapshot's, else the least recently used resident tenant's, which is *parked*: its whole slot
state (weights, both Adam moments, pending gradients, step count, scales, spec) is copied to
host memory (`workers.trainer.parking.ParkedAdapters`) and the slot is freed; a snapshot with no slot to
take parks one too. Every call that names a tenant accepts a parked one; those that need its slot
(a pass, a step, a save, `slot`) restore it first, bit-exactly, so training never notices a park.
A call naming more tenants than there are slots runs as several sub-calls of at most `max_slots`
tenants (`sub_calls`), resident tenants first. Without this a server would refuse new tenants once
`max_slots` had arrived, however idle the old ones. `max_parked` bounds host memory: beyond it
the oldest parked tenant is dropped (with a warning) and its later requests fail as not loaded.

Snapshots: a snapshot is a sampler checkpoint in a slot of its own that only sampling passes
read (`workers.sampler.torch_sampler`): it is never trained, stepped or saved, so what it samples cannot
change. Idle slots keep snapshots until a tenant asks for a slot.

Invariants: a model_id is resident (in `_tenants`, least recently used first) or parked, never
both; a call's own tenants are never parked to make room for each other; a released or replaced
slot is zeroed (weights, gradients, scales, moments, step count).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import torch

from protocol.api import LoraConfig
from protocol.errors import NotFound, ServerError, UserError
from protocol.rules import check_lora_config
from workers.engine.model import MultiSlotModel
from workers.trainer.layouts import own_state, whole_state
from workers.trainer.parking import ParkedAdapters, SlotState, Tenant, trained_groups
from workers.trainer.slot_checkpoints import SlotCheckpoints, StoredAdapter

log = logging.getLogger(__name__)


class Residency:
    """The assignment of a bank's slots to tenants and snapshots; see the module docstring."""

    def __init__(
        self, model: MultiSlotModel, *, lora_alpha: float = 32.0, max_parked: int | None = None
    ) -> None:
        if max_parked is not None and max_parked < 0:
            raise ValueError(f"max_parked={max_parked} must be >= 0 (or None: unbounded)")
        self.bank = bank = model.bank
        self.optimizer = optimizer = model.optimizer
        self.parallel = model.collective.parallel
        self.files = SlotCheckpoints(
            bank,
            optimizer,
            base_model=model.base_model,
            linear_paths=[
                path for path, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)
            ],
        )
        self.max_slots = bank.max_slots
        self.lora_alpha = float(lora_alpha)
        self.parked = ParkedAdapters(bank, optimizer, max_parked=max_parked)
        # Resident tenants, least recently used first; the parked ones are in `self.parked`.
        self._tenants: OrderedDict[str, Tenant] = OrderedDict()
        self._snapshots: OrderedDict[str, int] = OrderedDict()  # key → slot, least recent first

    # -- tenants -----------------------------------------------------------------------------

    def create(self, model_id: str, spec: LoraConfig) -> None:
        """Give `model_id` a fresh adapter: A kaiming-uniform (seeded if `spec.seed`), B = 0."""
        if self.has(model_id):
            raise UserError(f"model_id {model_id!r} already has an adapter")
        check_lora_config(spec, self.bank.max_rank)
        self.check_targets(spec)
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

    def check_targets(self, spec: LoraConfig) -> None:
        """A `UserError` unless the adapter trains something on this model, and all of it: an
        MLP adapter on a model whose experts the bank cannot adapt is refused, never trained
        without them."""
        groups = trained_groups(spec)
        for flag, reason in self.refused().items():
            if getattr(spec, flag):
                raise UserError(reason)
        if not groups & self.bank.groups_present():
            present = sorted(self.bank.groups_present())
            raise UserError(
                f"LoRA config trains none of this base model's layer groups (it has {present});"
                " set train_attn, train_mlp or train_unembed"
            )

    def refused(self) -> dict[str, str]:
        """The LoRA config flags this model cannot train, each with why (its heartbeat carries
        them, so the gateway refuses such an adapter at `create_model`)."""
        if not self.bank.unwrappable_experts:
            return {}
        return {
            "train_mlp": f"train_mlp: this base model's expert block"
            f" {self.bank.unwrappable_experts[0]} is not laid out as fused 3-D gate/up and down"
            " weights, the only expert layout expert LoRA adapts; use train_mlp=False"
        }

    def has(self, model_id: str) -> bool:
        """Whether `model_id` has an adapter here, resident or parked."""
        return model_id in self._tenants or model_id in self.parked

    def spec(self, model_id: str) -> LoraConfig:
        """The adapter's LoRA config, resident or parked; `NotFound` if it has none here."""
        tenant = self._tenants.get(model_id)
        if tenant is not None:
            return tenant.spec
        parked = self.parked.get(model_id)
        if parked is None:
            raise NotFound(f"model_id {model_id!r} has no adapter on this worker")
        return parked.spec

    def slot(self, model_id: str) -> int:
        """The bank row holding this model's adapter, restored first if it was parked."""
        [tenant] = self.resident([model_id])
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

    def capture(self, model_id: str) -> SlotState:
        """A host copy of the adapter's whole state (weights, moments, gradients, step), for a
        snapshot; resident or parked, nothing moves. In one device's layout whatever this
        rank's share of the experts (`workers.trainer.layouts`): what a snapshot holds."""
        tenant = self._tenants.get(model_id)
        if tenant is not None:
            state = self.parked.copy(tenant)
        else:
            parked = self.parked.get(model_id)
            if parked is None:
                raise NotFound(f"model_id {model_id!r} has no adapter on this worker")
            state = parked
        return whole_state(self.bank, state) if self.parallel else state

    def adopt(self, model_id: str, state: SlotState) -> None:
        """Take a state in one device's layout (a snapshot) as this model's adapter, replacing
        any."""
        self.release(model_id)
        self.parked.put(model_id, own_state(self.bank, state) if self.bank.slices else state)

    # -- checkpoints -------------------------------------------------------------------------

    def save(
        self,
        model_id: str,
        directory: Path,
        *,
        kind: Literal["weights", "sampler_weights"],
        meta: dict[str, Any],
    ) -> int:
        """Write the tenant's slot as a checkpoint (restored first if parked); bytes written."""
        [tenant] = self.resident([model_id])
        return self.files.save(tenant, directory, kind=kind, meta=meta)

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> LoraConfig:
        """Load a checkpoint into `model_id` (creating it if new); pending gradients are dropped."""
        stored = self.files.read(directory, with_optimizer=with_optimizer)
        return self.load_stored(model_id, stored, with_optimizer=with_optimizer)

    def load_stored(
        self, model_id: str, stored: StoredAdapter, *, with_optimizer: bool
    ) -> LoraConfig:
        """`load` of a checkpoint already read and checked (`SlotCheckpoints.read`)."""
        tenant = self._tenants.get(model_id)
        if tenant is not None:
            slot = tenant.slot
        else:
            self.parked.pop(model_id)  # a parked state is replaced, never restored
            slot = self._slot_for_tenant(keep=())
        self._tenants[model_id] = self.files.write(slot, stored, with_optimizer=with_optimizer)
        self._tenants.move_to_end(model_id)
        return stored.spec

    # -- inference-only snapshots --------------------------------------------------------------

    def load_snapshot(self, key: str, directory: Path) -> None:
        """Load a sampler checkpoint as snapshot `key`; a key already loaded is only marked used.

        Takes a free slot, else the least recently used snapshot's, else parks the least recently
        used tenant (restored on its next request): sampling keeps working on a full worker.
        """
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        self.load_stored_snapshot(key, self.files.read(directory, with_optimizer=False))

    def load_stored_snapshot(self, key: str, stored: StoredAdapter) -> None:
        """`load_snapshot` of a checkpoint already read and checked."""
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        slot = self._slot_for_tenant(keep=())
        self.files.write(slot, stored, with_optimizer=False)
        self._snapshots[key] = slot

    def has_snapshot(self, key: str) -> bool:
        """Whether snapshot `key` is in a slot now."""
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

    # -- slots for a call --------------------------------------------------------------------

    def sub_calls(self, model_ids: list[str]) -> list[list[int]]:
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

    def resident(self, model_ids: list[str]) -> list[Tenant]:
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
            self.spec(model_id)  # NotFound before anything moves
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
