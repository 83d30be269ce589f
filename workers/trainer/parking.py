"""Parking: tenants' slot states in host memory, so more tenants than slots fit on a worker.

Host copies of slots, so that more tenants than slots can train on one worker. The engine
decides who is parked and when; this class moves one slot's state out and back, and forgets
the oldest parked adapters beyond `max_parked`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from protocol.api import LoraConfig
from workers.engine.lora import LAYER_GROUPS, LayerGroup, LoraBank
from workers.engine.optimizer import SlotAdamW
from workers.trainer.checkpoints import MOMENTS

log = logging.getLogger(__name__)

GROUP_FLAGS: dict[LayerGroup, str] = {
    "attn": "train_attn",
    "mlp": "train_mlp",
    "unembed": "train_unembed",
}


def trained_groups(spec: LoraConfig) -> frozenset[LayerGroup]:
    """The layer groups an adapter trains, from its `train_*` flags."""
    return frozenset(group for group, flag in GROUP_FLAGS.items() if getattr(spec, flag))


@dataclass
class Tenant:
    """A resident training adapter: its slot, shape and LoRA alpha."""

    slot: int
    spec: LoraConfig
    lora_alpha: float


@dataclass
class HostRow:
    """One `[S, P]` buffer's part of a parked slot, on the CPU."""

    values: torch.Tensor
    whole_row: bool  # False: only the adapter's own rank and layer groups, in `slot_views` order


@dataclass
class SlotState:
    """Everything a slot held for one tenant."""

    spec: LoraConfig
    lora_alpha: float
    step: int
    scales: dict[LayerGroup, float]
    rows: dict[str, HostRow]  # by buffer name; a buffer whose row was all zero is left out


class ParkedAdapters:
    """Tenants' slot states in host memory, oldest parked first, at most `max_parked` of them.

    Only an adapter's own values travel (its rank, its trained layer groups): the bank keeps the
    rest of a slot at exactly 0, so writing them back into a cleared slot restores it
    bit-exactly, in a fraction of the row's size. A row with anything else non-zero (a NaN that
    reached the padding) is kept whole. All-zero rows (no pending gradient, no step yet, an
    adapter that trains no layer this model has) are not kept at all.
    """

    def __init__(self, bank: LoraBank, optimizer: SlotAdamW, *, max_parked: int | None) -> None:
        self.bank = bank
        self.optimizer = optimizer
        self.max_parked = max_parked
        self._adapters: OrderedDict[str, SlotState] = OrderedDict()

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def __iter__(self) -> Iterator[str]:
        """Parked model_ids, oldest parked first."""
        return iter(self._adapters)

    def get(self, model_id: str) -> SlotState | None:
        return self._adapters.get(model_id)

    def pop(self, model_id: str) -> SlotState | None:
        """Take an adapter out of parking (to restore it, or to forget it)."""
        return self._adapters.pop(model_id, None)

    def copy(self, tenant: Tenant) -> SlotState:
        """A host copy of the tenant's whole slot state; the slot is left as it is."""
        slot, rank, groups = tenant.slot, tenant.spec.rank, trained_groups(tenant.spec)
        rows: dict[str, HostRow] = {}
        for name, buffer in self._buffers():
            row = self._copy_out(buffer, slot, rank, groups)
            if row is not None:
                rows[name] = row
        return SlotState(
            spec=tenant.spec,
            lora_alpha=tenant.lora_alpha,
            step=self.optimizer.steps[slot],
            scales={group: self.bank.scales[group][slot] for group in LAYER_GROUPS},
            rows=rows,
        )

    def put(self, model_id: str, state: SlotState) -> None:
        """Park a state that came from elsewhere (a snapshot), to be restored on demand."""
        self._adapters[model_id] = state
        self._adapters.move_to_end(model_id)
        self._bound()

    def park(self, model_id: str, tenant: Tenant) -> None:
        """Copy the tenant's slot to host memory, then clear the slot and its optimizer state."""
        self._adapters[model_id] = self.copy(tenant)
        self.bank.clear_slot(tenant.slot)
        self.optimizer.reset_slot(tenant.slot)
        self._bound()

    def _bound(self) -> None:
        while self.max_parked is not None and len(self._adapters) > self.max_parked:
            dropped, _ = self._adapters.popitem(last=False)
            log.warning(
                "dropped the parked adapter of model_id %s: more than max_parked=%d parked",
                dropped,
                self.max_parked,
            )

    def restore(self, parked: SlotState, slot: int) -> Tenant:
        """Write a popped adapter into `slot` exactly as it was parked; the slot's old content goes."""
        self.bank.clear_slot(slot)
        self.optimizer.reset_slot(slot)
        groups = trained_groups(parked.spec)
        for name, buffer in self._buffers():
            row = parked.rows.get(name)
            if row is not None:
                self._copy_in(row, buffer, slot, parked.spec.rank, groups)
        for group, scale in parked.scales.items():
            self.bank.scales[group][slot] = scale  # in place: the layers share these lists
        self.bank.ranks[slot] = parked.spec.rank
        self.optimizer.steps[slot] = parked.step
        return Tenant(slot, parked.spec, parked.lora_alpha)

    def _buffers(self) -> list[tuple[str, torch.Tensor]]:
        moments = [(moment, getattr(self.optimizer, moment)) for moment in MOMENTS]
        return [("weights", self.bank.weights), ("grads", self.bank.grads), *moments]

    def _views(
        self, buffer: torch.Tensor, slot: int, rank: int, groups: frozenset[LayerGroup]
    ) -> list[torch.Tensor]:
        return [
            view
            for layout, a, b in self.bank.slot_views(buffer, slot, rank)
            if layout.group in groups
            for view in (a, b)
        ]

    def _copy_out(
        self, buffer: torch.Tensor, slot: int, rank: int, groups: frozenset[LayerGroup]
    ) -> HostRow | None:
        """The slot's part of `buffer` on the host, view by view: no packed copy of the adapter
        is made on the device (a MoE adapter with its moments can be gigabytes)."""
        row = buffer[slot]
        in_row = int(row.count_nonzero())  # non-zeros, NaN included; one device sync
        if in_row == 0:
            return None
        # No views: the adapter trains no layer this model has (MLP only, on a model whose MLP
        # the bank does not wrap). Its part is empty, so an all-zero row stores nothing.
        views = self._views(buffer, slot, rank, groups)
        host = torch.empty(sum(view.numel() for view in views), dtype=buffer.dtype)
        for view, chunk in zip(views, torch.split(host, [v.numel() for v in views]), strict=True):
            chunk.view(view.shape).copy_(view)
        # counted on the host copy: one op, where a count per view was one per layer
        if int(host.count_nonzero()) != in_row:
            return HostRow(row.to("cpu", copy=True), whole_row=True)
        return HostRow(host, whole_row=False)

    def _copy_in(
        self,
        host: HostRow,
        buffer: torch.Tensor,
        slot: int,
        rank: int,
        groups: frozenset[LayerGroup],
    ) -> None:
        if host.whole_row:
            buffer[slot].copy_(host.values)
            return
        # view by view from the host: no packed device copy of the adapter
        views = self._views(buffer, slot, rank, groups)
        chunks = torch.split(host.values, [view.numel() for view in views])
        for view, chunk in zip(views, chunks, strict=True):
            view.copy_(chunk.view(view.shape))
