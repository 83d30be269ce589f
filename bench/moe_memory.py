"""Bytes of one adapter slot on real MoE models, and the slots that fit on 8 GPUs beside them.

A slot holds, per adapter parameter, four fp32 values: the weight, its gradient and Adam's two
moments (16 bytes). The parameters are counted with the engine's own rules
(`workers.engine.lora_counts`): each model of the lineup (`tests/data/lineup`, one
`config.json`-shaped file per text config) is built on the meta device and the adapter the bank
would lay out on it is counted per unit of rank and layer group (`attn`, `mlp`, `unembed`), so
the figures follow the engine when its rules change. Tinker's per-rank table
(tinker-cookbook's `_LORA_PARAMS_PER_RANK_BY_COMPONENT`) is printed beside each count.

Expert parallelism over N devices (`workers.engine.expert_parallel`): the meta model's experts
are split as rank 0 of N would split them (`split_experts`) and counted again, so each slot's
per-expert factors (`lay_out_slot`'s tail from `per_expert_start`) take 1/N a rank and every
other factor is whole on every rank. The base model's weights are counted from the meta model
the same way: routed experts 1/N a device, everything else (attention, embeddings, routers,
shared experts) whole on each. The plan: slots that fit on N x 80 GB and N x 141 GB (10^9
bytes) with the base in bf16 (2 bytes a parameter) and a reserve a device for activations, and
the count the worker would choose itself (`workers.engine.memory.plan_slots`).

Where the engine cannot adapt a model's experts yet (`RankCounts.unwrappable_experts`:
Nemotron-H's non-gated experts), the plan uses Tinker's per-rank count instead, its per-expert
factors taken as E x moe_intermediate_size per expert weight, and the output says so.

    .venv/bin/python bench/moe_memory.py                     # the default seven models
    .venv/bin/python bench/moe_memory.py moonshotai/Kimi-K2.6 --base-bytes 1 --reserve-gb 16

Runs offline on the CPU in seconds (nothing is allocated).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_cookbook.hyperparam_utils import _LORA_PARAMS_PER_RANK_BY_COMPONENT
from torch import nn
from transformers.utils import logging as transformers_logging

from workers.engine.collective import Collective
from workers.engine.expert_parallel import split_experts
from workers.engine.lora import LAYER_GROUPS, LayerGroup, find_expert_modules
from workers.engine.lora_counts import build_on_meta, config_from_fields, count_per_rank
from workers.engine.memory import PASS_SHARE, plan_slots

ROOT = Path(__file__).resolve().parents[1]
LINEUP = ROOT / "tests" / "data" / "lineup"
CONFIGS = ROOT / "tests" / "data" / "moe_configs"  # bench/sharded_memory.py's big two
# Printed name -> model id of the lineup.
MODELS = {
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B",
    "Qwen3.5-35B-A3B": "Qwen/Qwen3.5-35B-A3B",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "DeepSeek-V3.1": "deepseek-ai/DeepSeek-V3.1",
    "Kimi-K2.6": "moonshotai/Kimi-K2.6",  # Kimi-K2-Thinking's config: the same 1T-A32B text model
    "GLM-5.3": "zai-org/GLM-5.3",
    "Nemotron-3-Ultra": "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16",
}
RANKS = (8, 32)
DEVICES = 8
DEVICE_GB = (80, 141)
RESERVE_GB = 10.0  # a device, for activations, the CUDA context and the allocator's slack
BASE_BYTES = 2.0  # bf16
BUFFERS_PER_PARAM = 4  # weight, gradient, Adam's first and second moments
BYTES_PER_VALUE = 4  # fp32
GB, GiB = 10**9, 2**30
TINKER: Mapping[str, Mapping[str, int]] = _LORA_PARAMS_PER_RANK_BY_COMPONENT


class _PlannedRank(Collective):
    """Rank 0 of a worker group of `world` ranks, for `split_experts` (nothing is exchanged)."""

    def __init__(self, world: int) -> None:
        self.world = world


@dataclass(frozen=True)
class ModelCount:
    """One model's adapter per unit of rank and its base weights, whole and per EP rank."""

    name: str
    per_rank: dict[LayerGroup, int]  # on one device: the whole adapter
    ep_per_rank: dict[LayerGroup, int]  # on each of `devices` ranks
    engine: dict[LayerGroup, int]  # the engine's own count (= per_rank unless from Tinker)
    tinker: Mapping[str, int] | None  # Tinker's table, where it has the model
    from_tinker: bool  # per_rank is Tinker's: the engine cannot adapt the experts yet
    unwrappable: tuple[str, ...]
    base_params: int
    base_per_device: int  # parameters a device holds: routed experts 1/devices, the rest whole
    devices: int

    @property
    def total(self) -> int:
        return sum(self.per_rank.values())

    @property
    def ep_total(self) -> int:
        return sum(self.ep_per_rank.values())


