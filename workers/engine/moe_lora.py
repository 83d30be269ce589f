"""Multi-slot expert LoRA: Tinker's shared-outer adapter on a fused Mixture-of-Experts block.

Job: replace one fused experts module (transformers 5: `gate_up_proj [E, 2I, H]` and
`down_proj [E, H, I]`, or their transposes) by a module that computes the same experts forward
plus every routed row's own slot's LoRA update, so one pass serves many tenants of a MoE model.

The adapter of one slot on one block is Tinker's "shared-outer" shape (`get_lora_param_count`
of tinker-cookbook): the factor touching the hidden size is shared by the experts, the other is
per expert.

    gate (w1): A1 [r, H] shared,  B1 [E, I, r] per expert
    up   (w3): A3 [r, H] shared,  B3 [E, I, r] per expert
    down (w2): A2 [E, r, I] per expert,  B2 [H, r] shared

For a token t routed to expert e with weight w and slot s (scale c = alpha / rank):

    gate_up = x·W_gu[e]ᵀ (+ bias) + c·[ (x·A1ᵀ)·B1[e]ᵀ ; (x·A3ᵀ)·B3[e]ᵀ ]   before the activation
    h       = act(gate_up)                                              the module's `_apply_gate`
    y_t     = Σ_k w·(h·W_d[e]ᵀ (+ bias))  +  c·(Σ_k w·(h·A2[e]ᵀ))·B2ᵀ

so the shared factors run once per token (the H-wide product of the down update runs once per
token after the routing sum, not k times), the per-expert factors once per routed row, grouped
by (expert, slot); no `[rows, I, r]` weight is ever gathered.

Invariants:
- Rows of no slot (`BASE_SLOT`), of a slot with scale 0, and every call outside a pass run the
  wrapped module unchanged, so a model with no active adapter computes exactly the base.
- The adapters are views of the bank's `[S, P]` rows (`workers.engine.lora.LoraBank`); each is
  unbound once per call, so autograd hands each slot's gradient back as one stacked tensor and
  slots absent from the pass receive exactly zero.
- Only the slot's true rank is computed; rank padding stays exactly 0.

Place in the flow: `LoraBank` finds fused experts modules (`find_expert_modules`), lays their
factors out in its rows, and swaps in `MultiSlotLoraExperts`; the routing of a pass is the same
`SlotRouting` the linear layers read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from protocol.errors import ServerError

if TYPE_CHECKING:
    from workers.engine.lora import Segment, SlotRouting

ExpertProjection = Literal["w1", "w3", "w2"]
# Tinker's names: w1 gate, w3 up, w2 down.
EXPERT_PROJECTIONS: tuple[ExpertProjection, ...] = ("w1", "w3", "w2")
_BASE_SLOT = -1  # `workers.engine.lora.BASE_SLOT`


@dataclass(frozen=True)
class ExpertShape:
    """How one fused experts module lays out its weights."""

    num_experts: int
    hidden: int  # H
    intermediate: int  # I
    transposed: bool  # gate_up_proj [E, H, 2I] and down_proj [E, I, H] (gpt-oss)
    concatenated: bool  # gate rows then up rows; False: interleaved gate0, up0, gate1, …
    has_bias: bool


def expert_shape(module: nn.Module) -> ExpertShape | None:
    """The layout of a fused experts module, or None if `module` is not one.

    A fused experts module holds 3-D `gate_up_proj` and `down_proj` parameters and is called as
    `experts(hidden_states, top_k_index, top_k_weights)`; transformers 5 marks its layout with
    `is_transposed` / `is_concatenated` / `has_bias` and provides `_apply_gate`.
    """
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    transposed = bool(getattr(module, "is_transposed", False))
    n_experts = int(gate_up.shape[0])
    if transposed:
        hidden, intermediate = int(gate_up.shape[1]), int(gate_up.shape[2]) // 2
        down_shape = (n_experts, intermediate, hidden)
    else:
        hidden, intermediate = int(gate_up.shape[2]), int(gate_up.shape[1]) // 2
        down_shape = (n_experts, hidden, intermediate)
    if tuple(down.shape) != down_shape or not hasattr(module, "_apply_gate"):
        return None
    return ExpertShape(
        num_experts=n_experts,
        hidden=hidden,
        intermediate=intermediate,
        transposed=transposed,
        concatenated=bool(getattr(module, "is_concatenated", True)),
        has_bias=bool(getattr(module, "has_bias", False)),
    )


@dataclass(frozen=True)
class ExpertWeights:
    """The frozen tensors of a fused experts module, typed."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    apply_gate: Callable[[torch.Tensor], torch.Tensor]


