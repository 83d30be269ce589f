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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from protocol.errors import ServerError
from workers.engine.collective import Collective, ExpertInput, ExpertOutput
from workers.engine.context_parallel import (
    SequenceSplit,
    gather_tokens,
    reduce_tokens,
)
from workers.engine.context_parallel import current as current_split
from workers.engine.lora_kernels import select_rows
from workers.engine.moe_kernels import ExpertLinear, GroupedProduct, RoutePlan

if TYPE_CHECKING:
    from workers.engine.lora import Segment, SlotRouting

ExpertProjection = Literal["w1", "w3", "w2"]
# Tinker's names: w1 gate, w3 up, w2 down. Non-gated experts (Nemotron-H's relu² `up_proj`,
# `down_proj`) have w1 (up, the activated one) and w2 (down) only.
EXPERT_PROJECTIONS: tuple[ExpertProjection, ...] = ("w1", "w3", "w2")
PLAIN_PROJECTIONS: tuple[ExpertProjection, ...] = ("w1", "w2")
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
    # False: non-gated experts, `down(act(up(x)))` with `up_proj [E, I, H]` (Nemotron-H); the
    # projection before the activation is then `gate_up` of `I` rows, not `2I`
    gated: bool = True

    @property
    def projections(self) -> tuple[ExpertProjection, ...]:
        """The projections this block's adapter has, in the bank's order."""
        return EXPERT_PROJECTIONS if self.gated else PLAIN_PROJECTIONS


def expert_shape(module: nn.Module) -> ExpertShape | None:
    """The layout of a fused experts module, or None if `module` is not one.

    A fused experts module holds 3-D `gate_up_proj` and `down_proj` parameters and is called as
    `experts(hidden_states, top_k_index, top_k_weights)`; transformers 5 marks its layout with
    `is_transposed` / `is_concatenated` / `has_bias` and provides `_apply_gate`.
    """
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(down, torch.Tensor):
        return None
    if gate_up is None:
        return _plain_shape(module, down)
    if not isinstance(gate_up, torch.Tensor):
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


def _plain_shape(module: nn.Module, down: torch.Tensor) -> ExpertShape | None:
    """Non-gated fused experts: 3-D `up_proj [E, I, H]`, `down_proj [E, H, I]` and `act_fn`,
    called as the gated ones are (Nemotron-H's `NemotronHExperts`)."""
    up = getattr(module, "up_proj", None)
    if not isinstance(up, torch.Tensor) or up.dim() != 3 or down.dim() != 3:
        return None
    if getattr(module, "gate_proj", None) is not None:
        return None  # gated, each token through every one (Inkling's shared-expert bank)
    n_experts, intermediate, hidden = (int(n) for n in up.shape)
    if tuple(down.shape) != (n_experts, hidden, intermediate) or not callable(
        getattr(module, "act_fn", None)
    ):
        return None
    return ExpertShape(n_experts, hidden, intermediate, False, True, False, gated=False)


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

    gate_up = tensor("gate_up_proj" if shape.gated else "up_proj")
    down = tensor("down_proj")
    assert gate_up is not None and down is not None  # `expert_shape` found them
    return ExpertWeights(
        gate_up,
        down,
        tensor("gate_up_proj_bias") if shape.has_bias else None,
        tensor("down_proj_bias") if shape.has_bias else None,
        cast(
            Callable[[torch.Tensor], torch.Tensor],
            module._apply_gate if shape.gated else module.act_fn,
        ),
    )


def projection_shape(shape: ExpertShape, projection: ExpertProjection) -> tuple[int, int, int, int]:
    """(in_features, out_features, A experts, B experts) of one projection's factors, where an
    experts count of 0 marks the shared (2-D) factor."""
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    if projection == "w2":
        return i, h, e, 0
    return h, i, 0, e


