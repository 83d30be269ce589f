"""Checkpoint files of one adapter, in PEFT's on-disk layout (docs/architecture.md, "State").

Job: write and read a checkpoint directory. Both kinds hold `adapter_config.json` and
`adapter_model.safetensors`; a `weights` checkpoint adds `optimizer.safetensors` (AdamW moments)
and `meta.json` (the caller's metadata, the LoRA spec, alpha, the optimizer step count), and check
a checkpoint's tensors against the model's adaptable layers before anything is loaded. Slots
and buffers are the engine's.

Invariants:
- In memory (`AdapterCheckpoint.tensors`) a linear's factors are PEFT's
  `base_model.model.<module path>.lora_A.weight` [rank, in] and `….lora_B.weight` [out, rank],
  and a fused experts block's are Tinker's shared-outer tensors (`<experts>.w1|w3|w2`, see
  `workers.trainer.expert_files`), at the true rank, fp32, only for the layers the adapter trains.
- On disk the adapter file is in a `AdapterLayout`: "peft" (what the trainer writes) is loaded as is
  by `peft.PeftModel.from_pretrained(base, directory)`, experts included (PEFT's
  `target_parameters`); reading takes any layout back to the in-memory form, exactly.
- Moments are stored in the in-memory form (for a linear, the adapter key), plus `.exp_avg` /
  `.exp_avg_sq`: compact, and with the fp32 values they round-trip bit-exactly.
- Each file is written under a temporary name and renamed into place: a reader never sees a
  half-written file.
- A malformed or incompatible checkpoint is a `UserError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import safetensors
import safetensors.torch
import torch

from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.jobs import AdapterLayout
from protocol.paths import ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE
from workers.engine.lora import LayerGroup, LayerLayout
from workers.engine.moe_lora import ExpertShape
from workers.engine.sliced_lora import SlicedLinear, part_path
from workers.trainer import bank_files, sliced_files
from workers.trainer.expert_files import (
    PER_EXPERT_NAMES,
    AdapterScales,
    Matrix,
    adapter_key,
    expert_paths,
    from_file,
    peft_config_fields,
    to_file,
)

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "Matrix", "adapter_key"]

META = "meta.json"

MOMENTS = ("exp_avg", "exp_avg_sq")
_KEY_PATTERN = re.compile(r"base_model\.model\.(?P<path>.+)\.lora_(?P<matrix>[AB])\.weight")


def parse_adapter_key(key: str) -> tuple[str, Matrix]:
    """(module path, "A" | "B") of a PEFT adapter tensor name."""
    match = _KEY_PATTERN.fullmatch(key)
    if match is None:
        raise UserError(f"{ADAPTER_WEIGHTS}: unexpected tensor {key!r}, not a LoRA A/B matrix")
    matrix: Matrix = "A" if match["matrix"] == "A" else "B"
    return match["path"], matrix


def tensor_shapes(layout: LayerLayout, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a layer's A and B in `AdapterCheckpoint.tensors`, at the true rank.

    A linear's are PEFT's `[r, in]` and `[out, r]`. A fused MoE block's expert projections are
    Tinker's own 3-D tensors (`mlp.experts.w1` …): A `[E or 1, r, in]` and B `[E or 1, out, r]`,
    1 for the factor the experts share.
    """
    if not (layout.a_experts or layout.b_experts):
        return (rank, layout.in_features), (layout.out_features, rank)
    return (
        (max(1, layout.a_experts), rank, layout.in_features),
        (max(1, layout.b_experts), layout.out_features, rank),
    )


def target_modules_for(trained: Iterable[str], all_linears: Iterable[str]) -> list[str] | str:
    """PEFT `target_modules` selecting exactly the trained module paths.

    Leaf names (["q_proj", …], what vLLM and most tools expect) when no other linear of the
    model shares a leaf name with a trained one; else a regex matching the full paths.
    """
    trained_paths = sorted(set(trained))
    leaves = {path.rpartition(".")[2] for path in trained_paths}
    selected = {path for path in all_linears if path.rpartition(".")[2] in leaves}
    if selected == set(trained_paths):
        return sorted(leaves)
    return "|".join(re.escape(path) for path in trained_paths)


