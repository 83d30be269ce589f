"""Sliced linears' LoRA in checkpoint files: one block LoRA per fused linear in PEFT's layouts.

Job: convert the slices of a fused linear (`workers.engine.sliced_lora`: Mamba2's `in_proj` z and
x, Gated DeltaNet's `in_proj_qkv` q, k and v) between the trainer's form and a file, both ways.
Pure tensor code: no file I/O, no model.

In the trainer a linear P of k slices holds one pair per slice, keyed `P.<slice>`:
A `[r, in]`, B `[rows of the slice, r]`. PEFT knows only P, so the "peft" layout writes one
LoRA on P of rank k·r: A is the slices' A stacked `[k·r, in]`, B
`[out, k·r]` block-diagonal (slice i's rows use ranks `[i·r, (i+1)·r)`, every other entry 0, and
rows no slice covers all 0). The config's `rank_pattern`/`alpha_pattern` give P rank k·r and
alpha k·alpha, so its scale is alpha/r like every other layer's, and a PEFT-loaded model computes
exactly what the trainer does. The "tinker" and "per-expert" layouts keep the trainer's form,
which is Tinker's (`in_proj_q`, `in_proj_k`, `in_proj_v`; Mamba2's `gate_proj`, `x_proj`) and
what tinker-cookbook's `build_lora_adapter` writes.

Invariants:
- Both directions only copy values and write zeros, so a checkpoint round-trips bit-exactly.
- Reading takes either form per linear; a block LoRA whose off-block entries are not exactly 0
  is a `UserError` naming its tensor (checked on values only: `meta` tensors pass on shapes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from protocol.errors import UserError
from protocol.paths import ADAPTER_WEIGHTS
from workers.engine.sliced_lora import SlicedLinear, part_path
from workers.trainer.expert_files import AdapterScales, adapter_key

Tensors = dict[str, torch.Tensor]
Sliced = Mapping[str, SlicedLinear]


def to_file(tensors: Mapping[str, torch.Tensor], sliced: Sliced, layout: str) -> Tensors:
    """`tensors` (the trainer's form) with each sliced linear as PEFT's block LoRA in the "peft"
    layout; the others keep the slices as they are; other tensors unchanged."""
    written = dict(tensors)
    if layout != "peft":  # Tinker's form, which tinker-cookbook's per-expert adapter keeps too
        return written
    for path, linear in sliced.items():
        slices = linear.slices
        keys = [
            (adapter_key(part_path(path, s), "A"), adapter_key(part_path(path, s), "B"))
            for s in slices
        ]
        if not all(a in tensors and b in tensors for a, b in keys):
            continue  # not trained
        a_parts = [written.pop(a) for a, _ in keys]
        b_parts = [written.pop(b) for _, b in keys]
        rank = a_parts[0].shape[0]
        block = a_parts[0].new_zeros(linear.out_features, rank * len(slices))
        for i, (piece, b) in enumerate(zip(slices, b_parts, strict=True)):
            block[piece.start : piece.stop, i * rank : (i + 1) * rank] = b
        written[adapter_key(path, "A")] = torch.cat(a_parts)
        written[adapter_key(path, "B")] = block
    return written


def peft_config_fields(
    trained: list[str], sliced: Sliced, rank: int, lora_alpha: float
) -> dict[str, Any]:
    """`rank_pattern`/`alpha_pattern` entries for the sliced linears among `trained` paths."""
    paths = [path for path in trained if path in sliced]
    return {
        "rank_pattern": {path: len(sliced[path].slices) * rank for path in paths},
        "alpha_pattern": {path: len(sliced[path].slices) * lora_alpha for path in paths},
    }


def from_file(
    tensors: Mapping[str, torch.Tensor], sliced: Sliced, scales: AdapterScales
) -> Tensors:
    """A file's tensors with every sliced linear's block LoRA split into its slices; a
    `UserError` naming the first tensor that is not block-diagonal or has the wrong rank."""
    read = dict(tensors)
    for path, linear in sliced.items():
        slices = linear.slices
        key_a, key_b = adapter_key(path, "A"), adapter_key(path, "B")
        if key_a not in read and key_b not in read:
            continue
        if key_a not in read or key_b not in read:
            raise UserError(f"{ADAPTER_WEIGHTS}: no complete A/B pair for {path}")
        a, b = read.pop(key_a), read.pop(key_b)
        k, r = len(slices), scales.rank
        if a.dim() != 2 or a.shape[0] != k * r or tuple(b.shape) != (linear.out_features, k * r):
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {key_a} has shape {tuple(a.shape)} and {key_b}"
                f" {tuple(b.shape)}: {path} is adapted per slice ({', '.join(s.name for s in slices)}),"
                f" as one block LoRA of rank {k}·{r} = {k * r}"
            )
        scales.check(path, key_a, k * r)
        if not b.is_meta:
            mask = torch.ones_like(b, dtype=torch.bool)
            for i, piece in enumerate(slices):
                mask[piece.start : piece.stop, i * r : (i + 1) * r] = False
            if bool(b[mask].any()):
                raise UserError(
                    f"{ADAPTER_WEIGHTS}: {key_b} is not block-diagonal: the rows of {path}'s"
                    f" slice i use ranks [i·{r}, (i+1)·{r}) only, every other entry exactly 0"
                )
        for piece in slices:
            if adapter_key(part_path(path, piece), "A") in read:
                raise UserError(
                    f"{ADAPTER_WEIGHTS}: {part_path(path, piece)} is given twice (as a slice and in"
                    f" {key_a})"
                )
        for i, piece in enumerate(slices):
            read[adapter_key(part_path(path, piece), "A")] = a[i * r : (i + 1) * r].clone()
            read[adapter_key(part_path(path, piece), "B")] = b[
                piece.start : piece.stop, i * r : (i + 1) * r
            ].clone()
    return read
