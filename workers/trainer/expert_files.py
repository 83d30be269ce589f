"""Fused experts' LoRA in checkpoint files: Tinker's shared-outer factors in the layouts tools read.

Job: convert one adapter's expert tensors between the trainer's form and a file layout, both
ways, and refuse a file the trainer cannot represent. Pure tensor code: no file I/O, no model.

In the trainer (slots, `AdapterCheckpoint.tensors`, merging) a fused experts block X (E experts,
hidden H, intermediate I, rank r) holds Tinker's shared-outer adapter, keyed as Tinker keys it:

    X.w1 (gate)  A [1, r, H] shared   B [E, I, r]
    X.w3 (up)    A [1, r, H] shared   B [E, I, r]
    X.w2 (down)  A [E, r, I]          B [1, H, r] shared

(key = `base_model.model.<path>.lora_A|lora_B.weight`). A file holds one of three layouts:

- "peft": PEFT's `target_parameters` wrappers on transformers 5's `gate_up_proj` and
  `down_proj`, what `peft.PeftModel.from_pretrained` loads on the stock model. PEFT nests the two
  wrappers, the first parameter of the module inside: `X.base_layer.lora_*` is gate_up_proj,
  `X.lora_*` is down_proj. A wrapper of rank R on `[E, out, in]` (or `[E, in, out]`, gpt-oss)
  has A `[R·E, in]` with rows expert-major (row e·R + k) and B `[out, R·E]` with columns
  rank-major (column k·E + e). Gate and up have separate A factors, so gate_up_proj is written
  at rank 2r: each expert's A is `[A1; A3]` and its B block-diagonal (gate rows use ranks [0, r),
  up rows ranks [r, 2r), in the module's row order: halves, or interleaved for gpt-oss); the
  config's `rank_pattern`/`alpha_pattern` give it rank 2r and alpha 2·alpha, so its scale is
  alpha/r like every other layer's. The shared factors are repeated per expert.
- "per-expert": 2-D PEFT keys per expert, `X.{e}.gate_proj|up_proj|down_proj.lora_A|B.weight`,
  what tinker-cookbook's `weights.build_lora_adapter` writes and vLLM's per-expert loader takes.
- "tinker": the trainer's form as is (tinker-cookbook's `weights.build_hf_model` reads it).

Non-gated experts (Nemotron-H: `up_proj [E, I, H]`, `down_proj`; the trainer's X.w1 and X.w2)
are written as PEFT's two nested wrappers at rank r in the "peft" layout (`X.base_layer.lora_*` is
up_proj, its A shared across experts), and in the trainer's form in the other two.

Invariants:
- Both directions only copy values and write PEFT's zero blocks, so a checkpoint round-trips
  bit-exactly.
- Reading takes any of the three (block by block) when the file is representable as
  shared-outer: a shared side equal across experts, zero blocks exactly 0, one scale alpha/r
  for all layers. Otherwise a `UserError` names the first tensor that is not.
- Reading works on `meta` tensors too (shapes only, no value checks), so an import's header is
  checked before any data is read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from protocol.errors import UserError
from protocol.jobs import AdapterLayout
from protocol.paths import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from workers.engine.moe_lora import EXPERT_PROJECTIONS, ExpertProjection, ExpertShape

PER_EXPERT_NAMES: dict[ExpertProjection, str] = {
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}
_BY_PER_EXPERT_NAME = {name: projection for projection, name in PER_EXPERT_NAMES.items()}
GATE_UP, DOWN = "gate_up_proj", "down_proj"  # transformers 5's fused parameters
UP = "up_proj"  # the fused parameter before the activation of non-gated experts
_INNER = ".base_layer"  # PEFT's path of the inner of two nested wrappers

Tensors = dict[str, torch.Tensor]
Matrix = Literal["A", "B"]
MATRICES: tuple[Matrix, ...] = ("A", "B")


def adapter_key(path: str, matrix: Matrix) -> str:
    """PEFT's tensor name for a module's LoRA matrix."""
    return f"base_model.model.{path}.lora_{matrix}.weight"


def _module_path(key: str) -> tuple[str, str] | None:
    """(module path, "A" | "B") of a LoRA tensor name, or None for another tensor."""
    match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
    return (match[1], match[2]) if match else None


class AdapterScales:
    """Each module's rank and alpha as PEFT derives them from an adapter config.

    PEFT picks the first key of `rank_pattern` (`alpha_pattern`) that matches the end of the
    module's name (`(.*\\.)?(key)$`), else `r` (`lora_alpha`). A slot has one scale alpha/r.
    """

    def __init__(self, config: Mapping[str, Any], rank: int, lora_alpha: float) -> None:
        self.rank, self.lora_alpha = rank, lora_alpha
        self.rank_pattern = _pattern(config, "rank_pattern")
        self.alpha_pattern = _pattern(config, "alpha_pattern")

    def of(self, module: str) -> tuple[float, float]:
        """(rank, alpha) PEFT gives `module` (a module path, or `<experts>.gate_up_proj` …)."""
        rank = _lookup(self.rank_pattern, module, self.rank)
        alpha = _lookup(self.alpha_pattern, module, self.lora_alpha)
        return rank, alpha

    def check(self, module: str, key: str, file_rank: int | None) -> None:
        """A `UserError` unless `module` has the adapter's scale (and rank `file_rank` if given)."""
        if not (self.rank_pattern or self.alpha_pattern) and file_rank in (None, self.rank):
            return
        rank, alpha = self.of(module)
        if file_rank is not None and rank != file_rank:
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {key} has rank {file_rank}, but {ADAPTER_CONFIG} gives"
                f" {module} rank {rank:g} (r / rank_pattern)"
            )
        if alpha * self.rank != self.lora_alpha * rank:
            raise UserError(
                f"{ADAPTER_CONFIG}: {module} is scaled by {alpha:g}/{rank:g}, the adapter by"
                f" lora_alpha/r = {self.lora_alpha:g}/{self.rank}: only one scale is supported"
            )


