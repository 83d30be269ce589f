"""A dense model's frozen linears split over a worker group's ranks, gathered when used.

Job: in a worker group on a dense base model, each rank keeps 1/N of the rows of every frozen
linear of the decoder layers (attention and MLP projections; the embedding and the output layer
stay whole), so the base model takes about 1/N of each device. A projection's weight is gathered
from the ranks just before its matmul, forward and again backward (the input's gradient needs
it), and dropped after: the gathered weight is the original one, bit for bit, so a pass computes
exactly what one device computes. Adapters, gradients and Adam moments are fp32 and whole on
every rank, as every rank computes the same pass.

Why this and not FSDP2 or tensor parallelism: the weights are frozen, so the only traffic is the
all-gather (FSDP2's reduce-scatter of gradients has nothing to do), and the adapter bank's
`[S, P]` rows stay one plain tensor per rank, which FSDP2's DTensor parameters would split and
tensor parallelism would cut across heads and rows. The cost is FSDP's: every rank receives the
decoder's weights twice per pass, (N - 1)/N of their bytes each time (`bench/group_step.py`
measures it).

Invariants: the gathered weight equals the original (rows padded to a multiple of N with zeros
that are cut off); every rank gathers the same weights in the same order (the same pass).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.collective import Collective
from workers.engine.lora import find_target_linears


class GatheredLinear(nn.Linear):
    """A frozen `nn.Linear` whose `weight` holds this rank's rows only; the whole weight is
    gathered for each use. `in_features` and `out_features` are the whole layer's."""

    same_as_linear = True  # computes what the linear it replaced did (`lora.computes_linear`)

    def __init__(self, linear: nn.Linear, collective: Collective) -> None:
        out_features, in_features = linear.weight.shape
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.collective = collective
        rows = -(-out_features // collective.world)
        padded = linear.weight.detach().new_zeros(rows * collective.world, in_features)
        padded[:out_features] = linear.weight.detach()
        mine = padded[collective.rank * rows : (collective.rank + 1) * rows].clone()
        self.weight = nn.Parameter(mine, requires_grad=False)
        self.bias = linear.bias  # small: whole on every rank (None for most)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GatheredMatmul.apply(x, self.weight, self.bias, self)  # type: ignore[no-untyped-call,no-any-return]

    def gathered(self) -> torch.Tensor:
        """The whole weight `[out, in]`, gathered from every rank."""
        shard = self.weight.detach()
        whole = shard.new_empty(shard.shape[0] * self.collective.world, shard.shape[1])
        self.collective.all_gather_into(whole, shard)
        return whole[: self.out_features]


class GatheredMatmul(torch.autograd.Function):
    """`x · Wᵀ + b` with W gathered forward and gathered again backward (never kept)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, shard: torch.Tensor, bias: torch.Tensor | None, layer: Any
    ) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.gathered().to(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight = ctx.layer.gathered().to(grads[0].dtype)
        return grads[0] @ weight, None, None, None


def shard_frozen_linears(model: nn.Module, collective: Collective) -> int:
    """Split every decoder linear an adapter may train (attention and MLP, not the output
    layer) over the ranks; the number of linears split."""
    if not collective.parallel:
        return 0
    count = 0
    for path, group in find_target_linears(model).items():
        if group == "unembed":
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, leaf)
        if type(linear) is not nn.Linear:
            continue
        setattr(parent, leaf, GatheredLinear(linear, collective))
        count += 1
    return count
