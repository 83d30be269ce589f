"""Expert parallelism: each rank of a worker group keeps 1/N of every fused experts block.

Job: cut a loaded model's fused experts modules down to this rank's experts before the adapter
bank is built, so the frozen expert weights and each slot's per-expert LoRA factors take 1/N of
the memory on every rank. What a pass then does with them is `MultiSlotLoraExperts`'s
(`workers.engine.moe_lora`): every rank gets every token, computes its own experts' share, and
the shares are summed. Attention, embeddings, routers, shared experts and their LoRA stay whole
on every rank.

Rank r of N holds experts `r·E/N .. (r+1)·E/N - 1` of each block: a block whose expert count N
does not divide is refused, naming it.
"""

from __future__ import annotations

import torch
from torch import nn

from protocol.errors import ServerError
from workers.engine.collective import Collective
from workers.engine.lora import ExpertSlice, find_expert_modules

# The fused experts module's tensors with one leading row per expert (transformers 5; `up_proj`:
# non-gated experts).
_PER_EXPERT = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def split_experts(model: nn.Module, collective: Collective) -> dict[str, ExpertSlice]:
    """Keep only this rank's experts of every fused experts block; what each block kept."""
    if not collective.parallel:
        return {}
    slices: dict[str, ExpertSlice] = {}
    for path, shape in find_expert_modules(model).items():
        total = shape.num_experts
        if total % collective.world:
            raise ServerError(
                f"{path}: {total} experts do not split evenly over {collective.world} devices;"
                " choose a device count that divides it"
            )
        count = total // collective.world
        offset = collective.rank * count
        module = model.get_submodule(path)
        for name in _PER_EXPERT:
            tensor = getattr(module, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[0] == total:
                kept = tensor.detach()[offset : offset + count].clone()
                setattr(module, name, nn.Parameter(kept, requires_grad=False))
        if hasattr(module, "num_experts"):
            setattr(module, "num_experts", count)  # noqa: B010  (typed as a tensor by torch)
        slices[path] = ExpertSlice(offset=offset, total=total)
    return slices
