"""Slot checkpoint I/O: one slot of the adapter bank to and from a PEFT-layout directory
(fused MoE experts in PEFT's `target_parameters` layout, `workers.trainer.expert_files`).

Job: export a tenant's slot as a checkpoint (`workers.trainer.checkpoints` owns the files and their
layout), read a checkpoint and check it against this model before anything is touched, and
write a checked checkpoint into a slot. Which slot a tenant or a snapshot holds is
`workers.trainer.residency`'s decision; this module only moves the values of a slot it is given.

Invariants:
- Reading and checking change no state: a malformed or incompatible checkpoint is a `UserError`
  before any slot is written.
- Writing replaces the whole slot: weights and scales from the checkpoint, pending gradients
  zeroed, Adam moments and step count from the checkpoint (`with_optimizer`) or reset.
- Only the adapter's own rank and trained layer groups are exported, as contiguous fp32 CPU
  copies, so weights and moments round-trip bit-exactly and rank padding stays 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.rules import check_lora_config
from workers.engine.lora import LayerGroup, LayerLayout, LoraBank
from workers.engine.optimizer import SlotAdamW
from workers.trainer.checkpoints import (
    MOMENTS,
    AdapterCheckpoint,
    ModelTargets,
    adapter_key,
    match_layers,
    read_checkpoint,
    tensor_shapes,
    write_checkpoint,
)
from workers.trainer.expert_files import Matrix
from workers.trainer.parking import GROUP_FLAGS, Tenant, trained_groups


@dataclass(frozen=True)
class StoredAdapter:
    """A checkpoint read and checked against this model, ready to be written into a slot."""

    checkpoint: AdapterCheckpoint
    spec: LoraConfig
    groups: frozenset[LayerGroup]  # the layer groups the checkpoint covers


class SlotCheckpoints:
    """Checkpoint I/O for the slots of one bank and its optimizer state."""

    def __init__(
        self, bank: LoraBank, optimizer: SlotAdamW, *, base_model: str, linear_paths: list[str]
    ) -> None:
        self.bank = bank
        self.optimizer = optimizer
        self.base_model = base_model
        # Every linear of the model, so `target_modules` selects exactly the trained ones. A
        # wrapped linear keeps its path, its own `nn.Linear` sitting at `<path>.base_layer`.
        self.linear_paths = list(dict.fromkeys(p.removesuffix(".base_layer") for p in linear_paths))
        # the whole model's experts, whatever share of them this rank of a group holds
        self.model = ModelTargets(
            linear_paths=tuple(self.linear_paths),
            experts={
                path: replace(layer.shape, num_experts=layer.parallel.total)
                if layer.parallel is not None
                else layer.shape
                for path, layer in bank.expert_layers.items()
            },
            sliced=dict(bank.sliced),
            banks=dict(bank.shared_banks),
            glus=dict(bank.glus),
        )

    def save(
        self,
        tenant: Tenant,
        directory: Path,
        *,
        kind: Literal["weights", "sampler_weights"],
        meta: dict[str, Any],
    ) -> int:
        """Write the slot as a PEFT checkpoint (plus optimizer state for `weights`); bytes written.

        In a worker group every rank calls it (each sends its experts' factors) and rank 0
        alone writes the files, the same bytes as one device would."""
        tensors = self._export(tenant, self.bank.weights)
        moments: dict[str, torch.Tensor] | None = None
        if kind == "weights":
            moments = {}
            for moment in MOMENTS:
                buffer = getattr(self.optimizer, moment)
                moments.update(self._export(tenant, buffer, suffix=f".{moment}"))
        checkpoint = AdapterCheckpoint(
            base_model=self.base_model,
            rank=tenant.spec.rank,
            lora_alpha=tenant.lora_alpha,
            tensors=tensors,
            spec=tenant.spec,
            moments=moments,
            step=self.optimizer.steps[tenant.slot],
            meta=meta,
        )
        if self.bank.collective.rank:
            return 0
        return write_checkpoint(directory, checkpoint, kind=kind, model=self.model)

    def read(self, directory: Path, *, with_optimizer: bool) -> StoredAdapter:
        """A checkpoint checked against this model; a `UserError` if it cannot be loaded."""
        checkpoint = read_checkpoint(directory, with_optimizer=with_optimizer, model=self.model)
        groups = match_layers(checkpoint, self.bank.whole_layouts, max_rank=self.bank.max_rank)
        spec = checkpoint.spec or LoraConfig(
            rank=checkpoint.rank,
            **{flag: group in groups for group, flag in GROUP_FLAGS.items()},
        )
        check_lora_config(spec, self.bank.max_rank)
        if spec.rank != checkpoint.rank or groups != trained_groups(spec):
            raise UserError(f"{directory.name}: the adapter's layers do not match its LoRA spec")
        return StoredAdapter(checkpoint, spec, frozenset(groups))

    def write(self, slot: int, stored: StoredAdapter, *, with_optimizer: bool) -> Tenant:
        """Overwrite `slot` with a checked checkpoint; the slot's old content goes entirely."""
        checkpoint, spec = stored.checkpoint, stored.spec
        self.optimizer.reset_slot(slot)
        buffers = [("", self.bank.weights)]
        if with_optimizer:
            buffers += [(f".{moment}", getattr(self.optimizer, moment)) for moment in MOMENTS]
            self.optimizer.steps[slot] = checkpoint.step
        self.bank.clear_slot(slot)
        self.bank.set_scales(
            slot, rank=spec.rank, groups=stored.groups, lora_alpha=checkpoint.lora_alpha
        )
        values = {**checkpoint.tensors, **(checkpoint.moments or {})}
        for suffix, buffer in buffers:
            for layout, a, b in self.bank.slot_views(buffer, slot, spec.rank):
                if layout.group in stored.groups:
                    pairs: tuple[tuple[Matrix, torch.Tensor], ...] = (("A", a), ("B", b))
                    for matrix, view in pairs:
                        value = values[adapter_key(layout.path, matrix) + suffix]
                        view.copy_(_own_experts(layout, matrix, value).view(view.shape))
        return Tenant(slot, spec, checkpoint.lora_alpha)

    def _export(
        self, tenant: Tenant, buffer: torch.Tensor, *, suffix: str = ""
    ) -> dict[str, torch.Tensor]:
        """The trained layers' matrices of a slot in `buffer`, by key (+ suffix), on the CPU:
        linears as PEFT has them, experts in Tinker's shared-outer form."""
        groups = trained_groups(tenant.spec)
        rank = tenant.spec.rank
        exported: dict[str, torch.Tensor] = {}
        views = self.bank.slot_views(buffer, tenant.slot, rank)
        for (layout, a, b), whole in zip(views, self.bank.whole_layouts, strict=True):
            if layout.group in groups:
                a_shape, b_shape = tensor_shapes(whole, rank)
                triples: tuple[tuple[Matrix, torch.Tensor, tuple[int, ...]], ...] = (
                    ("A", a, a_shape),
                    ("B", b, b_shape),
                )
                for matrix, view, shape in triples:
                    if _split(layout, matrix):  # every rank's experts, in rank order
                        view = self.bank.collective.all_gather_rows(view)
                    exported[adapter_key(layout.path, matrix) + suffix] = _exported(view).view(
                        shape
                    )
        return exported


def _split(layout: LayerLayout, matrix: str) -> bool:
    """Whether this factor holds one matrix per expert of a block split over a group's ranks."""
    return bool(layout.experts_total and (layout.a_experts if matrix == "A" else layout.b_experts))


def _own_experts(layout: LayerLayout, matrix: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a whole factor as a checkpoint holds it (all of it if not split)."""
    if not _split(layout, matrix):
        return value
    count = layout.a_experts if matrix == "A" else layout.b_experts
    return value[layout.expert_offset : layout.expert_offset + count]


def _exported(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 CPU copy, detached from the live buffer."""
    return tensor.detach().to("cpu", torch.float32).clone(memory_format=torch.contiguous_format)