def slot_bytes(params: int) -> int:
    """Bytes one slot holds for `params` adapter parameters: fp32 weights, grads, Adam m and v."""
    return params * BUFFERS_PER_PARAM * BYTES_PER_VALUE


def load_fields(model_id: str) -> dict[str, Any]:
    """A lineup model's `config.json` fields (a path to a config file also works)."""
    path = Path(model_id)
    if not path.exists():
        index: dict[str, str] = json.loads((LINEUP / "models.json").read_text())
        path = LINEUP / index[model_id]
    file = path / "config.json" if path.is_dir() else path
    fields: dict[str, Any] = json.loads(file.read_text())
    return fields


def _routed_blocks(model: nn.Module, unwrappable: tuple[str, ...]) -> list[str]:
    """The routed experts blocks: the fused ones the engine splits, and the ones it cannot adapt
    yet (planned as if split the same way); not a shared expert."""
    routed = [p for p in unwrappable if p.split(".")[-1] in {"experts", "routed_experts"}]
    return [*find_expert_modules(model), *routed]


def _per_expert_params(model: nn.Module, blocks: list[str], intermediate: int) -> int:
    """Per unit of rank, the per-expert factors of Tinker's shared-outer LoRA on expert blocks
    the engine cannot adapt: E x intermediate for each 3-D expert weight (its B when the
    weight's output is the intermediate size, its A when the input is)."""
    count = 0
    for path in blocks:
        for name, weight in model.get_submodule(path).named_parameters():
            if weight.dim() != 3:
                continue
            if intermediate not in weight.shape[1:]:
                raise ValueError(f"{path}.{name} {tuple(weight.shape)}: no side of {intermediate}")
            count += weight.shape[0] * intermediate
    return count


def count_model(name: str, model_id: str, devices: int = DEVICES) -> ModelCount:
    """Count a lineup model (or a config file) on the meta device, whole and as rank 0 of
    `devices` would hold it."""
    config = config_from_fields(load_fields(model_id))
    model = build_on_meta(config)
    counts = count_per_rank(model)
    blocks = _routed_blocks(model, counts.unwrappable_experts)
    routed = sum(p.numel() for path in blocks for p in model.get_submodule(path).parameters())
    base = sum(p.numel() for p in model.parameters())
    if routed % devices:
        raise ValueError(f"{name}: routed experts do not split evenly over {devices} devices")
    split = build_on_meta(config)
    split_experts(split, _PlannedRank(devices))  # raises where E is not a multiple of devices
    engine, ep = counts.per_group, count_per_rank(split).per_group
    tinker = TINKER.get(model_id)
    per_rank = dict(engine)
    if counts.unwrappable_experts:
        if tinker is None:
            raise ValueError(f"{name}: the engine cannot adapt its experts and Tinker has no count")
        per_rank = {group: tinker[group] for group in LAYER_GROUPS}
        text = getattr(config, "text_config", None) or config
        per_expert = _per_expert_params(model, blocks, int(text.moe_intermediate_size))
        if per_expert % devices:
            raise ValueError(f"{name}: experts do not split evenly over {devices} devices")
        ep = dict(per_rank)
        ep["mlp"] -= per_expert - per_expert // devices
    return ModelCount(
        name=name,
        per_rank=per_rank,
        ep_per_rank=ep,
        engine=dict(engine),
        tinker=tinker,
        from_tinker=bool(counts.unwrappable_experts),
        unwrappable=counts.unwrappable_experts,
        base_params=base,
        base_per_device=base - routed + routed // devices,
        devices=devices,
    )