def _pattern(config: Mapping[str, Any], name: str) -> dict[str, float]:
    value = config.get(name) or {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
        for k, v in value.items()
    ):
        raise UserError(f"{ADAPTER_CONFIG}: {name} must map module names to numbers")
    return {k: float(v) for k, v in value.items()}


def _lookup(pattern: dict[str, float], module: str, default: float) -> float:
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error:
            raise UserError(f"{ADAPTER_CONFIG}: pattern {key[:60]!r} is not a regex") from None
    return default


# -- writing ------------------------------------------------------------------------------------


def expert_paths(
    tensors: Mapping[str, torch.Tensor], experts: Mapping[str, ExpertShape]
) -> list[str]:
    """The experts blocks `tensors` (the trainer's form) holds factors of, in model order."""
    paths = set()
    for key in tensors:
        parsed = _module_path(key)
        if parsed is None:
            continue
        block, _, projection = parsed[0].rpartition(".")
        if projection in EXPERT_PROJECTIONS and block in experts:
            paths.add(block)
    return [path for path in experts if path in paths]


def to_file(
    tensors: Mapping[str, torch.Tensor], experts: Mapping[str, ExpertShape], layout: AdapterLayout
) -> Tensors:
    """`tensors` (the trainer's form) in a file layout; other layers' tensors unchanged."""
    blocks = expert_paths(tensors, experts)
    own = {
        adapter_key(f"{x}.{p}", m) for x in blocks for p in experts[x].projections for m in MATRICES
    }
    written: Tensors = {key: value for key, value in tensors.items() if key not in own}
    if layout == "tinker":
        return {**written, **{key: tensors[key] for key in own}}
    for block in blocks:
        shape = experts[block]

        def factor(projection: str, matrix: Matrix, block: str = block) -> torch.Tensor:
            return tensors[adapter_key(f"{block}.{projection}", matrix)]

        if not shape.gated and layout != "peft":
            for projection in shape.projections:
                for matrix in MATRICES:
                    key = adapter_key(f"{block}.{projection}", matrix)
                    written[key] = tensors[key]
            continue
        if not shape.gated:
            up_a, up_b = factor("w1", "A")[0], factor("w1", "B")  # [r, H] shared, [E, I, r]
            n, rank = shape.num_experts, up_a.shape[0]
            written[adapter_key(block + _INNER, "A")] = (
                up_a.expand(n, -1, -1).reshape(n * rank, -1).clone()
            )
            written[adapter_key(block + _INNER, "B")] = (
                up_b.permute(1, 2, 0).reshape(up_b.shape[1], rank * n).clone()
            )
            written.update(_down_file(shape, factor("w2", "A"), factor("w2", "B"), block))
            continue

        if layout == "per-expert":
            for e in range(shape.num_experts):
                for projection, name in PER_EXPERT_NAMES.items():
                    a, b = factor(projection, "A"), factor(projection, "B")
                    path = f"{block}.{e}.{name}"
                    written[adapter_key(path, "A")] = a[min(e, a.shape[0] - 1)].clone()
                    written[adapter_key(path, "B")] = b[min(e, b.shape[0] - 1)].clone()
            continue
        gate_up_a, gate_up_b = _gate_up_file(
            shape, factor("w1", "A"), factor("w1", "B"), factor("w3", "A"), factor("w3", "B")
        )
        written[adapter_key(block + _INNER, "A")] = gate_up_a
        written[adapter_key(block + _INNER, "B")] = gate_up_b
        written.update(_down_file(shape, factor("w2", "A"), factor("w2", "B"), block))
    return written


