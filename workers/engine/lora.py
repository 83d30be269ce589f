"""Multi-slot LoRA: every tenant's adapter on the same frozen linears, chosen per row of a pass.

Job: own the adapter parameters of all S slots and add each row's own low-rank update to the
frozen base linears, so one forward/backward serves several tenants at once:
`y = x·Wᵀ + scale_slot · ((x·A_slotᵀ)·B_slotᵀ)` for the rows of that slot.

Layout. All adapter values live in one flat fp32 buffer `weights[S, P]`, one row per slot, and
their gradients in `grads[S, P]`. For every wrapped linear, `lora_A[S, r_max, in]` and
`lora_B[S, out, r_max]` are views into those rows and each view's `.grad` is the matching view
of `grads`, so autograd accumulates straight into the buffer. A slot's whole state is one row:
the optimizer steps rows, a checkpoint reads a row, a release zeroes a row.

Invariants:
- A slot of true rank r uses A rows / B columns [:r]; the padding up to r_max is exactly 0 in
  weights and grads, so padding never changes a result and never moves.
- A slot that does not train a layer group has scale 0 there and A = B = 0; the layer skips it,
  so its gradient there is exactly 0.
- Base weights are never modified: wrapped linears keep their module path and their original
  `nn.Linear` as `base_layer`, so a tied `lm_head` stays tied to the embedding.
- The row → slot mapping of a pass is set only through `SlotRouting.bind`; outside a pass the
  wrapped model computes the plain base output, and so do rows routed to `BASE_SLOT`.

Place in the flow: the engine builds one `LoraBank` at start-up, binds each pass's segments on
its `SlotRouting`, runs the model, and hands `weights`/`grads` rows to the optimizer and to
checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from protocol.errors import ServerError
from workers.engine.collective import Collective
from workers.engine.lora_kernels import LoraKind, segment_lora
from workers.engine.lora_targets import LAYER_GROUPS as LAYER_GROUPS
from workers.engine.lora_targets import ExpertSlice as ExpertSlice
from workers.engine.lora_targets import LayerGroup as LayerGroup
from workers.engine.lora_targets import LayerLayout as LayerLayout
from workers.engine.lora_targets import computes_linear as computes_linear
from workers.engine.lora_targets import find_expert_modules as find_expert_modules
from workers.engine.lora_targets import find_shared_banks
from workers.engine.lora_targets import find_target_linears as find_target_linears
from workers.engine.lora_targets import find_unwrappable_experts as find_unwrappable_experts
from workers.engine.lora_targets import lay_out_slot as lay_out_slot
from workers.engine.lora_targets import per_expert_start as per_expert_start
from workers.engine.moe_lora import (
    ExpertFactors,
    ExpertParallel,
    ExpertProjection,
    ExpertShape,
    MultiSlotLoraExperts,
)
from workers.engine.shared_bank import BANK_PARAMETERS, SharedBankLora
from workers.engine.sliced_lora import (
    LinearSlice,
    SlicedLoraLinear,
    find_sliced_linears,
    part_path,
)

# The slot of rows that use no adapter (sampling from the base model): no update at all.
BASE_SLOT = -1


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of a pass, all using one slot's adapter (none for `BASE_SLOT`)."""

    slot: int
    start: int
    stop: int


class SlotRouting:
    """Which slot each row of the pass in progress uses; empty outside a pass."""

    def __init__(self) -> None:
        self.segments: tuple[Segment, ...] = ()
        self.n_rows = 0

    @contextmanager
    def bind(self, segments: Sequence[Segment]) -> Iterator[None]:
        """Route the rows of one pass; the segments must tile rows 0..n contiguously."""
        if self.segments:
            raise ServerError("a LoRA pass is already in progress on this engine")
        expected_start = 0
        for segment in segments:
            if segment.start != expected_start or segment.stop <= segment.start:
                raise ServerError(f"LoRA segments do not tile the pass's rows: {list(segments)}")
            expected_start = segment.stop
        self.segments, self.n_rows = tuple(segments), expected_start
        try:
            yield
        finally:
            self.segments, self.n_rows = (), 0


