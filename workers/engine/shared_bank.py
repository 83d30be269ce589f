"""LoRA on a bank of shared experts and on a GLU whose gate and up share one A (Inkling).

Job: adapt the two MLP layouts of Inkling the way Tinker counts them (docs/compatibility.md):

- **A shared-expert bank**: `shared_experts.{gate,up}_proj [n, I, H]`, `down_proj [n, H, I]`,
  every token through each of the n experts, weighted by the router's `gammas`:
  `Σ_e down_e(act(gate_e·x) · up_e·x · γ_e)`. Tinker's adapter is the shared-outer bank of n,
  which is a plain LoRA on the n experts side by side: gate and up each a pair `H → n·I`, down a
  pair `n·I → H`, `3·(H + n·I)` per rank.
- **A dense GLU with one A for gate and up** (`mlp.gate_proj`, `mlp.up_proj` separate linears):
  Tinker's adapter is one pair on the fused `gate_up`, A `[r, H]` and B `[2·I, r]`, the gate's
  rows first: `(H + 2·I) + (I + H)` per rank with the down pair. Each linear is wrapped as any
  linear is (`MultiSlotLoraLinear`), with the shared A and its own rows of B.

The bank lays each pair out as a linear of its own (`<bank>.gate_proj`, `<mlp>.gate_up_proj`):
its A `[r, in]` and B `[out, r]`, so counts, the optimizer, parking and checkpoints treat it like
any linear.

Invariants:
- Without a trained slot in the pass, the wrapped bank runs unchanged.
- The shared A of a dense GLU receives the gradient of both halves (summed into its `.grad`
  view by each half's update).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from workers.engine.lora import LoraPart

BANK_PARAMETERS = ("gate_proj", "up_proj", "down_proj")


def bank_shape(module: nn.Module) -> tuple[int, int, int] | None:
    """(experts n, intermediate I, hidden H) of a shared-expert bank, or None if `module` is
    not one: 3-D `gate_proj`/`up_proj [n, I, H]`, `down_proj [n, H, I]` and `n_shared_experts`."""
    n = getattr(module, "n_shared_experts", None)
    tensors = [getattr(module, name, None) for name in BANK_PARAMETERS]
    if not isinstance(n, int) or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    gate, up, down = cast(list[torch.Tensor], tensors)
    if gate.dim() != 3 or gate.shape[0] != n or up.shape != gate.shape:
        return None
    if tuple(down.shape) != (n, gate.shape[2], gate.shape[1]):
        return None
    return n, int(gate.shape[1]), int(gate.shape[2])


def shares_gate_up_a(mlp: nn.Module) -> bool:
    """Whether a dense MLP is adapted with one A over its gate and up (Inkling's `InklingMLP`)."""
    return type(mlp).__name__ == "InklingMLP" and all(
        isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj")
    )


class SharedBankLora(nn.Module):
    """A shared-expert bank plus each slot's LoRA on its n experts side by side."""

    def __init__(self, base_layer: nn.Module, parts: dict[str, LoraPart]) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.parts = nn.ModuleDict(cast(dict[str, nn.Module], parts))

    def forward(self, hidden_states: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        gate_part, up_part, down_part = (
            cast("LoraPart", self.parts[name]) for name in BANK_PARAMETERS
        )
        segments = gate_part.segments_for(hidden_states)
        base = self.base_layer
        if not any(gate_part.slot_scales[s.slot] for s in segments if s.slot >= 0):
            return cast(torch.Tensor, base(hidden_states, gammas=gammas))
        n, inter, hidden = cast(tuple[int, int, int], bank_shape(base))
        w_gate, w_up, w_down = (cast(torch.Tensor, getattr(base, n_)) for n_ in BANK_PARAMETERS)
        act = cast(Callable[[torch.Tensor], torch.Tensor], base.act_fn)
        x = hidden_states
        gate = x @ w_gate.reshape(n * inter, hidden).T
        up = x @ w_up.reshape(n * inter, hidden).T
        gate_update, up_update = gate_part.update(x, segments), up_part.update(x, segments)
        if gate_update is not None:
            gate = gate + gate_update.to(gate.dtype)
        if up_update is not None:
            up = up + up_update.to(up.dtype)
        weights = gammas.reshape(*x.shape[:-1], n, 1).to(x.dtype)
        activated = (act(gate) * up).reshape(*x.shape[:-1], n, inter) * weights
        activated = activated.reshape(*x.shape[:-1], n * inter)
        # [H, n·I]: the experts' down projections side by side
        out = activated @ w_down.permute(1, 0, 2).reshape(hidden, n * inter).T
        update = down_part.update(activated, segments)
        return out if update is None else out + update.to(out.dtype)
