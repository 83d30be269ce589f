"""Which layers a slot's adapter trains, and where their factors lie in a slot's row.

Job: classify a model's linears by layer group (attention, MLP, output layer) the way Tinker
targets them (docs/compatibility.md, "Which linears an adapter trains"), find its fused experts
blocks and the blocks the bank cannot adapt, and lay out one slot's factors in a flat row
(`lay_out_slot`), which `workers.engine.lora.LoraBank` allocates, `workers.engine.lora_counts`
counts on the meta device, and checkpoints and snapshots read.

Invariants:
- The same model gives the same layouts on every device and rank (only the per-expert tail of a
  row differs between the ranks of a split experts block).
- Vision towers, routers, MLA's low-rank up-projections and per-head scalar projections are
  never targets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Literal, cast

from torch import nn

from protocol.errors import ServerError
from workers.engine.moe_lora import ExpertShape, expert_shape, projection_shape
from workers.engine.shared_bank import bank_shape, shares_gate_up_a
from workers.engine.sliced_lora import SlicedLinear, find_sliced_linears, part_path

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
# Per-head scalars projected from the hidden state (Qwen3.5's Gated DeltaNet decay and beta
# inputs): Tinker leaves them alone.
_SCALAR_LEAVES = frozenset({"in_proj_a", "in_proj_b"})
# A hybrid model's per-block mixer (Nemotron-H: `model.layers.N.mixer` is a Mamba2 mixer, an
# attention, or a MoE): its group follows what the block is (`_mixer_group`).
_MIXER_PARENTS = frozenset({"mixer"})
# Multimodal checkpoints also have `attn`/`mlp` blocks in their vision tower; tenants train text.
_VISION_PREFIXES = ("visual", "vision")


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
        if group == "attn" and parts[-1] not in _LOW_RANK_LEAVES | _SCALAR_LEAVES:
            targets[path] = "attn"
        elif group == "mlp" and parts[-1] not in _UNTRAINED_LEAVES:
            targets[path] = "mlp"
    return targets


def _outside_vision(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`model.named_modules()` but a vision tower's."""
    for path, module in model.named_modules():
        if not any(part.startswith(_VISION_PREFIXES) for part in path.split(".")):
            yield path, module


def find_expert_modules(model: nn.Module) -> dict[str, ExpertShape]:
    """The fused experts modules of a MoE model (`mlp.experts`), by module path."""
    shapes = {path: expert_shape(module) for path, module in _outside_vision(model)}
    return {path: shape for path, shape in shapes.items() if shape is not None}


def find_unwrappable_experts(model: nn.Module) -> list[str]:
    """Expert blocks the bank cannot adapt: per-expert `ModuleList`s (`experts.{e}.w1`, the
    Mixtral layout), experts modules whose parameters are not the fused 3-D layout, and shared
    experts held as 3-D weights other than a shared-expert bank (`find_shared_banks`)."""
    fused = {**find_expert_modules(model), **find_shared_banks(model)}
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


def find_shared_banks(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """The shared-expert banks (`workers.engine.shared_bank`), by path: (n, I, H)."""
    shapes = {path: bank_shape(module) for path, module in _outside_vision(model)}
    return {path: shape for path, shape in shapes.items() if shape is not None}


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
    sliced = find_sliced_linears(model, list(targets))
    for path, group in targets.items():
        linear = cast(nn.Linear, model.get_submodule(path))
        parent, _, leaf = path.rpartition(".")
        if shares_gate_up_a(model.get_submodule(parent)) and leaf in ("gate_proj", "up_proj"):
            if leaf == "gate_proj":  # one pair over gate and up (shared_bank.py)
                up = cast(nn.Linear, model.get_submodule(f"{parent}.up_proj"))
                out = linear.out_features + up.out_features
                layouts.append(
                    LayerLayout(f"{parent}.gate_up_proj", group, linear.in_features, out, 0, 0)
                )
            continue
        for name, out_features in _parts_of(path, linear, sliced.get(path)):
            layouts.append(LayerLayout(name, group, linear.in_features, out_features, 0, 0))
    for path, (n, inter, hidden) in find_shared_banks(model).items():
        for name, in_f, out_f in (
            ("gate_proj", hidden, n * inter),
            ("up_proj", hidden, n * inter),
            ("down_proj", n * inter, hidden),
        ):
            layouts.append(LayerLayout(f"{path}.{name}", "mlp", in_f, out_f, 0, 0))
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


def _parts_of(path: str, linear: nn.Linear, sliced: SlicedLinear | None) -> list[tuple[str, int]]:
    """(layout path, out features) of a target linear: itself, or each slice it is adapted by."""
    if sliced is None:
        return [(path, linear.out_features)]
    return [(part_path(path, piece), piece.stop - piece.start) for piece in sliced.slices]


def per_expert_start(layouts: Iterable[LayerLayout], row: int, max_rank: int) -> int:
    """Where the per-expert factors begin in a slot's row (`row`: none)."""
    starts = [layout.a_offset for layout in layouts if layout.a_experts]
    starts += [layout.b_offset for layout in layouts if layout.b_experts]
    return min(starts, default=row)