def _down_file(shape: ExpertShape, a: torch.Tensor, b: torch.Tensor, block: str) -> Tensors:
    """PEFT's outer (down_proj) wrapper at rank r from w2's A `[E, r, I]` and shared B."""
    n, rank, shared = shape.num_experts, a.shape[1], b[0]  # shared: [H, r]
    return {
        adapter_key(block, "A"): a.reshape(n * rank, -1).clone(),
        adapter_key(block, "B"): (
            shared.unsqueeze(-1).expand(-1, -1, n).reshape(shared.shape[0], rank * n).clone()
        ),
    }


def _gate_up_file(
    shape: ExpertShape, a1: torch.Tensor, b1: torch.Tensor, a3: torch.Tensor, b3: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's gate_up_proj wrapper at rank 2r: A `[2r·E, H]`, B `[2I, 2r·E]` block-diagonal."""
    n, rank = shape.num_experts, a1.shape[1]
    a = torch.cat([a1[0], a3[0]]).expand(n, -1, -1).reshape(n * 2 * rank, -1).clone()
    gate, up = _gate_up_rows(shape)
    per_expert = torch.zeros(n, 2 * shape.intermediate, 2 * rank, dtype=b1.dtype, device=b1.device)
    per_expert[:, gate, :rank] = b1
    per_expert[:, up, rank:] = b3
    b = per_expert.permute(1, 2, 0).reshape(2 * shape.intermediate, 2 * rank * n).clone()
    return a, b


def _gate_up_rows(shape: ExpertShape) -> tuple[slice, slice]:
    """The gate and up rows of a fused gate_up projection's output."""
    if shape.concatenated:
        return slice(0, shape.intermediate), slice(shape.intermediate, None)
    return slice(0, None, 2), slice(1, None, 2)


def peft_config_fields(
    blocks: list[str], rank: int, lora_alpha: float, plain: Sequence[str] = ()
) -> dict[str, Any]:
    """The `adapter_config.json` fields PEFT needs for the gated (`blocks`) and non-gated
    (`plain`) experts blocks of a "peft" file."""
    if not blocks and not plain:
        return {}
    patterns = sorted({f"{block.rpartition('.')[2]}.{GATE_UP}" for block in blocks})
    return {
        "target_parameters": [f"{block}.{name}" for block in blocks for name in (GATE_UP, DOWN)]
        + [f"{block}.{name}" for block in plain for name in (UP, DOWN)],
        "rank_pattern": {pattern: 2 * rank for pattern in patterns},
        "alpha_pattern": {pattern: 2 * lora_alpha for pattern in patterns},
    }


# -- reading ------------------------------------------------------------------------------------


def from_file(
    tensors: Mapping[str, torch.Tensor],
    experts: Mapping[str, ExpertShape],
    scales: AdapterScales,
) -> Tensors:
    """A file's tensors in the trainer's form; a `UserError` naming the first tensor that is
    not representable. Tensors of other layers pass unchanged (their scale checked)."""
    peft: dict[str, dict[str, dict[str, str]]] = {}  # block → wrapper path → matrix → key
    per_expert: dict[tuple[str, ExpertProjection], dict[int, dict[str, str]]] = {}
    read: Tensors = {}
    for key, tensor in tensors.items():
        parsed = _module_path(key)
        if parsed is None:
            read[key] = tensor
            continue
        path, matrix = parsed
        block = path.removesuffix(_INNER)
        if block in experts:
            peft.setdefault(block, {}).setdefault(path, {})[matrix] = key
            continue
        head, _, leaf = path.rpartition(".")
        group, _, index = head.rpartition(".")
        if group in experts and index.isdecimal() and leaf in _BY_PER_EXPERT_NAME:
            slot = per_expert.setdefault((group, _BY_PER_EXPERT_NAME[leaf]), {})
            slot.setdefault(int(index), {})[matrix] = key
            continue
        if head in experts and leaf in EXPERT_PROJECTIONS:  # Tinker's layout
            tensor = _tinker_factor(tensor, key, experts[head], leaf, matrix)
        if matrix == "A":
            scales.check(path, key, None)
        read[key] = tensor

    def put(block: str, projection: ExpertProjection, a: torch.Tensor, b: torch.Tensor) -> None:
        for key, value in (
            (adapter_key(f"{block}.{projection}", "A"), a),
            (adapter_key(f"{block}.{projection}", "B"), b),
        ):
            if key in read:
                raise UserError(
                    f"{ADAPTER_WEIGHTS}: {block}'s {PER_EXPERT_NAMES[projection]} is given"
                    " twice (in two layouts)"
                )
            read[key] = value

    for block, wrappers in peft.items():
        for projection, a, b in _from_peft(tensors, experts[block], block, wrappers, scales):
            put(block, projection, a, b)
    for (block, projection), by_expert in per_expert.items():
        a, b = _from_per_expert(tensors, experts[block], block, projection, by_expert, scales)
        put(block, projection, a, b)
    return {key: value.contiguous() for key, value in read.items()}


def _tinker_factor(
    tensor: torch.Tensor, key: str, shape: ExpertShape, projection: str, matrix: str
) -> torch.Tensor:
    """A Tinker-layout factor; a shared side written once per expert comes back as one."""
    shared = (matrix == "A") != (projection == "w2")
    n = shape.num_experts
    if not shared or tensor.dim() != 3 or tensor.shape[0] != n or n == 1:
        return tensor  # the shapes are `match_layers`' to check
    check_equal(tensor, key, 0)
    return tensor[:1].clone()


def _from_peft(
    tensors: Mapping[str, torch.Tensor],
    shape: ExpertShape,
    block: str,
    wrappers: dict[str, dict[str, str]],
    scales: AdapterScales,
) -> list[tuple[ExpertProjection, torch.Tensor, torch.Tensor]]:
    """The shared-outer factors of a block's PEFT `target_parameters` wrappers."""
    n, hidden, inter = shape.num_experts, shape.hidden, shape.intermediate
    first = GATE_UP if shape.gated else UP  # the inner wrapper's parameter
    found: dict[str, tuple[torch.Tensor, torch.Tensor, str, str, int]] = {}
    for path, keys in sorted(wrappers.items()):
        if set(keys) != {"A", "B"}:
            raise UserError(f"{ADAPTER_WEIGHTS}: no complete A/B pair for {path}")
        a, b = tensors[keys["A"]], tensors[keys["B"]]
        features = {first: (hidden, (2 if shape.gated else 1) * inter), DOWN: (inter, hidden)}
        rank = a.shape[0] // n if a.dim() == 2 and a.shape[0] % n == 0 else 0
        fits = [name for name, (in_f, _) in features.items() if rank and a.shape[1] == in_f]
        if len(fits) == 2:  # hidden == intermediate: the nesting tells them apart
            fits = [first if path.endswith(_INNER) else DOWN]
        if not fits:
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {keys['A']} has shape {tuple(a.shape)}, expected"
                f" [R·{n}, {hidden}] ({first}) or [R·{n}, {inter}] ({DOWN})"
            )
        wanted = {name: (features[name][1], rank * n) for name in fits}
        name = next((name for name in fits if tuple(b.shape) == wanted[name]), None)
        if name is None:
            shown = " or ".join(f"{list(shape)} ({name})" for name, shape in wanted.items())
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {keys['B']} has shape {tuple(b.shape)}, expected {shown}"
            )
        if name in found:
            raise UserError(f"{ADAPTER_WEIGHTS}: {keys['A']}: {block}.{name} is given twice")
        found[name] = (a, b, keys["A"], keys["B"], rank)
    factors: list[tuple[ExpertProjection, torch.Tensor, torch.Tensor]] = []
    if GATE_UP in found:
        a, b, key_a, key_b, rank = found[GATE_UP]
        scales.check(f"{block}.{GATE_UP}", key_a, rank)
        factors += _gate_up_factors(shape, a, b, key_a, key_b, rank, scales.rank)
    if UP in found:
        a, b, key_a, rank = _at_adapter_rank(found[UP], f"{block}.{UP}", scales)
        per_expert_a = a.view(n, rank, hidden)
        check_equal(per_expert_a, key_a, 0)
        up = b.view(inter, rank, n).permute(2, 0, 1)  # [E, I, r]
        factors.append(("w1", per_expert_a[:1].clone(), up.clone()))
    if DOWN in found:
        a, b, key_a, rank = _at_adapter_rank(found[DOWN], f"{block}.{DOWN}", scales)
        key_b = found[DOWN][3]
        per_rank = b.view(hidden, rank, n)
        check_equal(per_rank.movedim(-1, 0), key_b, 0)
        factors.append(("w2", a.view(n, rank, inter).clone(), per_rank[..., 0][None].clone()))
    return factors