class LoraPart(nn.Module):
    """Every slot's LoRA pair on one linear map, and the update it adds to a slot's rows: a
    whole wrapped linear (`MultiSlotLoraLinear`) or one output slice of a fused one
    (`workers.engine.sliced_lora`)."""

    def __init__(
        self,
        *,
        group: LayerGroup,
        lora_A: nn.Parameter,
        lora_B: nn.Parameter,
        slot_scales: list[float],
        routing: SlotRouting,
    ) -> None:
        super().__init__()
        self.group = group
        self.lora_A = lora_A  # [S, r_max, in], a view of the bank's weights
        self.lora_B = lora_B  # [S, out, r_max]
        # Shared with the bank (one list per layer group): alpha/rank, or 0 where not trained.
        self.slot_scales = slot_scales
        self.routing = routing
        self.kind: LoraKind | None = None  # how `update` computes (None: the device's best)

    def segments_for(self, x: torch.Tensor) -> Sequence[Segment]:
        """The bound pass's segments over the rows of dim 0 of `x`."""
        segments = self.routing.segments
        n_rows = self.routing.n_rows
        if segments and x.dim() == 2 and n_rows and x.shape[0] % n_rows == 0:
            # Tokens flattened to [rows · length, in] (a MoE block's shared expert sees them so):
            # each segment's rows stand for `length` consecutive tokens.
            per_row = x.shape[0] // n_rows
            if per_row > 1:
                segments = tuple(
                    Segment(s.slot, s.start * per_row, s.stop * per_row) for s in segments
                )
        elif segments and x.shape[0] != n_rows:
            raise ServerError(
                f"LoRA layer ({self.group}) got {x.shape[0]} rows, the pass has {self.routing.n_rows}"
            )
        return segments

    def update(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor | None:
        """The LoRA term of rows `x`, or None where no row has one. The maths is
        `workers.engine.lora_kernels.segment_lora`, in the kind `self.kind` (None: the device's best).
        """
        per_row = math.prod(x.shape[1:-1])  # tokens per row of dim 0
        specs = []
        for segment in segments:
            scale = 0.0 if segment.slot == BASE_SLOT else self.slot_scales[segment.slot]
            if scale != 0.0:
                specs.append((segment.slot, segment.start * per_row, segment.stop * per_row, scale))
        if not specs:
            return None
        flat = x.reshape(-1, x.shape[-1])
        update = segment_lora(flat, self.lora_A, self.lora_B, specs, kind=self.kind, into_grad=True)
        return update.view(*x.shape[:-1], update.shape[-1])


class MultiSlotLoraLinear(LoraPart):
    """A frozen `nn.Linear` plus one LoRA update per slot, applied to that slot's rows."""

    def __init__(
        self,
        base_layer: nn.Linear,
        *,
        group: LayerGroup,
        lora_A: nn.Parameter,
        lora_B: nn.Parameter,
        slot_scales: list[float],
        routing: SlotRouting,
    ) -> None:
        super().__init__(
            group=group, lora_A=lora_A, lora_B=lora_B, slot_scales=slot_scales, routing=routing
        )
        self.base_layer = base_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_segments(x, self.segments_for(x))

    def with_segments(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """The base output of rows `x` plus each segment's LoRA term (segments index dim 0).

        `forward` passes the bound pass's segments; the engine's chunked output layer passes
        token segments of its own.
        """
        y: torch.Tensor = self.base_layer(x)
        update = self.update(x, segments)
        if update is None:
            return y
        if type(self.base_layer) is nn.Linear and y._base is None and y.dtype == update.dtype:
            # A linear's backward needs its input, not its output: add in place (no second
            # [rows, out] tensor; the output layer's is [chunk, vocab]).
            return y.add_(update)
        return y + update


class LoraBank:
    """Adapter storage for every slot of one model, and the wrapped linears that read it."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_slots: int,
        max_rank: int,
        routing: SlotRouting,
        device: torch.device,
        slices: dict[str, ExpertSlice] | None = None,
        collective: Collective | None = None,
    ) -> None:
        targets = find_target_linears(model)
        experts = find_expert_modules(model)
        slices = slices or {}
        layouts, offset = lay_out_slot(model, max_rank, slices)
        self.max_slots = max_slots
        self.max_rank = max_rank
        self.routing = routing
        self.collective = collective or Collective()
        self.slices = dict(slices)
        # The same adapter laid out as on one device: what checkpoints and snapshots hold.
        whole, self.whole_numel = lay_out_slot(model, max_rank, slices, whole=True)
        self.whole_layouts: tuple[LayerLayout, ...] = tuple(whole)
        # Row columns from here on hold per-expert factors (under expert parallelism: only this
        # rank's experts); the ones before are the same on every rank.
        self.per_expert_start = per_expert_start(layouts, offset, max_rank)
        # Expert blocks left unadapted: an adapter training the MLP is refused on such a model.
        self.unwrappable_experts = find_unwrappable_experts(model)
        self.layouts: tuple[LayerLayout, ...] = tuple(layouts)
        self.slot_numel = offset
        self.weights = torch.zeros(max_slots, offset, dtype=torch.float32, device=device)
        self.grads = torch.zeros_like(self.weights)
        self.scales: dict[LayerGroup, list[float]] = {g: [0.0] * max_slots for g in LAYER_GROUPS}
        self.ranks = [0] * max_slots  # each slot's true rank (0: free)
        self.layers: dict[str, MultiSlotLoraLinear] = {}
        self.parts: dict[str, LoraPart] = {}  # the slices of fused linears, by layout path
        self.expert_layers: dict[str, MultiSlotLoraExperts] = {}
        by_path = {layout.path: layout for layout in self.layouts}
        sliced = find_sliced_linears(model, list(targets))
        self.sliced = sliced  # the linears adapted per slice (workers.engine.sliced_lora)
        self.glus: dict[str, int] = {}  # one-A GLUs (workers.engine.shared_bank): MLP → gate rows
        for path in targets:
            parent, _, leaf = path.rpartition(".")
            if f"{parent}.gate_up_proj" in by_path and leaf in ("gate_proj", "up_proj"):
                if leaf == "gate_proj":
                    self._wrap_gate_up(model, parent, by_path[f"{parent}.gate_up_proj"])
            elif path in sliced:
                self._wrap_sliced(model, path, sliced[path].slices, by_path)
            else:
                self._wrap(model, by_path[path])
        # the shared-expert banks and one-A GLUs (`workers.engine.shared_bank`), by path
        self.shared_banks = find_shared_banks(model)
        for path in self.shared_banks:
            self._wrap_bank(model, path, by_path)
        for path, shape in experts.items():
            self._wrap_experts(model, path, shape, by_path)

    def reduce_expert_gradients(self, slots: Sequence[int], before: torch.Tensor) -> None:
        """Under expert parallelism, sum over the ranks what a pass added to the experts' shared
        factors of `slots` (`before[i]`: slot i's gradient row before the pass). Each rank's
        backward adds only its own experts' share to them; every other column of a row is
        either computed whole on every rank (the same bits everywhere) or this rank's alone."""
        spans = self._shared_expert_spans()
        if not self.collective.parallel or not slots or not spans:
            return
        rows = torch.tensor(list(slots), dtype=torch.long, device=self.grads.device)
        grads = self.grads.index_select(0, rows)
        added = torch.cat(
            [(grads[:, a:b] - before[: len(slots), a:b]).reshape(-1) for a, b in spans]
        )
        self.collective.all_reduce_sum(added)
        start = 0
        for a, b in spans:
            width = b - a
            piece = added[start : start + len(slots) * width].view(len(slots), width)
            grads[:, a:b] = before[: len(slots), a:b] + piece
            start += len(slots) * width
        self.grads.index_copy_(0, rows, grads)

    def sum_over_ranks(self, slots: Sequence[int], backward: Callable[[], None]) -> None:
        """Run `backward` (of a pass split by position over the ranks,
        `workers.engine.context_parallel`), then sum over the ranks what it added to the
        factors every rank holds whole of `slots`: each rank's backward saw only its own
        positions. The per-expert factors (whole over every position already) and the experts'
        shared factors (summed with the call, `reduce_expert_gradients`) are left as they are."""
        if not self.collective.parallel or not slots:
            backward()
            return
        spans = _without(self.per_expert_start, self._shared_expert_spans())
        rows = torch.tensor(list(slots), dtype=torch.long, device=self.grads.device)
        before = self.grads.index_select(0, rows)
        backward()
        grads = self.grads.index_select(0, rows)
        added = torch.cat([(grads[:, a:b] - before[:, a:b]).reshape(-1) for a, b in spans])
        self.collective.all_reduce_sum(added)
        start = 0
        for a, b in spans:
            width = b - a
            piece = added[start : start + len(slots) * width].view(len(slots), width)
            grads[:, a:b] = before[:, a:b] + piece
            start += len(slots) * width
        self.grads.index_copy_(0, rows, grads)

    def _shared_expert_spans(self) -> list[tuple[int, int]]:
        """Row columns of the shared factors of the experts blocks split over the ranks."""
        spans = []
        for layout in self.layouts:
            if not layout.experts_total:
                continue
            if not layout.a_experts:
                spans.append((layout.a_offset, layout.a_offset + layout.a_size * self.max_rank))
            if not layout.b_experts:
                spans.append((layout.b_offset, layout.b_offset + layout.b_size * self.max_rank))
        return spans

    def groups_present(self) -> frozenset[LayerGroup]:
        """The layer groups this model has layers of."""
        return frozenset(layout.group for layout in self.layouts)

    def set_kind(self, kind: LoraKind | None) -> None:
        """How every wrapped linear computes its LoRA term (None: the device's best)."""
        for layer in [*self.layers.values(), *self.parts.values()]:
            layer.kind = kind

    def _pair(
        self, layout: LayerLayout, rows: slice | None = None
    ) -> tuple[nn.Parameter, nn.Parameter]:
        """Every slot's A and B of `layout` (B's `rows` only, if given), as parameters that are
        views of the bank's weights, their `.grad` views of its gradients."""
        lora_A = nn.Parameter(self._stacked_a(self.weights, layout))
        lora_A.grad = self._stacked_a(self.grads, layout)
        b, b_grad = self._stacked_b(self.weights, layout), self._stacked_b(self.grads, layout)
        if rows is not None:
            b, b_grad = b[:, rows], b_grad[:, rows]
        lora_B = nn.Parameter(b)
        lora_B.grad = b_grad
        return lora_A, lora_B

    def _wrap(
        self,
        model: nn.Module,
        layout: LayerLayout,
        path: str | None = None,
        pair: tuple[nn.Parameter, nn.Parameter] | None = None,
    ) -> None:
        """Wrap the linear at `path` (the layout's own by default) with `layout`'s pair (or
        `pair`: part of it)."""
        path = path or layout.path
        lora_A, lora_B = pair or self._pair(layout)
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = MultiSlotLoraLinear(
            cast(nn.Linear, getattr(parent, leaf)),
            group=layout.group,
            lora_A=lora_A,
            lora_B=lora_B,
            slot_scales=self.scales[layout.group],
            routing=self.routing,
        )
        setattr(parent, leaf, layer)
        self.layers[path] = layer

    def _part(self, layout: LayerLayout) -> LoraPart:
        """Every slot's pair of `layout`, for a module that adds its update itself."""
        lora_A, lora_B = self._pair(layout)
        part = LoraPart(
            group=layout.group,
            lora_A=lora_A,
            lora_B=lora_B,
            slot_scales=self.scales[layout.group],
            routing=self.routing,
        )
        self.parts[layout.path] = part
        return part

    def _wrap_bank(self, model: nn.Module, path: str, by_path: dict[str, LayerLayout]) -> None:
        parts = {name: self._part(by_path[f"{path}.{name}"]) for name in BANK_PARAMETERS}
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, leaf, SharedBankLora(getattr(parent, leaf), parts))

    def _wrap_gate_up(self, model: nn.Module, mlp_path: str, layout: LayerLayout) -> None:
        """Gate and up of a GLU with one A (`workers.engine.shared_bank`): each linear wrapped
        with that A and its own rows of B, the gate's first. Both share the A parameter, so
        both add into its gradient."""
        gate = cast(nn.Linear, model.get_submodule(f"{mlp_path}.gate_proj"))
        self.glus[mlp_path] = gate.out_features
        lora_A, _ = self._pair(layout)
        for name, rows in (
            ("gate_proj", slice(0, gate.out_features)),
            ("up_proj", slice(gate.out_features, None)),
        ):
            lora_B = self._pair(layout, rows)[1]
            self._wrap(model, layout, f"{mlp_path}.{name}", (lora_A, lora_B))

    def _wrap_sliced(
        self,
        model: nn.Module,
        path: str,
        slices: tuple[LinearSlice, ...],
        by_path: dict[str, LayerLayout],
    ) -> None:
        parts = {piece.name: self._part(by_path[part_path(path, piece)]) for piece in slices}
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, leaf, SlicedLoraLinear(getattr(parent, leaf), parts, slices))

    def _wrap_experts(
        self, model: nn.Module, path: str, shape: ExpertShape, by_path: dict[str, LayerLayout]
    ) -> None:
        factors: dict[ExpertProjection, ExpertFactors] = {}
        for projection in shape.projections:
            factors[projection] = ExpertFactors(*self._pair(by_path[f"{path}.{projection}"]))
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        part = self.slices.get(path)
        layer = MultiSlotLoraExperts(
            getattr(parent, leaf),
            shape=shape,
            factors=factors,
            slot_scales=self.scales["mlp"],
            slot_ranks=self.ranks,
            routing=self.routing,
            parallel=ExpertParallel(self.collective, part.offset, part.total) if part else None,
        )
        setattr(parent, leaf, layer)
        self.expert_layers[path] = layer

    def _stacked_a(self, buffer: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
        chunk = buffer[:, layout.a_offset : layout.a_offset + self.max_rank * layout.a_size]
        experts = (layout.a_experts,) if layout.a_experts else ()
        return chunk.view(self.max_slots, *experts, self.max_rank, layout.in_features)

    def _stacked_b(self, buffer: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
        chunk = buffer[:, layout.b_offset : layout.b_offset + layout.b_size * self.max_rank]
        experts = (layout.b_experts,) if layout.b_experts else ()
        return chunk.view(self.max_slots, *experts, layout.out_features, self.max_rank)

    def slot_views(
        self, buffer: torch.Tensor, slot: int, rank: int
    ) -> Iterator[tuple[LayerLayout, torch.Tensor, torch.Tensor]]:
        """Each layer's (A[:rank], B[:, :rank]) of one slot, as views of `buffer`.

        `buffer` is any [S, P] tensor with the bank's layout: weights, grads or a moment.
        """
        for layout in self.layouts:
            a = self._stacked_a(buffer, layout)[slot][..., :rank, :]
            b = self._stacked_b(buffer, layout)[slot][..., :rank]
            yield layout, a, b

    def init_slot(
        self,
        slot: int,
        *,
        rank: int,
        groups: Iterable[LayerGroup],
        lora_alpha: float,
        generator: torch.Generator,
    ) -> None:
        """Fresh adapter: A kaiming-uniform (as PEFT initialises it), B = 0, grads 0."""
        trained = frozenset(groups)
        self.clear_slot(slot)
        for layout, a, _ in self.slot_views(self.weights, slot, rank):
            if layout.group not in trained:
                continue
            # Drawn on the CPU so a seed gives the same adapter on every device; a per-expert A
            # is drawn as one [E·rank, in] matrix, as PEFT draws its fused-experts A (fan-in `in`),
            # all E experts' whatever share of them this rank holds.
            experts = (layout.experts_total or layout.a_experts) if layout.a_experts else 1
            init = torch.empty(experts * rank, layout.in_features)
            nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
            if layout.a_experts:
                init = init.view(experts, rank, -1)
                init = init[layout.expert_offset : layout.expert_offset + layout.a_experts]
            a.copy_(init.view(a.shape))
        self.set_scales(slot, rank=rank, groups=trained, lora_alpha=lora_alpha)

    def set_scales(
        self, slot: int, *, rank: int, groups: Iterable[LayerGroup], lora_alpha: float
    ) -> None:
        trained = frozenset(groups)
        for group in LAYER_GROUPS:
            self.scales[group][slot] = lora_alpha / rank if group in trained else 0.0
        self.ranks[slot] = rank

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's weights, gradients and scales (its optimizer state is the optimizer's)."""
        self.weights[slot].zero_()
        self.grads[slot].zero_()
        for group in LAYER_GROUPS:
            self.scales[group][slot] = 0.0
        self.ranks[slot] = 0


def _without(stop: int, holes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The columns `0 .. stop - 1` outside `holes`, as spans."""
    spans, at = [], 0
    for a, b in sorted(holes):
        if a >= stop:
            break
        if a > at:
            spans.append((at, a))
        at = max(at, b)
    if at < stop:
        spans.append((at, stop))
    return spans
