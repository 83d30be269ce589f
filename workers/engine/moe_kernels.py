"""The routed-row kernels of the multi-slot expert LoRA (`workers.engine.moe_lora`).

Job: from one MoE block call's routing (`top_k_index`) and its active segments, build the index
tensors that order the routed rows by (expert, segment) and tile the (expert, segment) groups
(`RoutePlan`), and run the products over them: each expert's frozen weight over its rows
(`ExpertLinear`) and each group's per-expert LoRA factor over its tiles (`GroupedProduct`),
both with hand-written backwards.

Invariants:
- Tile padding reads a zero row and rows of its own segment, and its outputs are never read: one
  tenant's values never reach another's results or gradients.
- `GroupedProduct` adds its factor gradients straight into the factors' `.grad` rows; slots
  absent from the call receive exactly zero.

Place in the flow: `moe_lora.experts_forward` builds a `RoutePlan` per call and calls these.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from protocol.errors import ServerError
from workers.engine import lora_kernels
from workers.engine.lora_kernels import slot_span


class ExpertLinear(torch.autograd.Function):
    """Each expert's rows (contiguous, `plan.expert_ranges`) times its frozen weight into one
    output, forward and backward: no per-expert pieces to concatenate, nor their backward's
    `cat` (together a quarter of a 16-tenant block's time on a CPU)."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: RoutePlan,
        transposed: bool,
    ) -> torch.Tensor:
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            raise ServerError("the experts' base weights must be frozen under an expert LoRA")
        ctx.matrices = weight if transposed else weight.transpose(1, 2)  # [E, in, out]
        ctx.plan = plan
        out = _expert_products(rows, ctx.matrices, plan)
        return out if bias is None else out.add_(bias.index_select(0, plan.row_expert))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows = _expert_products(grads[0].contiguous(), ctx.matrices.transpose(1, 2), ctx.plan)
        return rows, None, None, None, None


def grouped_experts(rows: torch.Tensor, matrices: torch.Tensor) -> bool:
    """Whether the experts' frozen products run as one grouped GEMM: on CUDA in bf16 where
    torch has the kernel (`lora_kernels.grouped_unavailable_reason`). A 128-expert block is
    then one launch instead of 128 (and as many again in the backward)."""
    in_features, out_features = matrices.shape[1:]
    shapes = (int(in_features), int(out_features))
    return lora_kernels.grouped_unavailable_reason(rows.device, rows.dtype, shapes) is None


def _expert_products(rows: torch.Tensor, matrices: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """`rows [routed, in]` (by expert) times their expert's `matrices [E, in, out]`: one grouped
    GEMM where the device has it (`grouped_experts`), else one matmul per expert with rows."""
    if grouped_experts(rows, matrices):
        assert lora_kernels._GROUPED_MM is not None
        return lora_kernels._GROUPED_MM(rows, matrices.to(rows.dtype), offs=plan.expert_offsets)
    out = rows.new_empty(rows.shape[0], matrices.shape[-1])
    for expert, start, stop in plan.expert_ranges:
        torch.mm(rows[start:stop], matrices[expert], out=out[start:stop])
    return out


class RoutePlan:
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
        self.span = slot_span([slot for slot, *_ in active])
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
        self.expert_offsets = torch.tensor(ends, dtype=torch.int32, device=device)

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


class GroupedProduct(torch.autograd.Function):
    """`rows [len(factors)·positions, in]` in the tile layout, per factor, times each group's
    `factor[slot, expert]` (its first `rank` along `rank_dim`): `[…, out]`. A grid uses the
    slot's `[E, out, in]` where it lies in the bank, the extra tiles theirs gathered. The
    backward adds the gradients straight into the factor's `.grad` (a view of the bank's
    gradient rows), in place for a grid, by index for the tiles: autograd's own would build a
    zero tensor of the factor's full size `[S, E, out, in]` and add all of it."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        plan: RoutePlan,
        rank_dim: int,
        rank: int,
        *factors: torch.Tensor,
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
        plan: RoutePlan = ctx.plan
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


def _tiles(plan: RoutePlan, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One factor's `rows [positions, n]` as its grids `[grids, E, L, n]` and its extra tiles
    `[tiles, L, n]` (views)."""
    grids = len(plan.grids) * plan.experts * plan.tile
    grid_view = rows[:grids].view(len(plan.grids), plan.experts, plan.tile, rows.shape[1])
    return grid_view, rows[grids:].view(plan.n_tiles, plan.tile, rows.shape[1])