def expert_weights(module: nn.Module, shape: ExpertShape) -> ExpertWeights:
    def tensor(name: str) -> torch.Tensor | None:
        value = getattr(module, name, None)
        return value if isinstance(value, torch.Tensor) else None

    gate_up, down = tensor("gate_up_proj"), tensor("down_proj")
    assert gate_up is not None and down is not None  # `expert_shape` found them
    return ExpertWeights(
        gate_up,
        down,
        tensor("gate_up_proj_bias") if shape.has_bias else None,
        tensor("down_proj_bias") if shape.has_bias else None,
        cast(Callable[[torch.Tensor], torch.Tensor], module._apply_gate),
    )


def projection_shape(shape: ExpertShape, projection: ExpertProjection) -> tuple[int, int, int, int]:
    """(in_features, out_features, A experts, B experts) of one projection's factors, where an
    experts count of 0 marks the shared (2-D) factor."""
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    if projection == "w2":
        return i, h, e, 0
    return h, i, 0, e


@dataclass
class ExpertFactors:
    """One projection's factors over every slot, as views of the bank's weights."""

    lora_A: nn.Parameter  # [S, r, in] shared, or [S, E, r, in]
    lora_B: nn.Parameter  # [S, E, out, r], or [S, out, r] shared


class MultiSlotLoraExperts(nn.Module):
    """A frozen fused experts module plus each slot's shared-outer expert LoRA."""

    def __init__(
        self,
        base_layer: nn.Module,
        *,
        shape: ExpertShape,
        factors: dict[ExpertProjection, ExpertFactors],
        slot_scales: list[float],
        slot_ranks: list[int],
        routing: SlotRouting,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.shape = shape
        self.group = "mlp"
        for projection in EXPERT_PROJECTIONS:
            self.register_parameter(f"{projection}_lora_A", factors[projection].lora_A)
            self.register_parameter(f"{projection}_lora_B", factors[projection].lora_B)
        self.slot_scales = slot_scales  # shared with the bank: alpha/rank, 0 where not trained
        self.slot_ranks = slot_ranks  # shared with the bank: the slot's true rank
        self.routing = routing

    def factor(self, projection: ExpertProjection, matrix: Literal["A", "B"]) -> torch.Tensor:
        return cast(torch.Tensor, getattr(self, f"{projection}_lora_{matrix}"))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        segments = self.routing.segments
        active = self._active(segments, hidden_states.shape[0])
        if not active:
            return cast(torch.Tensor, self.base_layer(hidden_states, top_k_index, top_k_weights))
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, active)

    def _active(
        self, segments: Sequence[Segment], n_tokens: int
    ) -> list[tuple[int, int, int, float, int]]:
        """(slot, start, stop, scale, rank) in tokens for the segments with an update."""
        if not segments:
            return []
        n_rows = self.routing.n_rows
        if n_rows <= 0 or n_tokens % n_rows:
            raise ServerError(f"MoE LoRA layer got {n_tokens} tokens for a pass of {n_rows} rows")
        per_row = n_tokens // n_rows
        active = []
        for segment in segments:
            if segment.slot == _BASE_SLOT or segment.stop <= segment.start:
                continue
            scale = self.slot_scales[segment.slot]
            if scale != 0.0:
                rank = self.slot_ranks[segment.slot]
                start, stop = segment.start * per_row, segment.stop * per_row
                active.append((segment.slot, start, stop, scale, rank))
        return active


