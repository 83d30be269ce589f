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
by (expert, slot) in tiles of a few rows: a batched matmul per slot reads the slot's `[E, I, r]`
factors where they lie in the bank; no `[rows, I, r]` weight is ever gathered.

Invariants:
- Rows of no slot (`BASE_SLOT`), of a slot with scale 0, and every call outside a pass run the
  wrapped module unchanged, so a model with no active adapter computes exactly the base.
- The adapters are views of the bank's `[S, P]` rows (`workers.engine.lora.LoraBank`); the
  per-expert factors' gradients are added straight into the `.grad` rows of the slots in the
  pass, so slots absent from it receive exactly zero.
- The rank computed is the pass's largest; a slot's rank padding is exactly 0, so it adds 0 to
  every result and stays exactly 0.
- Tile padding reads zeros or rows of its own segment: one tenant's values never reach another's
  results or gradients.

Place in the flow: `LoraBank` finds fused experts modules (`find_expert_modules`), lays their
factors out in its rows, and swaps in `MultiSlotLoraExperts`; the routing of a pass is the same
`SlotRouting` the linear layers read.
"""

from __future__ import annotations

import itertools
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
            rows, and within them each (expert, segment) group's, are contiguous; the groups
            are laid out in tiles of L rows (`_Plan`).
    Step 2: the shared A factors of gate and up, `[A1; A3]`, in one batched matmul over the
            active segments' tokens (scaled).
    Step 3: the base gate_up of each expert over its rows, into one output (`_ExpertLinear`).
    Step 4: the per-expert B factors of gate and up (`_GroupedProduct`): per segment one
            batched matmul over its grid with the slot's `B [E, I, r]` where it lies in the bank,
            and one over the extra tiles with their factors gathered (`[tiles, I, r]`, never a
            weight per row); added before the activation.
    Step 5: the router weights scale the activations; the base down projection of each expert,
            summed per token; the per-expert down A factors batched like step 4, summed per
            token into `[T, r]`, then each segment's shared down B in one batched matmul.

    The rank computed is the pass's largest: a slot's factors past its own rank are 0, so that
    padding adds exactly 0 and receives exactly 0 gradient.
    """
    shape, dtype = layer.shape, x.dtype
    rank = max(spec[4] for spec in active)

    # Step 1.
    plan = _Plan(active, top_k_index, x.shape[0], shape.num_experts, rank)
    if not plan.grids:  # no token of an active segment reaches an expert: no update
        return cast(torch.Tensor, layer.base_layer(x, top_k_index, top_k_weights))
    frozen = expert_weights(layer.base_layer, shape)
    scales = plan.scales.to(dtype)
    routed_weight = top_k_weights.reshape(-1).index_select(0, plan.routed).unsqueeze(-1)

    # Step 2: [segments, longest segment, 2r]; the tiles' padding reads an appended zero row.
    a_shared = torch.cat([layer.factor("w1", "A")[:, :rank], layer.factor("w3", "A")[:, :rank]], 1)
    a_shared = a_shared.index_select(0, plan.slots).to(dtype)
    shrunk = torch.bmm(plan.segment_rows(x), a_shared.transpose(1, 2)) * scales
    u = F.pad(shrunk.reshape(-1, rank), (0, 0, 0, 1)).index_select(0, plan.u_index)

    # Step 3. index_select rather than indexing: its backward is one index_add, not a sort.
    x_rows = x.index_select(0, plan.token)
    gate_up = _ExpertLinear.apply(x_rows, frozen.gate_up, frozen.gate_up_bias, plan, shape)  # type: ignore[no-untyped-call]

    # Step 4: back in row order, row j's gate update at 2j and its up at 2j + 1; rows of no
    # active segment read a zero row.
    b_factors = (layer.factor("w1", "B"), layer.factor("w3", "B"))
    update = _GroupedProduct.apply(u, plan, -1, rank, *b_factors)  # type: ignore[no-untyped-call]
    update = F.pad(update, (0, 0, 0, 1)) if plan.ungrouped else update
    update = update.index_select(0, plan.update_index).view(-1, 2, shape.intermediate)
    if shape.concatenated:
        gate_up = gate_up + update.view(gate_up.shape)
    else:
        gate_up = (gate_up.view(-1, shape.intermediate, 2) + update.transpose(1, 2)).flatten(1)
    # Scaled by the router weight, the activations weight the base down projection and the
    # down A factors alike.
    hidden = frozen.apply_gate(gate_up) * routed_weight

    # Step 5. The tiles' padding adds into an extra row of `summed`, dropped.
    out = _ExpertLinear.apply(hidden, frozen.down, None, plan, shape)  # type: ignore[no-untyped-call]
    if frozen.down_bias is not None:
        out = out + routed_weight * frozen.down_bias.index_select(0, plan.row_expert)
    result = torch.zeros_like(x).index_add(0, plan.token, out)
    tiled = hidden.index_select(0, plan.row_index)
    z = _GroupedProduct.apply(tiled, plan, -2, rank, layer.factor("w2", "A"))  # type: ignore[no-untyped-call]
    summed = x.new_zeros(plan.segment_positions + 1, rank).index_add(0, plan.z_index, z)
    summed = summed[:-1].view(*shrunk.shape[:2], rank) * scales
    b_down = layer.factor("w2", "B")[..., :rank].index_select(0, plan.slots).to(dtype)
    return plan.place(result, torch.bmm(summed, b_down.transpose(1, 2)))