def slots_that_fit(device_bytes: float, reserve_bytes: float, base: float, slot: int) -> int:
    """Slots of `slot` bytes in what a device has left after its base weights and the reserve."""
    return max(0, int((device_bytes - reserve_bytes - base) // slot))


def _against_tinker(count: ModelCount) -> str:
    if count.from_tinker:
        return "Tinker's count *"
    if count.tinker is None:
        return "no Tinker number"
    off = [
        f"{g} {count.engine[g] - count.tinker[g]:+,}"
        for g in LAYER_GROUPS
        if count.engine[g] != count.tinker[g]
    ]
    return "= Tinker" if not off else "vs Tinker: " + ", ".join(off)


def _name_width(counts: list[ModelCount]) -> int:
    return max(17, *(len(c.name) + 2 for c in counts))


def slot_table(counts: list[ModelCount]) -> str:
    """One slot on one device, every group: the bench's historical table, Tinker beside it."""
    width = _name_width(counts)
    header = f"{'model':<{width}}{'per rank: mlp':>15}{'all groups':>13}"
    for rank in RANKS:
        header += f"{f'r={rank}: params':>16}{'bytes/slot':>17}{'GiB':>7}"
    lines = [header + "  count", "-" * (len(header) + 24)]
    for c in counts:
        line = f"{c.name:<{width}}{c.per_rank['mlp']:>15,}{c.total:>13,}"
        for rank in RANKS:
            params = c.total * rank
            line += f"{params:>16,}{slot_bytes(params):>17,}{slot_bytes(params) / GiB:>7.2f}"
        lines.append(f"{line}  {_against_tinker(c)}")
    lines.append(
        "slot = adapter on every group (attn, mlp, unembed); bytes = params · 4 fp32 buffers "
        "(weights, grads, Adam m, v) · 4 B"
    )
    return "\n".join(lines)


def group_table(counts: list[ModelCount]) -> str:
    """Bytes a slot per layer group: on one device and on each rank under expert parallelism."""
    width = _name_width(counts)
    devices = counts[0].devices
    header = f"{'model':<{width}}{'group':<8}{'params/rank':>13}{f'EP/{devices}: /rank':>15}"
    for rank in RANKS:
        header += f"{f'r={rank} bytes/slot':>18}{f'EP r={rank} /rank':>17}"
    lines = [header, "-" * len(header)]
    for c in counts:
        rows = [(g, c.per_rank[g], c.ep_per_rank[g]) for g in LAYER_GROUPS]
        for group, whole, ep in [*rows, ("all", c.total, c.ep_total)]:
            mark = "*" if c.from_tinker else ""
            line = f"{c.name:<{width}}{group + mark:<8}{whole:>13,}{ep:>15,}"
            for rank in RANKS:
                line += f"{slot_bytes(whole * rank):>18,}{slot_bytes(ep * rank):>17,}"
            lines.append(line)
    lines.append(
        f"EP/{devices}: expert parallelism over {devices} devices, the per-expert factors split "
        "over the ranks, every other factor whole on each rank"
    )
    return "\n".join(lines)


def plan_table(counts: list[ModelCount], base_bytes: float, reserve_gb: float) -> str:
    """Slots that fit on `devices` devices of each size, per EP rank (each rank holds every slot's
    share, so the group's slots are one rank's)."""
    width = _name_width(counts)
    devices = counts[0].devices
    header = f"{'model':<{width}}{'base B':>8}{'base/dev GB':>12}"
    for size in DEVICE_GB:
        header += f"{f'{devices}x{size}GB: free/dev':>20}{'r=8':>6}{'r=32':>6}{'worker r=32':>12}"
    lines = [header, "-" * len(header)]
    for c in counts:
        base = c.base_per_device * base_bytes
        line = f"{c.name + ('*' if c.from_tinker else ''):<{width}}"
        line += f"{c.base_params / 1e9:>8.1f}{base / GB:>12.1f}"
        for size in DEVICE_GB:
            free = size * GB - reserve_gb * GB - base
            fits = [
                slots_that_fit(size * GB, reserve_gb * GB, base, slot_bytes(c.ep_total * r))
                for r in RANKS
            ]
            # the worker's own choice: 5 fp32 copies a slot, half its free memory for passes
            # (it keeps 1 slot where none fits: shown as none)
            plan = plan_slots(int(max(0, size * GB - base)), c.ep_total * RANKS[-1])
            worker = plan.max_slots if plan.slot_bytes <= plan.free_bytes * PASS_SHARE else 0
            line += f"{free / GB:>20.1f}{fits[0]:>6}{fits[1]:>6}"
            line += f"{worker:>12}"
        lines.append(line)
    lines.append(
        "base: every parameter of the meta model (no multi-token-prediction layer) at "
        f"{base_bytes:g} B, routed experts split over {devices} devices, the rest whole on each; "
        f"free = device - {reserve_gb:g} GB reserve (activations) - base; "
        "slots = free // the slot's bytes a rank (16 B a parameter); "
        "worker = what workers.engine.memory.plan_slots picks (5 fp32 copies, half the memory "
        "left after the base kept for passes; 0 where not one slot fits that rule); a negative "
        "free: the base does not fit, no slot"
    )
    for c in counts:
        if not c.from_tinker:
            continue
        tinker = ", ".join(f"{g} {c.per_rank[g]:,}" for g in LAYER_GROUPS)
        engine = ", ".join(f"{g} {c.engine[g]:,}" for g in LAYER_GROUPS)
        lines.append(
            f"* {c.name}: THE ENGINE CANNOT ADAPT ITS EXPERTS YET ({len(c.unwrappable)} blocks not"
            f" the fused layout, e.g. {c.unwrappable[0]}): this plan uses TINKER'S COUNT per"
            f" rank ({tinker}), its per-expert factors taken as E x moe_intermediate_size a"
            f" projection, and its experts split as the engine would split fused ones; the"
            f" engine's own count today: {engine}"
        )
    return "\n".join(lines)


def _printed_name(model: str) -> str:
    """A model id's last part, or a config file's (or its directory's) name."""
    path = Path(model)
    return (path.parent if path.name == "config.json" else path).name.removesuffix(".json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "models", nargs="*", help="lineup model ids or config files (default: the seven above)"
    )
    parser.add_argument("--devices", type=int, default=DEVICES, help="expert-parallel ranks")
    parser.add_argument("--base-bytes", type=float, default=BASE_BYTES, help="a base parameter")
    parser.add_argument("--reserve-gb", type=float, default=RESERVE_GB, help="a device")
    args = parser.parse_args(argv)
    # config warnings about the fields the lineup files leave to the defaults
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    known = {model_id: name for name, model_id in MODELS.items()}
    names = {known.get(m, _printed_name(m)): m for m in args.models} or MODELS
    counts = [count_model(name, model_id, args.devices) for name, model_id in names.items()]
    print(slot_table(counts), group_table(counts), sep="\n\n")
    print("\n" + plan_table(counts, args.base_bytes, args.reserve_gb))


# -- config.json readers of bench/sharded_memory.py (its planned Qwen3-235B-A22B and
# Qwen3.5-397B-A17B figures import them from here; this bench counts with the engine above) --


def load(path: Path) -> tuple[str, dict[str, Any]]:
    """(name, config) of a `config.json` or of the directory that holds one."""
    file = path / "config.json" if path.is_dir() else path
    return file.parent.name, json.loads(file.read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: `text_config` of a multimodal checkpoint, else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _layer_types(text: dict[str, Any]) -> list[str]:
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None and "full_attention_interval" in text:
        interval = int(text["full_attention_interval"])
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    types = types or ["full_attention"] * layers
    if len(types) != layers:
        raise ValueError(f"{len(types)} layer_types for {layers} layers")
    return [str(kind) for kind in types]


def _attention_per_rank(text: dict[str, Any], kind: str) -> int:
    """Σ (in + out) over one layer's attention projections."""
    hidden = int(text["hidden_size"])
    if kind == "linear_attention":  # Qwen3.5's gated DeltaNet
        key_dim = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
        value_heads = int(text["linear_num_value_heads"])
        value_dim = value_heads * int(text["linear_value_head_dim"])
        qkv, z, b, a = 2 * key_dim + value_dim, value_dim, value_heads, value_heads
        return sum(hidden + out for out in (qkv, z, b, a)) + (value_dim + hidden)
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_dim = int(text.get("num_key_value_heads") or heads) * head_dim
    # Qwen3.5's gated attention: q_proj also emits the output gate, doubling its rows.
    q_out = heads * head_dim * (2 if text.get("attn_output_gate") else 1)
    return (hidden + q_out) + 2 * (hidden + kv_dim) + (heads * head_dim + hidden)


def _is_moe_layer(text: dict[str, Any], layer: int) -> bool:
    # Qwen3-MoE's rule; configs without these fields (gpt-oss, Qwen3.5) are sparse everywhere.
    step = int(text.get("decoder_sparse_step") or 1)
    return layer not in (text.get("mlp_only_layers") or []) and (layer + 1) % step == 0


if __name__ == "__main__":
    main()