def experts_forward(
    layer: MultiSlotLoraExperts,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    active: list[tuple[int, int, int, float, int]],
) -> torch.Tensor:
    """The experts output `[T, H]` of tokens `x [T, H]` with the active segments' expert LoRA.

    Routed rows j = (token, k) are sorted by (expert, active segment); each expert's base
    weights run once over its rows, each (expert, segment) group's per-expert factors once over
    its rows. A loop over the non-empty groups: the CPU's way (and correct on any device).
    """
    base = layer.base_layer
    shape = layer.shape
    n_tokens, top_k = top_k_index.shape
    device, dtype = x.device, x.dtype
    n_experts, n_active = shape.num_experts, len(active)
    # Which active segment each token belongs to (n_active: none).
    token_segment = torch.full((n_tokens,), n_active, dtype=torch.long, device=device)
    for index, (_, start, stop, _, _) in enumerate(active):
        token_segment[start:stop] = index
    flat_expert = top_k_index.reshape(-1).to(torch.long)
    flat_token = torch.arange(n_tokens, device=device).repeat_interleave(top_k)
    flat_weight = top_k_weights.reshape(-1)
    valid = (flat_expert >= 0) & (flat_expert < n_experts)  # an index E is "no expert" (padding)
    keys = flat_expert * (n_active + 1) + token_segment[flat_token]
    keys = torch.where(valid, keys, n_experts * (n_active + 1))
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=n_experts * (n_active + 1) + 1).tolist()
    routed_token = flat_token[order]
    routed_weight = flat_weight[order].unsqueeze(-1)
    n_routed = sum(counts[: n_experts * (n_active + 1)])

    # The shared gate/up A factors, once per token of each active segment (scaled).
    a_gate = layer.factor("w1", "A").unbind(0)
    a_up = layer.factor("w3", "A").unbind(0)
    shrunk: list[tuple[torch.Tensor, torch.Tensor]] = []
    for slot, start, stop, scale, rank in active:
        rows = x[start:stop]
        shrunk.append(
            (
                F.linear(rows, a_gate[slot][:rank].to(dtype)) * scale,
                F.linear(rows, a_up[slot][:rank].to(dtype)) * scale,
            )
        )
    b_gate = layer.factor("w1", "B").unbind(0)
    b_up = layer.factor("w3", "B").unbind(0)
    a_down = layer.factor("w2", "A").unbind(0)
    b_down = layer.factor("w2", "B").unbind(0)
    per_slot: dict[int, tuple[list[torch.Tensor], ...]] = {}

    def slot_factors(slot: int) -> tuple[list[torch.Tensor], ...]:
        if slot not in per_slot:
            per_slot[slot] = (
                list(b_gate[slot].unbind(0)),
                list(b_up[slot].unbind(0)),
                list(a_down[slot].unbind(0)),
            )
        return per_slot[slot]

    frozen = expert_weights(base, shape)
    gate_weight, down_weight = frozen.gate_up, frozen.down
    gate_bias, down_bias = frozen.gate_up_bias, frozen.down_bias
    gate_up_pieces: list[torch.Tensor] = []
    group_spans: list[tuple[int, int, int, int]] = []  # (expert, segment, start, stop) of rows
    row = 0
    for expert in range(n_experts):
        expert_rows = sum(counts[expert * (n_active + 1) : (expert + 1) * (n_active + 1)])
        if not expert_rows:
            continue
        tokens = routed_token[row : row + expert_rows]
        gate_up = _project(x[tokens], gate_weight[expert], shape.transposed, gate_bias, expert)
        deltas: list[torch.Tensor] = []
        group_row = row
        for segment in range(n_active + 1):
            n = counts[expert * (n_active + 1) + segment]
            if not n:
                continue
            if segment < n_active:
                slot, start, *_ = active[segment]
                local = routed_token[group_row : group_row + n] - start
                u_gate, u_up = shrunk[segment]
                bg, bu, _ = slot_factors(slot)
                rank = active[segment][4]
                d_gate = F.linear(u_gate[local], bg[expert][:, :rank].to(dtype))
                d_up = F.linear(u_up[local], bu[expert][:, :rank].to(dtype))
                deltas.append(_fuse_gate_up(d_gate, d_up, shape.concatenated))
                group_spans.append((expert, segment, group_row, group_row + n))
            else:
                deltas.append(gate_up.new_zeros(n, gate_up.shape[-1]))
            group_row += n
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
        gate_up_pieces.append(gate_up + delta)
        row += expert_rows
    gate_up_all = gate_up_pieces[0] if len(gate_up_pieces) == 1 else torch.cat(gate_up_pieces)
    hidden = frozen.apply_gate(gate_up_all)  # [n_routed, I]

    out_pieces: list[torch.Tensor] = []
    row = 0
    for expert in range(n_experts):
        expert_rows = sum(counts[expert * (n_active + 1) : (expert + 1) * (n_active + 1)])
        if expert_rows:
            out_pieces.append(
                _project(
                    hidden[row : row + expert_rows],
                    down_weight[expert],
                    shape.transposed,
                    down_bias,
                    expert,
                )
            )
            row += expert_rows
    out = out_pieces[0] if len(out_pieces) == 1 else torch.cat(out_pieces)
    result = torch.zeros_like(x)
    result.index_add_(0, routed_token[:n_routed], out * routed_weight[:n_routed])

    # The down update: per-expert A over each group's rows, the routing sum per token, then the
    # shared B once per token of each segment.
    by_segment: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in active]
    for expert, segment, start_row, stop_row in group_spans:
        slot, start, _, _, rank = active[segment]
        _, _, ad = slot_factors(slot)
        z = F.linear(hidden[start_row:stop_row], ad[expert][:rank].to(dtype))
        local = routed_token[start_row:stop_row] - start
        by_segment[segment].append((local, z * routed_weight[start_row:stop_row]))
    updates: list[torch.Tensor] = []
    position = 0
    for index, (slot, start, stop, scale, rank) in enumerate(active):
        if start > position:
            updates.append(x.new_zeros(start - position, shape.hidden))
        summed = x.new_zeros(stop - start, rank)
        for local, z in by_segment[index]:
            summed = summed.index_add(0, local, z)
        updates.append(F.linear(summed * scale, b_down[slot][:, :rank].to(dtype)))
        position = stop
    if position < n_tokens:
        updates.append(x.new_zeros(n_tokens - position, shape.hidden))
    return result + torch.cat(updates)