class _ExpertLinear(torch.autograd.Function):
    """Each expert's rows (contiguous, `plan.expert_ranges`) times its frozen weight into one
    output, forward and backward: no per-expert pieces to concatenate, nor their backward's
    `cat` (together a quarter of a 16-tenant block's time on a CPU)."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: _Plan,
        shape: ExpertShape,
    ) -> torch.Tensor:
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            raise ServerError("the experts' base weights must be frozen under an expert LoRA")
        ctx.matrices = weight if shape.transposed else weight.transpose(1, 2)  # [E, in, out]
        ctx.plan = plan
        out = _expert_products(rows, ctx.matrices, plan)
        return out if bias is None else out.add_(bias.index_select(0, plan.row_expert))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows = _expert_products(grads[0].contiguous(), ctx.matrices.transpose(1, 2), ctx.plan)
        return rows, None, None, None, None


def _expert_products(rows: torch.Tensor, matrices: torch.Tensor, plan: _Plan) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], matrices.shape[-1])
    for expert, start, stop in plan.expert_ranges:
        torch.mm(rows[start:stop], matrices[expert], out=out[start:stop])
    return out


class _Plan:
    """Index tensors of one call: the routed rows' order, the tiles of the (expert, segment)
    groups, and the active segments' tokens padded to `[segments, longest, …]`.

    The tile layout of one factor: each segment's grid `[E, L]` (segments with routed rows)
    holds the first L rows of its groups, then extra tiles `[tiles, L]` hold the rest of the
    longer groups. Padding positions read a zero u row and a row of their own segment, so a
    slot's padding only meets its own tenant's values; their outputs are never read, so they
    receive zero gradient and add exactly 0 to every gradient."""

    def __init__(
        self,
        active: list[tuple[int, int, int, float, int]],
        top_k_index: torch.Tensor,
        n_tokens: int,
        n_experts: int,
        rank: int,
    ) -> None:
        device = top_k_index.device
        n_active, top_k, width = len(active), top_k_index.shape[1], len(active) + 1

        def tensor(values: object) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        def full(size: int, value: int) -> torch.Tensor:
            return torch.full((size,), value, dtype=torch.long, device=device)

        # Segments (n_active: no active segment); segment a's tokens at a·longest + t - start.
        lengths = [stop - start for _, start, stop, _, _ in active]
        self.longest, self.n_tokens = max(lengths), n_tokens
        self.first, self.last = active[0][1], active[-1][2]
        self.segment_positions = n_active * self.longest
        spans, cursor = [], 0  # (segment, position - token, tokens), tiling the tokens
        for index, (_, start, stop, _, _) in enumerate(active):
            spans += [(n_active, 0, start - cursor)] if start > cursor else []
            spans.append((index, index * self.longest - start, stop - start))
            cursor = stop
        spans += [(n_active, 0, n_tokens - cursor)] if cursor < n_tokens else []
        span = tensor(spans)
        token_segment, shift = span[:, :2].repeat_interleave(span[:, 2], 0).unbind(1)
        segment_position = torch.arange(n_tokens, device=device) + shift
        self.dense = len(set(lengths)) == 1 and sum(lengths) == self.last - self.first
        if not self.dense:  # padding repeats a segment's last token, never read
            offsets = torch.arange(self.longest, device=device)
            firsts, counts = tensor([a[1] for a in active]), tensor(lengths)
            self.segment_src = (firsts[:, None] + offsets.minimum(counts[:, None] - 1)).view(-1)
            valid = (offsets < counts[:, None]).view(-1)
            self.segment_token, self.segment_valid = self.segment_src[valid], valid.nonzero()[:, 0]
        self.slots = tensor([slot for slot, *_ in active])
        self.scales = torch.tensor([a[3] for a in active], device=device).view(-1, 1, 1)

        # Routed rows by (expert, segment); an expert index E is "no expert" (padding).
        flat = top_k_index.reshape(-1).to(torch.long)
        row_segment = token_segment[torch.arange(flat.numel(), device=device) // top_k]
        valid = (flat >= 0) & (flat < n_experts)
        keys = torch.where(valid, flat * width + row_segment, n_experts * width)
        counts_all = torch.bincount(keys, minlength=n_experts * width + 1)
        n_routed = int(counts_all[:-1].sum())
        self.routed = torch.argsort(keys, stable=True)[:n_routed]
        self.token, self.row_expert = self.routed // top_k, flat.index_select(0, self.routed)
        sizes = counts_all[:-1].view(n_experts, width)
        expert_rows = sizes.sum(1).tolist()
        ends = list(itertools.accumulate(expert_rows))
        self.expert_ranges = [
            (e, end - n, end) for e, (n, end) in enumerate(zip(expert_rows, ends, strict=True)) if n
        ]

        # Tiles: group (e, a)'s row i sits in a's grid if i < L, else in its extra tile i // L - 1.
        sizes = sizes[:, :n_active]
        with_rows = sizes.sum(0) > 0
        self.grids = self.slots[with_rows].tolist()  # each grid's slot
        self.experts, self.tile = n_experts, _tile_rows(sizes, len(self.grids), rank)
        tile, grid_positions = self.tile, len(self.grids) * n_experts * self.tile
        extra = ((sizes + tile - 1) // tile - 1).clamp(min=0).view(-1)
        self.n_tiles = int(extra.sum())
        self.positions = grid_positions + self.n_tiles * tile
        tile_group = torch.arange(len(extra), device=device).repeat_interleave(extra)
        self.tile_index = (self.slots[tile_group % n_active], tile_group // n_active)
        key = keys.index_select(0, self.routed)
        grouped = (key % width < n_active).nonzero()[:, 0]
        key = key[grouped]
        expert, segment = key // width, key % width
        offset = grouped - (torch.cumsum(counts_all, 0) - counts_all)[key]
        grid = torch.cumsum(with_rows, 0) - 1
        tile_start = (torch.cumsum(extra, 0) - extra)[expert * n_active + segment]
        position = torch.where(
            offset < tile,
            (grid[segment] * n_experts + expert) * tile + offset,
            grid_positions + (tile_start + offset // tile - 1) * tile + offset % tile,
        )
        position_segment = torch.cat(
            [
                with_rows.nonzero()[:, 0].repeat_interleave(n_experts * tile),
                (tile_group % n_active).repeat_interleave(tile),
            ]
        )
        first_row = torch.zeros(n_active, dtype=torch.long, device=device)
        first_row.scatter_reduce_(0, segment, grouped, "amin", include_self=False)
        self.row_index = first_row[position_segment]
        self.row_index[position] = grouped
        self.ungrouped = len(grouped) < n_routed
        zero_row = 2 * self.segment_positions
        u_row = full(self.positions, zero_row)
        u_row[position] = 2 * segment_position[self.token[grouped]]
        self.u_index = torch.cat([u_row, u_row + (u_row < zero_row)])  # gate, then up
        self.z_index = torch.where(u_row < zero_row, u_row // 2, self.segment_positions)
        update_index = full(2 * n_routed, 2 * self.positions).view(-1, 2)
        update_index[grouped] = torch.stack([position, position + self.positions], 1)
        self.update_index = update_index.view(-1)

    def segment_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x`'s active tokens as `[segments, longest, H]` (a view when they are dense)."""
        rows = x[self.first : self.last] if self.dense else x.index_select(0, self.segment_src)
        return rows.view(len(self.slots), self.longest, x.shape[1])

    def place(self, result: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`result [T, H]` plus the segments' `delta [segments, longest, H]` at their tokens."""
        delta = delta.view(-1, delta.shape[-1])
        if not self.dense:
            return result.index_add(
                0, self.segment_token, delta.index_select(0, self.segment_valid)
            )
        if self.first == 0 and self.last == self.n_tokens:
            return result + delta
        return result + F.pad(delta, (0, 0, self.first, self.n_tokens - self.last))


def _tile_rows(sizes: torch.Tensor, n_grids: int, rank: int) -> int:
    """The tile length L that minimises the rows computed, an extra tile counting `rank` rows
    more (about what gathering its factors costs); tried at group sizes and their halves."""
    values, groups = torch.unique(sizes[sizes > 0], return_counts=True)
    if not len(values):
        return 1
    candidates = torch.unique(torch.cat([values, (values + 1) // 2]))
    tiles = ((values[:, None] + candidates - 1) // candidates - 1) * groups[:, None]
    cost = n_grids * sizes.shape[0] * candidates + tiles.sum(0) * (candidates + rank)
    return int(candidates[cost.argmin()])


class _GroupedProduct(torch.autograd.Function):
    """`rows [len(factors)·positions, in]` in the tile layout, per factor, times each group's
    `factor[slot, expert]` (its first `rank` along `rank_dim`): `[…, out]`. A grid uses the
    slot's `[E, out, in]` where it lies in the bank, the extra tiles theirs gathered. The
    backward adds the gradients straight into the factor's `.grad` (a view of the bank's
    gradient rows), in place for a grid, by index for the tiles: autograd's own would build a
    zero tensor of the factor's full size `[S, E, out, in]` and add all of it."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, plan: _Plan, rank_dim: int, rank: int, *factors: torch.Tensor
    ) -> torch.Tensor:
        narrowed = [factor.narrow(rank_dim, 0, rank) for factor in factors]
        out = rows.new_empty(rows.shape[0], narrowed[0].shape[-2])
        tile_weights = []
        row_pieces, out_pieces = torch.split(rows, plan.positions), torch.split(out, plan.positions)
        for factor, x, y in zip(narrowed, row_pieces, out_pieces, strict=True):
            slot_weights = factor.transpose(-1, -2).unbind(0)  # [E, in, out] per slot
            (grid_x, tiles_x), (grid_y, tiles_y) = _tiles(plan, x), _tiles(plan, y)
            for slot, xs, ys in zip(plan.grids, grid_x, grid_y, strict=True):
                torch.bmm(xs, slot_weights[slot].to(x.dtype), out=ys)
            tile_weights.append(factor[plan.tile_index].to(x.dtype))  # [tiles, out, in]
            torch.bmm(tiles_x, tile_weights[-1].transpose(1, 2), out=tiles_y)
        ctx.plan, ctx.factors, ctx.rank_dim, ctx.rank = plan, factors, rank_dim, rank
        ctx.save_for_backward(rows, *tile_weights)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        rows, *tile_weights = ctx.saved_tensors
        grad, grad_rows = grads[0].contiguous(), torch.empty_like(rows)
        # No gradient buffer to add into (a factor outside the bank): autograd's way.
        targets = [f.grad if f.grad is not None else torch.zeros_like(f) for f in ctx.factors]
        for factor, target, weight, g, x, gx in zip(
            ctx.factors,
            targets,
            tile_weights,
            torch.split(grad, plan.positions),
            torch.split(rows, plan.positions),
            torch.split(grad_rows, plan.positions),
            strict=True,
        ):
            slot_weights = factor.narrow(ctx.rank_dim, 0, ctx.rank).unbind(0)
            target = target.narrow(ctx.rank_dim, 0, ctx.rank)
            (grid_g, tiles_g), (grid_x, tiles_x) = _tiles(plan, g), _tiles(plan, x)
            for slot, gs, xs, gxs in zip(
                plan.grids, grid_g, grid_x, _tiles(plan, gx)[0], strict=True
            ):
                torch.bmm(gs, slot_weights[slot].to(g.dtype), out=gxs)
                if target.dtype == g.dtype:
                    target[slot].baddbmm_(gs.transpose(1, 2), xs)
                else:
                    target[slot].add_(torch.bmm(gs.transpose(1, 2), xs).to(target.dtype))
            torch.bmm(tiles_g, weight, out=_tiles(plan, gx)[1])
            tile_grad = torch.bmm(tiles_g.transpose(1, 2), tiles_x).to(target.dtype)
            target.index_put_(plan.tile_index, tile_grad, accumulate=True)
        returned = [
            None if f.grad is not None else t for f, t in zip(ctx.factors, targets, strict=True)
        ]
        return (grad_rows, None, None, None, *returned)


def _tiles(plan: _Plan, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One factor's `rows [positions, n]` as its grids `[grids, E, L, n]` and its extra tiles
    `[tiles, L, n]` (views)."""
    grids = len(plan.grids) * plan.experts * plan.tile
    grid_view = rows[:grids].view(len(plan.grids), plan.experts, plan.tile, rows.shape[1])
    return grid_view, rows[grids:].view(plan.n_tiles, plan.tile, rows.shape[1])


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
            if slot != _BASE_SLOT and layer.slot_scales[slot] != 0.0:
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