def _at_adapter_rank(
    wrapper: tuple[torch.Tensor, torch.Tensor, str, str, int], module: str, scales: AdapterScales
) -> tuple[torch.Tensor, torch.Tensor, str, int]:
    """(A, B, A's key, rank) of a wrapper that must have the adapter's own rank and scale."""
    a, b, key_a, _, rank = wrapper
    scales.check(module, key_a, rank)
    if rank != scales.rank:
        raise UserError(
            f"{ADAPTER_WEIGHTS}: {key_a} has rank {rank}, expected the adapter's {scales.rank}"
        )
    return a, b, key_a, rank


def _gate_up_factors(
    shape: ExpertShape,
    a: torch.Tensor,
    b: torch.Tensor,
    key_a: str,
    key_b: str,
    rank: int,
    adapter_rank: int,
) -> list[tuple[ExpertProjection, torch.Tensor, torch.Tensor]]:
    """Gate and up of a gate_up_proj wrapper: rank 2r block-diagonal (what we write), or rank r
    with one A for both."""
    n = shape.num_experts
    per_expert_a = a.view(n, rank, shape.hidden)
    check_equal(per_expert_a, key_a, 0)
    per_expert_b = b.view(2 * shape.intermediate, rank, n).permute(2, 0, 1)  # [E, 2I, R]
    gate_rows, up_rows = _gate_up_rows(shape)
    gate, up = per_expert_b[:, gate_rows], per_expert_b[:, up_rows]
    r = adapter_rank
    if rank == r:
        shared = per_expert_a[:1].clone()
        return [("w1", shared, gate.clone()), ("w3", shared.clone(), up.clone())]
    if rank != 2 * r:
        raise UserError(
            f"{ADAPTER_WEIGHTS}: {key_a} has rank {rank}, expected {r} (one A for gate and up)"
            f" or {2 * r} (gate's and up's A stacked, B block-diagonal)"
        )
    if not b.is_meta and (bool(gate[..., r:].any()) or bool(up[..., :r].any())):
        raise UserError(
            f"{ADAPTER_WEIGHTS}: {key_b} is not block-diagonal: gate rows must use ranks"
            f" [0, {r}) and up rows ranks [{r}, {2 * r}) only, the rest exactly 0"
        )
    return [
        ("w1", per_expert_a[:1, :r].clone(), gate[..., :r].clone()),
        ("w3", per_expert_a[:1, r:].clone(), up[..., r:].clone()),
    ]


