"""The collectives of a worker group: what the engine's maths asks of the other ranks.

Job: one small interface over `torch.distributed` for the engine (expert parallelism in the MoE
layers, the shared expert factors' gradients, the optimizer's per-slot agreements), with a
one-process implementation that does nothing, so the engine's code is the same for one device
and for N.

- `Collective` (one rank): every reduction is the identity, every gather returns its input.
- `ProcessGroupCollective`: the group's default process group for tensors on the engine's device
  (gloo on CPU, NCCL on GPUs); `all_gather_rows` and the worker group's control messages go
  through a gloo group on the host.

The autograd functions that place the expert-parallel region in a pass:

- `ExpertInput(x, weights)`: forward the identity; backward sums both gradients over the ranks
  (each rank's gradient covers only its own experts' rows), in one all-reduce, so the order of
  the collectives never depends on which branch a rank's local graph took.
- `ExpertOutput(partial, x, weights, anchor)`: forward sums the ranks' partial outputs; backward
  the identity for `partial` and zeros for `x` and `weights`, so `ExpertInput`'s backward runs
  on every rank whatever its experts computed (a rank whose experts saw no row of a trained
  slot would otherwise skip it, and the others would wait for it for ever). `anchor` makes the
  output require a gradient on every rank alike (see `workers.engine.moe_lora`).

Invariants: every rank calls the same collectives in the same order; a reduction's result is the
same bits on every rank (one reduced buffer, broadcast by the backend), so replicated values
never drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class Collective:
    """One rank: nothing to exchange."""

    rank = 0
    world = 1

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the ranks, in place; returns it."""
        return tensor

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on each) stacked `[world, ...]`, on the host."""
        return tensor.detach().to("cpu").unsqueeze(0)

    def all_gather_into(self, out: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """Every rank's `part` (same shape on each), in rank order along dim 0 of `out`, on the
        engine's device."""
        return out.copy_(part)

    def in_turns(self, work: Callable[[], T]) -> T:
        """`work()` on each rank, one rank after the other in rank order (each waits for the one
        before it): what every rank loads, loaded one at a time."""
        return work()

    def agree(self, flags: list[bool]) -> list[bool]:
        """Per position, whether any rank's flag is set (the same answer on every rank)."""
        return [bool(v) for v in self.agree_max([int(f) for f in flags])]

    def agree_max(self, values: list[int]) -> list[int]:
        """Per position, the largest of the ranks' values (the same answer on every rank)."""
        return list(values)


class ProcessGroupCollective(Collective):
    """The ranks of an initialised default process group (`torch.distributed`)."""

    def __init__(self, device: torch.device, host_group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
        # gloo for host tensors (always available); the default group for the device's tensors
        self.host_group = host_group

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.detach().to("cpu").contiguous()
        parts = [torch.empty_like(host) for _ in range(self.world)]
        dist.all_gather(parts, host, group=self.host_group)
        return torch.stack(parts)

    def all_gather_into(self, out: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        dist.all_gather(list(out.chunk(self.world)), part.contiguous())
        return out

    def in_turns(self, work: Callable[[], T]) -> T:
        done: list[T] = []
        for turn in range(self.world):
            if turn == self.rank:
                done.append(work())
            dist.barrier(group=self.host_group)
        return done[0]

    def agree_max(self, values: list[int]) -> list[int]:
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        return [int(v) for v in self.all_reduce_max(tensor).tolist()]


class ExpertInput(torch.autograd.Function):
    """Identity forward; the gradients of `x` and `weights` summed over the ranks backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weights: torch.Tensor, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.collective = collective
        ctx.shapes = (x.shape, weights.shape)
        return x.view_as(x), weights.view_as(weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x, grad_w = grads
        n = grad_x.numel()
        both = torch.cat([grad_x.reshape(-1), grad_w.reshape(-1).to(grad_x.dtype)])
        ctx.collective.all_reduce_sum(both)
        x_shape, w_shape = ctx.shapes
        return (
            both[:n].view(x_shape),
            both[n:].view(w_shape).to(grad_w.dtype),
            None,
        )


class ExpertOutput(torch.autograd.Function):
    """The ranks' partial outputs summed forward; identity (and zeros for the inputs) backward."""

    @staticmethod
    def forward(
        ctx: Any,
        partial: torch.Tensor,
        x: torch.Tensor,
        weights: torch.Tensor,
        anchor: torch.Tensor,
        collective: Collective,
    ) -> torch.Tensor:
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (x, weights)]
        # a copy: the reduction is in place, and `partial` may be saved for its own backward
        return collective.all_reduce_sum(partial.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) if needed else None
            for (shape, dtype, device), needed in zip(
                ctx.inputs, ctx.needs_input_grad[1:3], strict=True
            )
        ]
        return grads[0], *zeros, None, None