# the leaves PEFT on transformers 5 reads in `target_modules` as the names fused experts had
# before fusion (and moves onto the fused parameters)
_EXPERT_LEAVES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate"})


def by_weight_paths(linears: Iterable[str], model: ModelTargets) -> list[str]:
    """The trained linears a "peft" file names by their weight (`<path>.weight` in
    `target_parameters`) rather than in `target_modules`: beside fused experts, PEFT (on
    transformers 5) takes the leaves `gate_proj`, `up_proj` and `down_proj` of `target_modules`
    for the experts' names before fusion and moves them onto the fused parameters, so a dense
    layer's MLP or a shared expert of those names would be left out. PEFT's parameter wrapper
    adds the same `alpha/r · B·A` to the weight, and its tensors have a module's keys."""
    if not model.experts:
        return []
    return [path for path in linears if path.rpartition(".")[2] in _EXPERT_LEAVES]


@dataclass(frozen=True)
class ModelTargets:
    """What a checkpoint file's layout needs to know of the base model."""

    linear_paths: Sequence[str] = ()  # every nn.Linear, so `target_modules` selects exactly
    experts: Mapping[str, ExpertShape] = field(default_factory=dict)  # fused experts blocks
    # linears adapted per output slice, by path (`workers.trainer.sliced_files`)
    sliced: Mapping[str, SlicedLinear] = field(default_factory=dict)
    # shared-expert banks and one-A GLUs, by path (`workers.trainer.bank_files`)
    banks: bank_files.Banks = field(default_factory=dict)
    glus: bank_files.Glus = field(default_factory=dict)


def file_tensors(
    tensors: Mapping[str, torch.Tensor], model: ModelTargets, layout: AdapterLayout
) -> dict[str, torch.Tensor]:
    """An adapter's tensors (the trainer's form) as a file in `layout` holds them."""
    tensors = to_file(tensors, model.experts, layout)
    tensors = sliced_files.to_file(tensors, model.sliced, layout)
    return bank_files.to_file(tensors, model.banks, model.glus, layout)


def trainer_tensors(
    tensors: Mapping[str, torch.Tensor], model: ModelTargets, scales: AdapterScales
) -> dict[str, torch.Tensor]:
    """A file's tensors, in any layout, in the trainer's form; a `UserError` naming the first
    tensor that is not representable."""
    tensors = from_file(tensors, model.experts, scales)
    tensors = sliced_files.from_file(tensors, model.sliced, scales)
    return bank_files.from_file(tensors, model.banks, model.glus, scales)


