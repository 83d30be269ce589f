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
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Literal, cast

import torch
from torch import nn

from protocol.errors import ServerError
from workers.engine.collective import Collective
from workers.engine.lora_kernels import LoraKind, segment_lora
from workers.engine.moe_lora import (
    ExpertFactors,
    ExpertParallel,
    ExpertProjection,
    ExpertShape,
    MultiSlotLoraExperts,
    expert_shape,
    projection_shape,
)

LayerGroup = Literal["attn", "mlp", "unembed"]
LAYER_GROUPS: tuple[LayerGroup, ...] = ("attn", "mlp", "unembed")

# Blocks whose linears count as attention: full attention (`self_attn`) and the linear-attention
# blocks of hybrid models such as Qwen3.5 (`linear_attn`, with in_proj_qkv/in_proj_z/out_proj…).
# Classifying by parent rather than by projection name covers architectures we never listed.
_ATTN_PARENTS = frozenset({"self_attn", "linear_attn", "attention", "self_attention"})
_MLP_PARENTS = frozenset({"mlp", "feed_forward", "shared_expert", "shared_experts"})
# Linears of a MoE block that are never trained: the router and Qwen3.5's shared-expert gate.
_UNTRAINED_LEAVES = frozenset({"gate", "router", "shared_expert_gate"})
# Multi-head latent attention's up-projections out of its low-rank latents (DeepSeek-V3/V4,
# Kimi-K2, GLM-5): only the linears that touch the residual stream are adapted, as Tinker does
# (`q_a_proj`, `kv_a_proj_with_mqa`, `o_proj`; docs/compatibility.md).
_LOW_RANK_LEAVES = frozenset({"q_b_proj", "kv_b_proj"})
# A hybrid model's per-block mixer (Nemotron-H: `model.layers.N.mixer` is a Mamba2 mixer, an
# attention, or a MoE): its group follows what the block is (`_mixer_group`).
_MIXER_PARENTS = frozenset({"mixer"})
# Multimodal checkpoints also have `attn`/`mlp` blocks in their vision tower; tenants train text.
_VISION_PREFIXES = ("visual", "vision")

# The slot of rows that use no adapter (sampling from the base model): no update at all.
BASE_SLOT = -1


def computes_linear(module: nn.Module) -> bool:
    """Whether `module` computes `x·Wᵀ + b` on its whole input: an `nn.Linear`, or a subclass
    that keeps its `forward` or says it computes the same (`same_as_linear`: a frozen linear
    whose weight is sharded over ranks). A subclass with a `forward` of its own may compute
    something else from the weight (DeepSeek-V4's grouped `o_a_proj` multiplies per head
    group), which a LoRA pair on its `in`/`out` features would not match."""
    if not isinstance(module, nn.Linear):
        return False
    kind = type(module)
    return kind.forward is nn.Linear.forward or bool(getattr(kind, "same_as_linear", False))


def _mixer_group(mixer: nn.Module) -> LayerGroup | None:
    """The group of a hybrid block's mixer: a MoE or an MLP trains with the MLP; attention and
    the sequence mixers standing in for it (Mamba2) with attention, as Tinker counts them."""
    name = type(mixer).__name__
    if hasattr(mixer, "experts") or name.endswith(("MLP", "MoE", "Moe")):
        return "mlp"
    if "Attention" in name or "Mamba" in name:
        return "attn"
    return None