def _project(
    rows: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    bias: torch.Tensor | None,
    expert: int,
) -> torch.Tensor:
    out = rows @ weight if transposed else F.linear(rows, weight)
    return out if bias is None else out + bias[expert]


def _fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, concatenated: bool) -> torch.Tensor:
    """Gate and up updates `[n, I]` in the module's `gate_up` column order `[n, 2I]`."""
    if concatenated:
        return torch.cat([gate, up], dim=-1)
    return torch.stack([gate, up], dim=-1).reshape(gate.shape[0], -1)


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
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        slot = int(token_slots[t])
        for k in range(top_k_index.shape[1]):
            expert = int(top_k_index[t, k])
            w_gu = frozen.gate_up[expert]
            w_d = frozen.down[expert]
            if shape.transposed:
                w_gu, w_d = w_gu.t(), w_d.t()  # [2I, H], [H, I]
            if slot != _BASE_SLOT and layer.slot_scales[slot] != 0.0:
                scale, rank = layer.slot_scales[slot], layer.slot_ranks[slot]
                d_gate = (
                    layer.factor("w1", "B")[slot, expert, :, :rank]
                    @ layer.factor("w1", "A")[slot, :rank]
                )
                d_up = (
                    layer.factor("w3", "B")[slot, expert, :, :rank]
                    @ layer.factor("w3", "A")[slot, :rank]
                )
                d_down = (
                    layer.factor("w2", "B")[slot, :, :rank]
                    @ layer.factor("w2", "A")[slot, expert, :rank]
                )
                w_gu = w_gu + scale * _fuse_gate_up(d_gate.t(), d_up.t(), shape.concatenated).t()
                w_d = w_d + scale * d_down
            gate_up = x[t] @ w_gu.t()
            if frozen.gate_up_bias is not None:
                gate_up = gate_up + frozen.gate_up_bias[expert]
            h = frozen.apply_gate(gate_up.unsqueeze(0))[0]
            y = h @ w_d.t()
            if frozen.down_bias is not None:
                y = y + frozen.down_bias[expert]
            out[t] = out[t] + top_k_weights[t, k] * y
    return out
