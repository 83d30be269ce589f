"""The dense reference of the multi-slot expert LoRA: every expert's `W + ΔW` materialised per
slot, token by token, which `workers.engine.moe_lora`'s grouped computation must equal."""

from __future__ import annotations

import torch

from workers.engine.lora import BASE_SLOT
from workers.engine.moe_lora import ExpertProjection, MultiSlotLoraExperts, expert_weights


def dense_reference(
    layer: MultiSlotLoraExperts,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """Every expert's dense `W + ΔW` materialised per slot, token by token: the slow, obvious
    computation the grouped one must equal (tests). `token_slots[t]` is a slot or `BASE_SLOT`."""
    shape = layer.shape
    frozen = expert_weights(layer.base_layer, shape)

    def delta(projection: ExpertProjection, slot: int, expert: int) -> torch.Tensor:
        a, b = layer.factor(projection, "A")[slot], layer.factor(projection, "B")[slot]
        a, b = a[expert] if a.dim() == 3 else a, b[expert] if b.dim() == 3 else b
        rank = layer.slot_ranks[slot]
        return layer.slot_scales[slot] * (b[:, :rank] @ a[:rank])  # [out, in]

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        slot = int(token_slots[t])
        for k in range(top_k_index.shape[1]):
            expert = int(top_k_index[t, k])
            w_gu, w_d = frozen.gate_up[expert], frozen.down[expert]
            if shape.transposed:
                w_gu, w_d = w_gu.t(), w_d.t()  # [2I, H], [H, I]
            if slot != BASE_SLOT and layer.slot_scales[slot] != 0.0 and not shape.gated:
                w_gu, w_d = w_gu + delta("w1", slot, expert), w_d + delta("w2", slot, expert)
            elif slot != BASE_SLOT and layer.slot_scales[slot] != 0.0:
                gate, up = delta("w1", slot, expert), delta("w3", slot, expert)
                fused = torch.cat([gate, up]) if shape.concatenated else torch.stack([gate, up], 1)
                w_gu, w_d = w_gu + fused.reshape(w_gu.shape), w_d + delta("w2", slot, expert)
            gate_up = x[t] @ w_gu.t()
            if frozen.gate_up_bias is not None:
                gate_up = gate_up + frozen.gate_up_bias[expert]
            y = frozen.apply_gate(gate_up.unsqueeze(0))[0] @ w_d.t()
            if frozen.down_bias is not None:
                y = y + frozen.down_bias[expert]
            out[t] = out[t] + top_k_weights[t, k] * y
    return out
