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
from typing import TYPE_CHECKING, Any, Literal, cast

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

    Step 1: routed rows j = (token, k) are sorted by (expert, active segment), so each expert's
            rows, and within them each (expert, segment) group's, are contiguous.
    Step 2: the shared A factors of gate and up run once per token of each segment (scaled).
    Step 3: the base gate_up of each expert over its rows (the stock module's loop).
    Step 4: the per-expert B factors of gate and up: one batched matmul over every
            (expert, segment) group, each group's rows zero-padded to the longest group; the
            factors of group g are `B[slot_g, expert_g]`, `[groups, I, r]` (the adapters' own
            size at most, never a weight per row). Added before the activation.
    Step 5: the base down projection of each expert, weighted by the router and summed per
            token; the per-expert down A factors batched like step 4, weighted and summed per
            token into `[T, r]`, then each segment's shared down B once per token.
    """
    base = layer.base_layer
    shape = layer.shape
    n_tokens, top_k = top_k_index.shape
    device, dtype = x.device, x.dtype
    n_experts, n_active = shape.num_experts, len(active)
    r_max = layer.factor("w1", "A").shape[-2]
    width = n_active + 1  # segment n_active: rows of no active segment (no update)

    # Step 1.
    token_segment = torch.full((n_tokens,), n_active, dtype=torch.long, device=device)
    for index, (_, start, stop, _, _) in enumerate(active):
        token_segment[start:stop] = index
    flat_expert = top_k_index.reshape(-1).to(torch.long)
    flat_token = torch.arange(n_tokens, device=device).repeat_interleave(top_k)
    valid = (flat_expert >= 0) & (flat_expert < n_experts)  # an index E is "no expert" (padding)
    keys = torch.where(valid, flat_expert * width + token_segment[flat_token], n_experts * width)
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=n_experts * width + 1).tolist()
    n_routed = sum(counts[: n_experts * width])
    routed_token = flat_token[order][:n_routed]
    routed_weight = top_k_weights.reshape(-1)[order][:n_routed].unsqueeze(-1)
    groups: list[tuple[int, int, int, int]] = []  # (expert, segment, first row, rows)
    expert_rows: list[tuple[int, int, int]] = []  # (expert, first row, rows)
    row = 0
    for expert in range(n_experts):
        first = row
        for segment in range(width):
            n = counts[expert * width + segment]
            if n and segment < n_active:
                groups.append((expert, segment, row, n))
            row += n
        if row > first:
            expert_rows.append((expert, first, row - first))

    # Step 2: [T, r_max] per factor, zero outside the active segments and past a slot's rank.
    # Pieces come from `split`, whose backward is one `cat`; a slice's backward would write a
    # zero tensor of the whole input for every piece.
    spans = _token_spans(active, n_tokens)
    token_pieces = torch.split(x, [size for _, size in spans])
    a_gate, a_up = layer.factor("w1", "A").unbind(0), layer.factor("w3", "A").unbind(0)
    shrunk_gate, shrunk_up = [], []
    for span, rows in zip(spans, token_pieces, strict=True):
        if span[0] is None:
            shrunk_gate.append(x.new_zeros(rows.shape[0], r_max))
            shrunk_up.append(x.new_zeros(rows.shape[0], r_max))
            continue
        slot, _, _, scale, rank = active[span[0]]
        pad = (0, r_max - rank)
        shrunk_gate.append(F.pad(F.linear(rows, a_gate[slot][:rank].to(dtype)) * scale, pad))
        shrunk_up.append(F.pad(F.linear(rows, a_up[slot][:rank].to(dtype)) * scale, pad))
    # index_select rather than indexing: its backward is one index_add, not index_put's sort
    u_gate = torch.cat(shrunk_gate).index_select(0, routed_token)
    u_up = torch.cat(shrunk_up).index_select(0, routed_token)

    # Step 3.
    frozen = expert_weights(base, shape)
    row_sizes = [n for _, _, n in expert_rows]
    gate_up = torch.cat(
        [
            _project(rows, frozen.gate_up[e], shape, frozen.gate_up_bias, e)
            for (e, _, _), rows in zip(
                expert_rows, torch.split(x.index_select(0, routed_token), row_sizes), strict=True
            )
        ]
    )

    # Step 4: groups in a few buckets of similar length (sorted), each bucket one batched
    # matmul padded to its longest group, so padding stays a small part of the work.
    buckets = _buckets(groups, active, n_routed, device)
    flat_rows = torch.cat([bucket.rows.reshape(-1) for bucket in buckets])

    def grouped(rows: torch.Tensor, factor: torch.Tensor, out_features: int) -> torch.Tensor:
        """`rows [n_routed, in]` times each group's `factor[slot, expert] [out, in]`, back in
        row order `[n_routed, out]` (rows of no group get 0)."""
        padded_rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        products = []
        for bucket in buckets:
            weight = _GroupFactors.apply(factor, bucket.slots, bucket.experts, dtype)  # type: ignore[no-untyped-call]
            gathered = padded_rows.index_select(0, bucket.rows.reshape(-1))
            product = torch.bmm(gathered.view(*bucket.rows.shape, -1), weight.transpose(1, 2))
            products.append(product.reshape(-1, out_features))
        zeros = rows.new_zeros(n_routed + 1, out_features)
        return zeros.index_add(0, flat_rows, torch.cat(products))[:n_routed]

    d_gate = grouped(u_gate, layer.factor("w1", "B"), shape.intermediate)
    d_up = grouped(u_up, layer.factor("w3", "B"), shape.intermediate)
    hidden = frozen.apply_gate(gate_up + _fuse_gate_up(d_gate, d_up, shape.concatenated))

    # Step 5.
    out = torch.cat(
        [
            _project(rows, frozen.down[e], shape, frozen.down_bias, e)
            for (e, _, _), rows in zip(expert_rows, torch.split(hidden, row_sizes), strict=True)
        ]
    )
    result = torch.zeros_like(x).index_add(0, routed_token, out * routed_weight)
    z = grouped(hidden, layer.factor("w2", "A"), r_max)  # [n_routed, r_max]
    summed = x.new_zeros(n_tokens, r_max).index_add(0, routed_token, z * routed_weight)
    b_down = layer.factor("w2", "B").unbind(0)
    updates: list[torch.Tensor] = []
    for span, rows in zip(spans, torch.split(summed, [size for _, size in spans]), strict=True):
        if span[0] is None:
            updates.append(x.new_zeros(rows.shape[0], shape.hidden))
            continue
        slot, _, _, scale, rank = active[span[0]]
        updates.append(F.linear(rows[:, :rank] * scale, b_down[slot][:, :rank].to(dtype)))
    return result + torch.cat(updates)


def _token_spans(
    active: list[tuple[int, int, int, float, int]], n_tokens: int
) -> list[tuple[int | None, int]]:
    """(active segment or None, tokens) spans tiling `[0, n_tokens)` in order."""
    spans: list[tuple[int | None, int]] = []
    position = 0
    for index, (_, start, stop, _, _) in enumerate(active):
        if start > position:
            spans.append((None, start - position))
        spans.append((index, stop - start))
        position = stop
    if position < n_tokens:
        spans.append((None, n_tokens - position))
    return spans


@dataclass(frozen=True)
class _Bucket:
    """Groups of similar length: `rows [G, L]` their row indices, padded with the index of a
    zero row; `slots`, `experts` `[G]` whose factors each group uses."""

    rows: torch.Tensor
    slots: torch.Tensor
    experts: torch.Tensor


_BUCKETS = 4


def _buckets(
    groups: list[tuple[int, int, int, int]],
    active: list[tuple[int, int, int, float, int]],
    n_routed: int,
    device: torch.device,
) -> list[_Bucket]:
    ordered = sorted(groups, key=lambda group: group[3])
    size = -(-len(ordered) // _BUCKETS)
    buckets = []
    for begin in range(0, len(ordered), size):
        chunk = ordered[begin : begin + size]
        longest = chunk[-1][3]
        offsets = torch.arange(longest, device=device)
        firsts = torch.tensor([first for _, _, first, _ in chunk], device=device)
        lengths = torch.tensor([n for *_, n in chunk], device=device)
        rows = torch.where(
            offsets < lengths[:, None],
            firsts[:, None] + offsets,
            torch.full_like(offsets, n_routed),
        )
        slots = torch.tensor([active[segment][0] for _, segment, _, _ in chunk], device=device)
        experts = torch.tensor([expert for expert, *_ in chunk], device=device)
        buckets.append(_Bucket(rows, slots, experts))
    return buckets


class _GroupFactors(torch.autograd.Function):
    """`factor[slot_index, expert_index]` in `dtype`, whose backward adds each group's gradient
    straight into the factor's `.grad` (a view of the bank's gradient rows).

    Autograd's own backward of the gather builds a zero tensor of the factor's full size
    `[S, E, out, in]` and adds all of it into `.grad`: two passes over every slot's expert factors
    for a few groups' worth of gradient. Here only the groups' entries are touched.
    """

    @staticmethod
    def forward(
        ctx: Any,
        factor: torch.Tensor,
        slot_index: torch.Tensor,
        expert_index: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(slot_index, expert_index)
        ctx.factor = factor
        return factor[slot_index, expert_index].to(dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (grad,) = grads
        slot_index, expert_index = ctx.saved_tensors
        factor: torch.Tensor = ctx.factor
        values = grad.to(factor.dtype)
        if factor.grad is None:  # no gradient buffer to add into: autograd's way
            full = torch.zeros_like(factor)
            full.index_put_((slot_index, expert_index), values, accumulate=True)
            return full, None, None, None
        factor.grad.index_put_((slot_index, expert_index), values, accumulate=True)
        return None, None, None, None


def _project(
    rows: torch.Tensor,
    weight: torch.Tensor,
    shape: ExpertShape,
    bias: torch.Tensor | None,
    expert: int,
) -> torch.Tensor:
    out = rows @ weight if shape.transposed else F.linear(rows, weight)
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
