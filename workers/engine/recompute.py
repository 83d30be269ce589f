"""Activation checkpointing per decoder layer in the shared pass (`docs/long-context.md`).

Job: make a long training pass keep, per decoder layer, only the layer's input (and the few
outputs below) instead of every intermediate the backward needs; the backward runs the layer's
forward again to get them back. `LayerRecompute` wraps each decoder layer's `forward` in place
(no module is renamed, so the bank's paths, checkpoints and parking see the model as before) and
decides per pass whether to recompute (`PassRunner` sets `on` from the pass's token count).

What the recomputation does not redo:
- a MoE router's choice of experts. Every `topk` of the first forward records its indices, and
  the recomputed forward's `topk` returns them, with the values gathered from its own scores
  (so the weights' gradient flows as in the first): the experts a token reaches, and the
  per-expert row counts the kernels are planned from, are the same in both (a tie that a
  nondeterministic kernel breaks another way would otherwise route the recomputation
  differently);
- the fused attention kernels' outputs (SDPA's flash, efficient and
  cuDNN variants; torch's selective checkpointing keeps them): attention is what a long row
  spends its FLOPs on, and its output is one hidden state's worth a token.

Invariants:
- The recomputed forward runs with the routing of the pass it belongs to: the segments bound
  when the layer first ran are bound again for it (the backward runs after the pass has
  unbound them), and so is the pass's split over a group's ranks (`context_parallel.py`). So each row's LoRA terms, and the gradients they give each slot, are those of
  the forward without recomputation.
- Without grad (a forward-only pass, the samplers' prefill and decode), or with `on` False, a
  layer runs exactly as it did unwrapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from protocol.errors import ServerError
from workers.engine.context_parallel import current as current_split
from workers.engine.context_parallel import prefix_causal_attention, splitting
from workers.engine.lora import SlotRouting

_aten = torch.ops.aten
ATTENTION_OPS = frozenset(
    [
        *(
            op
            for name in (
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention",
            )
            if (op := getattr(getattr(_aten, name, None), "default", None)) is not None
        ),
        # a pass split over ranks, on the CPU (`context_parallel.prefix_causal_attention`)
        prefix_causal_attention._opoverload,
    ]
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _TopkReplay(TorchFunctionMode):
    """Records each `topk`'s indices (the first forward), or replays them in order (the
    recomputation), the values gathered from the scores at those indices."""

    def __init__(self, indices: list[torch.Tensor], *, replay: bool) -> None:
        super().__init__()
        self.indices, self.replay, self.next = indices, replay, 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        # Both runs call `topk` and gather its values: the same operations in the same order,
        # as selective checkpointing requires of a recomputation.
        indices = func(*args, **kwargs).indices
        if not self.replay:
            self.indices.append(indices.detach())
        elif self.next < len(self.indices):
            indices = self.indices[self.next]
            self.next += 1
        else:
            raise ServerError("a recomputed layer chose experts more times than its forward")
        scores = args[0]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        return torch.return_types.topk((scores.gather(dim, indices), indices))


_TOPK = frozenset({torch.topk, torch.Tensor.topk})


@contextmanager
def _entered(*managers: AbstractContextManager[Any]) -> Iterator[None]:
    with ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """`checkpoint`'s two contexts (the first forward's, the recomputation's) for one layer
    call."""
    indices: list[torch.Tensor] = []
    saving, replaying = create_selective_checkpoint_contexts(_policy)  # type: ignore[no-untyped-call]
    return (
        _entered(saving, _TopkReplay(indices, replay=False)),
        _entered(replaying, _TopkReplay(indices, replay=True)),
    )


class LayerRecompute:
    """The decoder layers of one model, each recomputed in the backward of a pass with `on`."""

    def __init__(self, layers: list[nn.Module], routing: SlotRouting) -> None:
        self.routing = routing
        self.on = False
        for layer in layers:
            layer.forward = self._wrapped(layer.forward)

    @classmethod
    def install(cls, decoder: nn.Module, routing: SlotRouting) -> LayerRecompute | None:
        """Wrap `decoder`'s layers (its `layers` list); None for a decoder without one."""
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            return None
        return cls(list(layers), routing)

    def _wrapped(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        routing = self.routing

        def layer_forward(*args: Any, **kwargs: Any) -> Any:
            if not (self.on and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            segments = routing.segments
            split = current_split()

            def run(*a: Any, **k: Any) -> Any:
                if routing.segments:  # the first forward, inside its pass
                    return forward(*a, **k)
                # the recomputation, in the backward: the pass's routing and split again
                with routing.bind(segments), splitting(split):
                    return forward(*a, **k)

            return checkpoint(run, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        return layer_forward