def find_target_linears(model: nn.Module) -> dict[str, LayerGroup]:
    """The linears a slot may train, by module path, grouped by the block that holds them."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_output_embeddings() if get_output_embeddings is not None else None
    targets: dict[str, LayerGroup] = {}
    for path, module in model.named_modules():
        if not computes_linear(module):
            continue
        if module is output_embeddings:
            targets[path] = "unembed"
            continue
        parts = path.split(".")
        if any(part.startswith(_VISION_PREFIXES) for part in parts):
            continue
        parent = parts[-2] if len(parts) >= 2 else ""
        group: LayerGroup | None = None
        if parent in _MIXER_PARENTS:
            group = _mixer_group(model.get_submodule(".".join(parts[:-1])))
        elif parent in _ATTN_PARENTS:
            group = "attn"
        elif parent in _MLP_PARENTS:
            group = "mlp"
        if group == "attn" and parts[-1] not in _LOW_RANK_LEAVES:
            targets[path] = "attn"
        elif group == "mlp" and parts[-1] not in _UNTRAINED_LEAVES:
            targets[path] = "mlp"
    return targets


def find_expert_modules(model: nn.Module) -> dict[str, ExpertShape]:
    """The fused experts modules of a MoE model (`mlp.experts`), by module path."""
    found: dict[str, ExpertShape] = {}
    for path, module in model.named_modules():
        if any(part.startswith(_VISION_PREFIXES) for part in path.split(".")):
            continue
        shape = expert_shape(module)
        if shape is not None:
            found[path] = shape
    return found


def find_unwrappable_experts(model: nn.Module) -> list[str]:
    """Expert blocks the bank cannot adapt: per-expert `ModuleList`s (`experts.{e}.w1`, the
    Mixtral layout), experts modules whose parameters are not the fused 3-D layout, and shared
    experts held as a 3-D bank (Inkling's `shared_experts.gate_proj [2, I, H]`) rather than
    linears."""
    fused = find_expert_modules(model)
    unwrappable: set[str] = set()
    for path, module in model.named_modules():
        parts = path.split(".")
        if not parts or path in fused:
            continue
        if any(part.startswith(_VISION_PREFIXES) for part in parts):
            continue
        if parts[-1] in {"experts", "routed_experts"}:
            if any(p.dim() >= 2 for p in module.parameters(recurse=True)):
                unwrappable.add(path)
        elif parts[-1] in {"shared_expert", "shared_experts"}:
            if any(p.dim() >= 3 for p in module.parameters(recurse=False)):
                unwrappable.add(path)
    return sorted(unwrappable)


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


class MultiSlotLoraLinear(nn.Module):
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
        super().__init__()
        self.base_layer = base_layer
        self.group = group
        self.lora_A = lora_A  # [S, r_max, in], a view of the bank's weights
        self.lora_B = lora_B  # [S, out, r_max]
        # Shared with the bank (one list per layer group): alpha/rank, or 0 where not trained.
        self.slot_scales = slot_scales
        self.routing = routing
        self.kind: LoraKind | None = None  # how `update` computes (None: the device's best)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        return self.with_segments(x, segments)

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


@dataclass(frozen=True)
class LayerLayout:
    """Where one wrapped linear's A and B live inside a slot's row of the bank."""

    path: str
    group: LayerGroup
    in_features: int
    out_features: int
    a_offset: int
    b_offset: int
    # Fused MoE experts' factors (`workers.engine.moe_lora`): 0 for a 2-D factor, shared by the
    # experts of a block; E for one factor per expert (A `[E, r, in]`, B `[E, out, r]`).
    a_experts: int = 0
    b_experts: int = 0
    # Expert parallelism (`workers.engine.expert_parallel`): the per-expert factor here holds
    # experts `expert_offset ..` of `experts_total` (0: all of them, no split).
    expert_offset: int = 0
    experts_total: int = 0

    @property
    def a_size(self) -> int:
        return max(1, self.a_experts) * self.in_features

    @property
    def b_size(self) -> int:
        return max(1, self.b_experts) * self.out_features


@dataclass(frozen=True)
class ExpertSlice:
    """The experts one rank holds of a fused experts block: `offset ..` of `total`."""

    offset: int
    total: int


def lay_out_slot(
    model: nn.Module,
    max_rank: int,
    slices: dict[str, ExpertSlice] | None = None,
    *,
    whole: bool = False,
) -> tuple[list[LayerLayout], int]:
    """Where every adaptable layer's factors sit in a slot's row, and the row's length.

    Layouts in order: the linears, then each fused experts block's w1, w3, w2 (non-gated
    experts: w1, w2). In the row, every
    factor one rank holds whole comes first (the linears' A and B, the experts' shared factors)
    and the per-expert factors last, from `per_expert_start` on (`LoraBank`): under expert
    parallelism that tail is what differs between ranks, one contiguous part of each row.
    `slices`: the experts this rank holds of each block that is split; `whole`: lay out the
    blocks with all their experts (the layout of one device, which checkpoints and snapshots
    use whatever the split).
    """
    targets = find_target_linears(model)
    experts = find_expert_modules(model)
    if not targets and not experts:
        raise ServerError("the base model has no attention, MLP or output linears to adapt")
    slices = slices or {}
    layouts: list[LayerLayout] = []
    for path, group in targets.items():
        linear = cast(nn.Linear, model.get_submodule(path))
        layouts.append(LayerLayout(path, group, linear.in_features, linear.out_features, 0, 0))
    for path, shape in experts.items():
        part = slices.get(path)
        for projection in shape.projections:
            in_f, out_f, a_e, b_e = projection_shape(shape, projection)
            offset, total = (part.offset, part.total) if part else (0, 0)
            if whole and part:
                a_e, b_e, offset, total = (
                    (part.total if a_e else 0),
                    (part.total if b_e else 0),
                    0,
                    0,
                )
            layouts.append(
                LayerLayout(
                    f"{path}.{projection}", "mlp", in_f, out_f, 0, 0, a_e, b_e, offset, total
                )
            )
    offset = 0
    placed: list[LayerLayout] = []
    for layout in layouts:  # the factors every rank holds whole
        a_offset = offset
        offset += 0 if layout.a_experts else layout.a_size * max_rank
        b_offset = offset
        offset += 0 if layout.b_experts else layout.b_size * max_rank
        placed.append(replace(layout, a_offset=a_offset, b_offset=b_offset))
    for i, layout in enumerate(placed):  # then the per-expert ones
        if layout.a_experts:
            placed[i] = layout = replace(layout, a_offset=offset)
            offset += layout.a_size * max_rank
        if layout.b_experts:
            placed[i] = replace(layout, b_offset=offset)
            offset += layout.b_size * max_rank
    return placed, offset


def per_expert_start(layouts: Iterable[LayerLayout], row: int, max_rank: int) -> int:
    """Where the per-expert factors begin in a slot's row (`row`: none)."""
    starts = [layout.a_offset for layout in layouts if layout.a_experts]
    starts += [layout.b_offset for layout in layouts if layout.b_experts]
    return min(starts, default=row)


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
        self.expert_layers: dict[str, MultiSlotLoraExperts] = {}
        by_path = {layout.path: layout for layout in self.layouts}
        for path in targets:
            self._wrap(model, by_path[path])
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
        for layer in self.layers.values():
            layer.kind = kind

    def _wrap(self, model: nn.Module, layout: LayerLayout) -> None:
        lora_A = nn.Parameter(self._stacked_a(self.weights, layout))
        lora_A.grad = self._stacked_a(self.grads, layout)
        lora_B = nn.Parameter(self._stacked_b(self.weights, layout))
        lora_B.grad = self._stacked_b(self.grads, layout)
        parent_path, _, leaf = layout.path.rpartition(".")
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
        self.layers[layout.path] = layer

    def _wrap_experts(
        self, model: nn.Module, path: str, shape: ExpertShape, by_path: dict[str, LayerLayout]
    ) -> None:
        factors: dict[ExpertProjection, ExpertFactors] = {}
        for projection in shape.projections:
            layout = by_path[f"{path}.{projection}"]
            lora_A = nn.Parameter(self._stacked_a(self.weights, layout))
            lora_A.grad = self._stacked_a(self.grads, layout)
            lora_B = nn.Parameter(self._stacked_b(self.weights, layout))
            lora_B.grad = self._stacked_b(self.grads, layout)
            factors[projection] = ExpertFactors(lora_A, lora_B)
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