def _from_per_expert(
    tensors: Mapping[str, torch.Tensor],
    shape: ExpertShape,
    block: str,
    projection: ExpertProjection,
    by_expert: dict[int, dict[str, str]],
    scales: AdapterScales,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's shared-outer factors from its per-expert 2-D keys."""
    n, name, r = shape.num_experts, PER_EXPERT_NAMES[projection], scales.rank
    for index in sorted(by_expert):
        if index >= n:
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {by_expert[index].get('A') or by_expert[index]['B']}:"
                f" {block} has {n} experts"
            )
    inner, outer = (shape.intermediate, shape.hidden)
    in_f, out_f = (inner, outer) if projection == "w2" else (outer, inner)
    a_parts, b_parts = [], []
    for e in range(n):
        path = f"{block}.{e}.{name}"
        for matrix in MATRICES:
            if matrix not in by_expert.get(e, {}):
                raise UserError(
                    f"{ADAPTER_WEIGHTS}: {adapter_key(path, matrix)} is missing"
                    f" (a per-expert adapter has every expert of {block}: {n})"
                )
        key_a, key_b = by_expert[e]["A"], by_expert[e]["B"]
        a, b = tensors[key_a], tensors[key_b]
        for key, tensor, want in ((key_a, a, (r, in_f)), (key_b, b, (out_f, r))):
            if tuple(tensor.shape) != want:
                raise UserError(
                    f"{ADAPTER_WEIGHTS}: {key} has shape {tuple(tensor.shape)}, expected {want}"
                )
        scales.check(path, key_a, r)
        a_parts.append(a)
        b_parts.append(b)
    a, b = torch.stack(a_parts), torch.stack(b_parts)
    keys = [by_expert[e]["A" if projection != "w2" else "B"] for e in range(n)]
    if projection == "w2":
        check_equal(b, keys, 0)
        return a, b[:1].clone()
    check_equal(a, keys, 0)
    return a[:1].clone(), b


def check_equal(stacked: torch.Tensor, key: str | list[str], dim: int) -> None:
    """A `UserError` naming the first slice along `dim` that differs from slice 0."""
    if stacked.is_meta or stacked.shape[dim] < 2:
        return
    first = stacked.narrow(dim, 0, 1)
    differs = (stacked != first).movedim(dim, 0).flatten(1).any(1)
    if not bool(differs.any()):
        return
    expert = int(torch.nonzero(differs)[0, 0])
    name = key[expert] if isinstance(key, list) else key
    raise UserError(
        f"{ADAPTER_WEIGHTS}: {name} (expert {expert} differs from expert 0): this factor must"
        " be the same for every expert to be trained as Tinker's shared-outer expert LoRA"
    )