@dataclass
class AdapterCheckpoint:
    """One adapter as stored: tensors by key (module docstring), plus what is needed to train
    it on."""

    base_model: str
    rank: int
    lora_alpha: float
    tensors: dict[str, torch.Tensor]  # adapter_key → fp32 CPU tensor
    spec: LoraConfig | None = None  # None for an adapter-only checkpoint
    moments: dict[str, torch.Tensor] | None = None  # adapter_key + ".exp_avg" / ".exp_avg_sq"
    step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def write_checkpoint(
    directory: Path,
    checkpoint: AdapterCheckpoint,
    *,
    kind: Literal["weights", "sampler_weights"],
    model: ModelTargets,
    layout: AdapterLayout = "peft",
) -> int:
    """Write the checkpoint files for `kind`, the adapter in `layout`; the bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = _write_bytes(
        directory / ADAPTER_CONFIG, _json_bytes(adapter_config(checkpoint, model, layout))
    )
    written += _write_tensors(
        directory / ADAPTER_WEIGHTS, file_tensors(checkpoint.tensors, model, layout)
    )
    if kind == "weights":
        if checkpoint.moments is None or checkpoint.spec is None:
            raise ValueError("a weights checkpoint needs the optimizer moments and the LoRA spec")
        written += _write_tensors(directory / OPTIMIZER_STATE, checkpoint.moments)
        meta = {
            **checkpoint.meta,
            "base_model": checkpoint.base_model,
            "lora": msgspec.structs.asdict(checkpoint.spec),
            "lora_alpha": checkpoint.lora_alpha,
            "step": checkpoint.step,
        }
        written += _write_bytes(directory / META, _json_bytes(meta))
    return written


def adapter_config(
    checkpoint: AdapterCheckpoint, model: ModelTargets, layout: AdapterLayout
) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for the checkpoint's adapter file in `layout`."""
    blocks = expert_paths(checkpoint.tensors, model.experts)
    own = {
        f"{block}.{projection}"
        for block in blocks
        for projection in model.experts[block].projections
    }
    # non-gated experts are written in the trainer's form outside the "peft" layout
    plain = sorted(
        f"{block}.{projection}"
        for block in blocks
        if not model.experts[block].gated
        for projection in model.experts[block].projections
    )
    gated = [block for block in blocks if model.experts[block].gated]
    trained = {
        key[len("base_model.model.") :].rpartition(".lora_")[0]
        for key in checkpoint.tensors
        if ".lora_" in key
    }
    linears = sorted(trained - own)
    # where each slice's pair is kept, and the linear it is a slice of
    parts = {part_path(path, piece): path for path, s in model.sliced.items() for piece in s.slices}
    if layout == "peft":  # the slices of a linear are one block LoRA on it
        linears = sorted({parts.get(path, path) for path in linears})
    if layout == "tinker":
        experts = sorted(own)
    elif layout == "per-expert":
        experts = [
            f"{block}.{e}.{name}"
            for block in gated
            for e in range(model.experts[block].num_experts)
            for name in PER_EXPERT_NAMES.values()
        ] + plain
    else:
        experts = []
    bank_parameters: list[str] = []
    if layout == "peft":
        linears, bank_parameters = bank_files.peft_targets(linears, model.banks, model.glus)
    by_weight = by_weight_paths(linears, model) if layout == "peft" else []
    linears = [path for path in linears if path not in by_weight]
    # the slices kept beside their linear are modules of their own name outside the "peft" layout
    known = [*model.linear_paths, *experts, *(parts if layout != "peft" else [])]
    known = [path for path in known if path not in by_weight]
    targets = target_modules_for([*linears, *experts], known)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": checkpoint.base_model,
        "r": checkpoint.rank,
        "lora_alpha": checkpoint.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    if layout == "peft":
        plain_blocks = [block for block in blocks if not model.experts[block].gated]
        config.update(
            peft_config_fields(gated, checkpoint.rank, checkpoint.lora_alpha, plain_blocks)
        )
        parameters = [
            *config.get("target_parameters", []),
            *bank_parameters,
            *(f"{path}.weight" for path in by_weight),
        ]
        if parameters:
            config["target_parameters"] = parameters
        fields = sliced_files.peft_config_fields(
            linears, model.sliced, checkpoint.rank, checkpoint.lora_alpha
        )
        for name, entries in fields.items():
            config[name] = {**config.get(name, {}), **entries}
    return config


