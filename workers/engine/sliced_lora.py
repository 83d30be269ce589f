"""LoRA per output slice of a fused projection, as Tinker adapts them.

Job: find the frozen linears whose output rows stack several projections that Tinker adapts
one by one, and add each slice's own LoRA pair to its rows (docs/compatibility.md, "Which
linears an adapter trains"):

- Mamba2's `in_proj` (Nemotron-H's `mixer`) stacks z, x, B, C and dt: only z and x are
  adapted, each with its own A, so an adapter costs `2·(H + d_inner)` per rank there, not
  `H + (2·d_inner + 2·groups·state + heads)`;
- Gated DeltaNet's `in_proj_qkv` (Qwen3.5's `linear_attn`) stacks q, k and v: three pairs,
  `2·(H + K) + (H + V)`.

The bank lays each slice out as a linear of its own beside the fused one, under Tinker's name
(`part_path`: `linear_attn.in_proj_q`, `mixer.gate_proj` for Mamba2's z, `mixer.x_proj` for x):
its A `[r, in]` and B `[slice rows, r]`. So counts, the optimizer, parking and
checkpoints treat it like any linear; a PEFT file holds the slices of one linear as a block
LoRA on it (`workers/trainer/checkpoints.py`).

Invariants:
- Rows of the output outside every slice get no update; a slice's rows get exactly its pair's.
- The frozen linear keeps its path's `base_layer` and computes its whole output once.
- Routing, scales and ranks are the slot's, as for `workers.engine.lora.MultiSlotLoraLinear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from workers.engine.lora import LoraPart


@dataclass(frozen=True)
class LinearSlice:
    """Output rows `[start, stop)` of a fused linear, adapted as `<path>.<name>`."""

    name: str
    start: int
    stop: int


def linear_slices(parent: nn.Module, leaf: str) -> tuple[LinearSlice, ...] | None:
    """The slices Tinker adapts of linear `leaf` of block `parent`, or None: adapted whole."""
    kind = type(parent).__name__
    if leaf == "in_proj" and "Mamba" in kind:
        inner = getattr(parent, "intermediate_size", None)
        if isinstance(inner, int):  # rows z, x, then B, C, dt (not adapted)
            return (LinearSlice("gate_proj", 0, inner), LinearSlice("x_proj", inner, 2 * inner))
    if leaf == "in_proj_qkv":
        key, value = getattr(parent, "key_dim", None), getattr(parent, "value_dim", None)
        if isinstance(key, int) and isinstance(value, int):
            return (
                LinearSlice("in_proj_q", 0, key),
                LinearSlice("in_proj_k", key, 2 * key),
                LinearSlice("in_proj_v", 2 * key, 2 * key + value),
            )
    return None


def part_path(path: str, piece: LinearSlice) -> str:
    """Where the pair of slice `piece` of linear `path` is kept: beside the linear, under
    Tinker's name for it (`linear_attn.in_proj_q`, Mamba2's `mixer.gate_proj` for z and
    `mixer.x_proj` for x), as tinker-cookbook's merge reads an adapter."""
    return f"{path.rpartition('.')[0]}.{piece.name}"


@dataclass(frozen=True)
class SlicedLinear:
    """A linear adapted per slice: its output rows and its slices, in row order."""

    out_features: int
    slices: tuple[LinearSlice, ...]


def find_sliced_linears(model: nn.Module, paths: list[str]) -> dict[str, SlicedLinear]:
    """Of the target linears `paths`, the ones adapted per slice, with their slices."""
    found = {}
    for path in paths:
        parent_path, _, leaf = path.rpartition(".")
        slices = linear_slices(model.get_submodule(parent_path), leaf)
        if slices is not None:
            linear = cast(nn.Linear, model.get_submodule(path))
            found[path] = SlicedLinear(int(linear.out_features), slices)
    return found


class SlicedLoraLinear(nn.Module):
    """A frozen linear plus one LoRA pair per output slice, for every slot."""

    def __init__(
        self, base_layer: nn.Linear, parts: dict[str, LoraPart], slices: tuple[LinearSlice, ...]
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.parts = nn.ModuleDict(cast(dict[str, nn.Module], parts))
        self.slices = slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base_layer(x)
        first = cast("LoraPart", self.parts[self.slices[0].name])
        segments = first.segments_for(x)
        pieces: list[torch.Tensor] = []
        at, any_update = 0, False
        for piece in self.slices:
            update = cast("LoraPart", self.parts[piece.name]).update(x, segments)
            if piece.start > at:
                pieces.append(y.new_zeros(*y.shape[:-1], piece.start - at))
            if update is None:
                update = y.new_zeros(*y.shape[:-1], piece.stop - piece.start)
            else:
                any_update = True
            pieces.append(update.to(y.dtype))
            at = piece.stop
        if not any_update:
            return y
        if at < y.shape[-1]:
            pieces.append(y.new_zeros(*y.shape[:-1], y.shape[-1] - at))
        return y + torch.cat(pieces, -1)