@dataclass(frozen=True)
class ExpertParallel:
    """A block whose experts are split over the ranks of a group: this rank holds experts
    `offset ..` of `total` (its base weights and its slots' per-expert factors)."""

    collective: Collective
    offset: int
    total: int


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
        parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.shape = shape  # this rank's experts
        self.parallel = parallel
        self.group = "mlp"
        for projection in shape.projections:
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
        if self.parallel is not None:
            return self._parallel_forward(hidden_states, top_k_index, top_k_weights, active)
        if not active:
            return cast(torch.Tensor, self.base_layer(hidden_states, top_k_index, top_k_weights))
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, active)

    def base(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The frozen experts alone: the wrapped module, or this rank's experts of a split block
        (`top_k_index` then names them locally, `shape.num_experts` for another rank's)."""
        if self.parallel is None:
            return cast(torch.Tensor, self.base_layer(x, top_k_index, top_k_weights))
        return local_experts(self, x, top_k_index, top_k_weights)

    def _parallel_forward(
        self,
        x: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        active: list[tuple[int, int, int, float, int]],
    ) -> torch.Tensor:
        """Expert parallelism: every rank has every token, computes its own experts' share of
        the block's output (base and LoRA), and the shares are summed (`ExpertOutput`); the
        gradients into the tokens and the routing weights are summed backward (`ExpertInput`)."""
        parallel = self.parallel
        assert parallel is not None
        split = current_split()
        if split is not None:
            return self._split_forward(x, top_k_index, top_k_weights, split)
        grad = torch.is_grad_enabled()
        needs = grad and (x.requires_grad or top_k_weights.requires_grad)
        if needs:
            x, top_k_weights = ExpertInput.apply(x, top_k_weights, parallel.collective)  # type: ignore[no-untyped-call]
        partial = self._own_share(x, top_k_index, top_k_weights, active)
        # Whether the output takes part in the backward must not depend on this rank's experts:
        # with a trained slot in the pass it does on every rank.
        anchor = torch.zeros((), device=x.device, requires_grad=grad and bool(active))
        return cast(
            torch.Tensor,
            ExpertOutput.apply(partial, x, top_k_weights, anchor, parallel.collective),  # type: ignore[no-untyped-call]
        )

    def _own_share(
        self,
        x: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        active: list[tuple[int, int, int, float, int]],
    ) -> torch.Tensor:
        """This rank's experts' share of the block's output for tokens `x` (base and LoRA);
        `top_k_index` names experts globally (another rank's count as `num_experts`)."""
        parallel = self.parallel
        assert parallel is not None
        n_local = self.shape.num_experts
        local = top_k_index.to(torch.long) - parallel.offset
        local = torch.where((local >= 0) & (local < n_local), local, n_local)
        if active:
            return experts_forward(self, x, local, top_k_weights, active)
        return local_experts(self, x, local, top_k_weights)

    def _split_forward(
        self,
        x: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        split: SequenceSplit,
    ) -> torch.Tensor:
        """Expert parallelism in a pass split by position (`context_parallel.py`): the ranks'
        tokens are gathered, every rank computes its own experts' share for all of them, and
        the shares are summed back to each rank's own tokens."""
        parallel = self.parallel
        assert parallel is not None
        every_x = gather_tokens(x, split)
        every_weights = gather_tokens(top_k_weights, split)
        every_index = gather_tokens(top_k_index, split)
        active = self._active(self.routing.segments, every_x.shape[0])
        partial = self._own_share(every_x, every_index, every_weights, active)
        grad = torch.is_grad_enabled() and bool(active)
        anchor = torch.zeros((), device=x.device, requires_grad=grad)
        inputs = [t for t in (every_x, every_weights) if t.requires_grad]
        return reduce_tokens(partial, split, anchor, *inputs)

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
            are laid out in tiles of L rows (`RoutePlan`).
    Step 2: the shared A factors of gate and up, `[A1; A3]`, in one batched matmul over the
            active segments' tokens (scaled).
    Step 3: the base gate_up of each expert over its rows, into one output (`ExpertLinear`).
    Step 4: the per-expert B factors of gate and up (`GroupedProduct`): per segment one
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
    plan = RoutePlan(active, top_k_index, x.shape[0], shape.num_experts, rank)
    if not plan.grids:  # no token of an active segment reaches an expert: no update
        return layer.base(x, top_k_index, top_k_weights)
    frozen = expert_weights(layer.base_layer, shape)
    scales = plan.scales.to(dtype)
    routed_weight = top_k_weights.reshape(-1).index_select(0, plan.routed).unsqueeze(-1)

    # Step 2: [segments, longest segment, 2r] (non-gated: r); the tiles' padding reads an
    # appended zero row.
    before_act: tuple[ExpertProjection, ...] = ("w1", "w3") if shape.gated else ("w1",)
    a_shared = torch.cat(
        [
            select_rows(layer.factor(p, "A"), plan.slots, 1, rank, into_grad=True, span=plan.span)
            for p in before_act
        ],
        1,
    ).to(dtype)
    shrunk = torch.bmm(plan.segment_rows(x), a_shared.transpose(1, 2)) * scales
    # One factor's rows are the token positions themselves: `z_index` places them.
    u_index = plan.u_index if shape.gated else plan.z_index
    u = F.pad(shrunk.reshape(-1, rank), (0, 0, 0, 1)).index_select(0, u_index)

    # Step 3. index_select rather than indexing: its backward is one index_add, not a sort.
    x_rows = x.index_select(0, plan.token)
    gate_up = ExpertLinear.apply(
        x_rows, frozen.gate_up, frozen.gate_up_bias, plan, shape.transposed
    )  # type: ignore[no-untyped-call]

    # Step 4: back in row order, row j's gate update at 2j and its up at 2j + 1 (non-gated: its
    # one update at j); rows of no active segment read a zero row.
    b_factors = [layer.factor(p, "B") for p in before_act]
    update = GroupedProduct.apply(u, plan, -1, rank, *b_factors)  # type: ignore[no-untyped-call]
    update = F.pad(update, (0, 0, 0, 1)) if plan.ungrouped else update
    if not shape.gated:
        # `update_index` names the gate's row then the up's; one factor has the first only,
        # and its zero row sits right after its positions
        first = plan.update_index.view(-1, 2)[:, 0]
        first = torch.where(first < plan.positions, first, plan.positions)
        gate_up = gate_up + update.index_select(0, first)
    else:
        update = update.index_select(0, plan.update_index).view(-1, 2, shape.intermediate)
        if shape.concatenated:
            gate_up = gate_up + update.view(gate_up.shape)
        else:
            gate_up = (gate_up.view(-1, shape.intermediate, 2) + update.transpose(1, 2)).flatten(1)
    # Scaled by the router weight, the activations weight the base down projection and the
    # down A factors alike.
    hidden = frozen.apply_gate(gate_up) * routed_weight

    # Step 5. The tiles' padding adds into an extra row of `summed`, dropped.
    out = ExpertLinear.apply(hidden, frozen.down, None, plan, shape.transposed)  # type: ignore[no-untyped-call]
    if frozen.down_bias is not None:
        out = out + routed_weight * frozen.down_bias.index_select(0, plan.row_expert)
    result = torch.zeros_like(x).index_add(0, plan.token, out)
    tiled = hidden.index_select(0, plan.row_index)
    z = GroupedProduct.apply(tiled, plan, -2, rank, layer.factor("w2", "A"))  # type: ignore[no-untyped-call]
    summed = x.new_zeros(plan.segment_positions + 1, rank).index_add(0, plan.z_index, z)
    summed = summed[:-1].view(*shrunk.shape[:2], rank) * scales
    b_down = select_rows(
        layer.factor("w2", "B"), plan.slots, -1, rank, into_grad=True, span=plan.span
    ).to(dtype)
    return plan.place(result, torch.bmm(summed, b_down.transpose(1, 2)))


def local_experts(
    layer: MultiSlotLoraExperts,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """This rank's experts of a split block with no LoRA: each expert over its routed rows,
    weighted and summed per token, as the wrapped module computes them for all experts. Routed
    rows naming `shape.num_experts` belong to another rank's experts and are left out."""
    shape = layer.shape
    frozen = expert_weights(layer.base_layer, shape)
    n_experts, top_k = shape.num_experts, top_k_index.shape[1]
    flat = top_k_index.reshape(-1).to(torch.long)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts].tolist()
    weights = top_k_weights.reshape(-1, 1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = order[start : start + count]
        start += count
        tokens = rows // top_k
        gate_up = frozen.gate_up[expert]
        hidden = x.index_select(0, tokens) @ (gate_up if shape.transposed else gate_up.T)
        if frozen.gate_up_bias is not None:
            hidden = hidden + frozen.gate_up_bias[expert]
        down = frozen.down[expert]
        y = frozen.apply_gate(hidden) @ (down if shape.transposed else down.T)
        if frozen.down_bias is not None:
            y = y + frozen.down_bias[expert]
        out = out.index_add(0, tokens, y * weights.index_select(0, rows).to(y.dtype))
    return out