def read_checkpoint(
    directory: Path,
    *,
    with_optimizer: bool,
    model: ModelTargets | None = None,
) -> AdapterCheckpoint:
    """Read a checkpoint directory, the adapter in any `AdapterLayout` (the layouts of fused
    experts, sliced linears and banks only where `model` has them); `with_optimizer` also reads
    the moments and step count."""
    config = _read_json(directory / ADAPTER_CONFIG)
    scales = adapter_scales(config)
    stored = _read_tensors(directory / ADAPTER_WEIGHTS)
    tensors = trainer_tensors(
        {key: value.to(torch.float32) for key, value in stored.items()},
        model or ModelTargets(),
        scales,
    )
    checkpoint = AdapterCheckpoint(
        base_model=str(config.get("base_model_name_or_path") or ""),
        rank=scales.rank,
        lora_alpha=scales.lora_alpha,
        tensors=tensors,
    )
    meta_path = directory / META
    if meta_path.exists():
        meta = _read_json(meta_path)
        try:
            checkpoint.spec = msgspec.convert(meta["lora"], LoraConfig)
            checkpoint.step = int(meta["step"])
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as error:
            raise UserError(f"{META}: missing or invalid lora / step ({error})") from None
        checkpoint.meta = meta
    if with_optimizer:
        if checkpoint.spec is None:
            raise UserError(
                f"{directory.name}: no optimizer state ({META} missing); load without it"
            )
        checkpoint.moments = _read_tensors(directory / OPTIMIZER_STATE)
        expected = {f"{key}.{moment}" for key in tensors for moment in MOMENTS}
        if set(checkpoint.moments) != expected or any(
            value.dtype != torch.float32 for value in checkpoint.moments.values()
        ):
            raise UserError(f"{OPTIMIZER_STATE}: moments do not match the adapter's fp32 tensors")
    return checkpoint


def adapter_scales(config: Mapping[str, Any]) -> AdapterScales:
    """The adapter's rank, alpha and per-module patterns; a `UserError` for what is unsupported."""
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}, expected LORA")
    for flag in ("use_dora", "use_rslora"):
        if config.get(flag):
            raise UserError(f"{ADAPTER_CONFIG}: {flag} adapters are not supported")
    try:
        rank = int(config["r"])
        lora_alpha = float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"{ADAPTER_CONFIG}: missing or invalid r / lora_alpha ({error})") from None
    return AdapterScales(config, rank, lora_alpha)


def match_layers(
    checkpoint: AdapterCheckpoint, layouts: Iterable[LayerLayout], *, max_rank: int
) -> set[LayerGroup]:
    """The layer groups a checkpoint covers; a `UserError` unless every matrix fits the model.

    Each stored matrix must belong to an adaptable layer with the right shape, and a covered
    group must have a complete A/B pair on every one of its layers.
    """
    layers = {layout.path: layout for layout in layouts}
    rank = checkpoint.rank
    if not 1 <= rank <= max_rank:
        raise UserError(f"{ADAPTER_CONFIG}: rank {rank} outside [1, {max_rank}]")
    found: dict[str, set[str]] = {}
    for key, tensor in checkpoint.tensors.items():
        if key.endswith(".base_layer.weight"):
            continue  # PEFT's copy of the base weight beside an adapted lm_head; never loaded
        path, matrix = parse_adapter_key(key)
        layout = layers.get(path)
        if layout is None:
            raise UserError(f"{ADAPTER_WEIGHTS}: {path!r} is not an adaptable layer of this model")
        a_shape, b_shape = tensor_shapes(layout, rank)
        shape = a_shape if matrix == "A" else b_shape
        if tuple(tensor.shape) != shape:
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {key} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        found.setdefault(path, set()).add(matrix)
    groups = {layers[path].group for path in found}
    if not groups:
        raise UserError(f"{ADAPTER_WEIGHTS}: holds no LoRA matrices")
    for layout in layers.values():
        if layout.group in groups and found.get(layout.path) != {"A", "B"}:
            raise UserError(f"{ADAPTER_WEIGHTS}: no complete A/B pair for {layout.path}")
    return groups


def _json_bytes(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _write_bytes(path: Path, data: bytes) -> int:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return len(data)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    temporary = path.with_name(path.name + ".tmp")
    safetensors.torch.save_file(tensors, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, path)
    return path.stat().st_size


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path.name}: not found in checkpoint {path.parent}") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{path.name}: unreadable ({error})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path.name}: expected a JSON object")
    return value


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise UserError(f"{path.name}: not found in checkpoint {path.parent}")
    try:
        return safetensors.torch.load_file(str(path))
    except (OSError, safetensors.SafetensorError) as error:
        raise UserError(f"{path.name}: unreadable ({error})") from None
