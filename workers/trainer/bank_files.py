"""Shared-expert banks' and one-A GLUs' LoRA in checkpoint files (Inkling), in PEFT's layout.

Job: convert the two pairs `workers.engine.shared_bank` lays out over several frozen tensors
between the trainer's form and a "peft" file, both ways. Pure tensor code: no file I/O, no model.

In the trainer (and in the "tinker" and "per-expert" layouts, Tinker's form):

- a GLU P whose gate and up share one A holds one pair `P.gate_up_proj`: A `[r, H]`, B
  `[2·I, r]`, the gate's rows first. PEFT knows only the two linears, so the "peft" layout writes
  `P.gate_proj` (A, the gate's rows of B) and `P.up_proj` (the same A, the up's rows);
- a shared-expert bank S of n experts (`gate_proj`/`up_proj [n, I, H]`, `down_proj [n, H, I]`)
  holds one pair per parameter, the n experts side by side: gate and up A `[r, H]`, B
  `[n·I, r]`; down A `[r, n·I]`, B `[H, r]`. The "peft" layout writes PEFT's `target_parameters`
  wrappers on the three parameters, nested in that order (gate innermost:
  `S.base_layer.base_layer.lora_*`, up `S.base_layer.lora_*`, down `S.lora_*`). Each wrapper
  of rank r has A `[r·n, in]` (row e·r + k) and B `[out, r·n]` (column k·n + e), as for fused
  experts (`workers.trainer.expert_files`): the shared factor repeated per expert.

Invariants:
- Both directions only copy values, so a checkpoint round-trips bit-exactly.
- Reading takes either form; a "peft" file whose shared factor differs between experts (or
  whose gate and up A differ) is a `UserError` naming its tensor. `meta` tensors pass on shapes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from protocol.errors import UserError
from protocol.paths import ADAPTER_WEIGHTS
from workers.trainer.expert_files import AdapterScales, adapter_key, check_equal

Tensors = dict[str, torch.Tensor]
Banks = Mapping[str, tuple[int, int, int]]  # bank path → (experts n, intermediate I, hidden H)
Glus = Mapping[str, int]  # MLP path → the gate's rows I
GATE_UP = "gate_up_proj"  # the pair of a one-A GLU, in the trainer's form
BANK_NESTING = {"gate_proj": ".base_layer.base_layer", "up_proj": ".base_layer", "down_proj": ""}


def trained_banks(tensors: Mapping[str, torch.Tensor], banks: Banks) -> list[str]:
    """The banks `tensors` (the trainer's form) holds pairs of, in model order."""
    return [path for path in banks if adapter_key(f"{path}.gate_proj", "A") in tensors]


def trained_glus(tensors: Mapping[str, torch.Tensor], glus: Glus) -> list[str]:
    """The one-A GLUs `tensors` (the trainer's form) holds the pair of, in model order."""
    return [path for path in glus if adapter_key(f"{path}.{GATE_UP}", "A") in tensors]


def to_file(tensors: Mapping[str, torch.Tensor], banks: Banks, glus: Glus, layout: str) -> Tensors:
    """`tensors` (the trainer's form) in `layout`; other tensors unchanged."""
    written = dict(tensors)
    if layout != "peft":
        return written
    for path in trained_glus(tensors, glus):
        a = written.pop(adapter_key(f"{path}.{GATE_UP}", "A"))
        b = written.pop(adapter_key(f"{path}.{GATE_UP}", "B"))
        rows = glus[path]
        written[adapter_key(f"{path}.gate_proj", "A")] = a.clone()
        written[adapter_key(f"{path}.gate_proj", "B")] = b[:rows].clone()
        written[adapter_key(f"{path}.up_proj", "A")] = a.clone()
        written[adapter_key(f"{path}.up_proj", "B")] = b[rows:].clone()
    for path in trained_banks(tensors, banks):
        n, inter, hidden = banks[path]
        for name, nesting in BANK_NESTING.items():
            a = written.pop(adapter_key(f"{path}.{name}", "A"))
            b = written.pop(adapter_key(f"{path}.{name}", "B"))
            rank = a.shape[0]
            if name == "down_proj":  # A [r, n·I] per expert, B [H, r] shared
                file_a = a.view(rank, n, inter).permute(1, 0, 2).reshape(n * rank, inter)
                file_b = b.unsqueeze(-1).expand(-1, -1, n).reshape(hidden, rank * n)
            else:  # A [r, H] shared, B [n·I, r] per expert
                file_a = a.expand(n, -1, -1).reshape(n * rank, hidden)
                file_b = b.view(n, inter, rank).permute(1, 2, 0).reshape(inter, rank * n)
            written[adapter_key(path + nesting, "A")] = file_a.clone()
            written[adapter_key(path + nesting, "B")] = file_b.clone()
    return written


def peft_targets(trained: list[str], banks: Banks, glus: Glus) -> tuple[list[str], list[str]]:
    """(`target_modules` paths, `target_parameters`) a "peft" file gives for the trained linear
    paths `trained` (the trainer's form): a one-A GLU's pair as its two linears, a bank's pairs
    as its parameters; other paths unchanged."""
    modules: list[str] = []
    parameters: list[str] = []
    bank_pairs = {f"{bank}.{name}" for bank in banks for name in BANK_NESTING}
    for path in trained:
        parent, _, leaf = path.rpartition(".")
        if leaf == GATE_UP and parent in glus:
            modules += [f"{parent}.gate_proj", f"{parent}.up_proj"]
        elif path in bank_pairs:
            parameters.append(path)
        else:
            modules.append(path)
    order = {name: i for i, name in enumerate(BANK_NESTING)}  # PEFT nests in this order
    parameters.sort(key=lambda p: (p.rpartition(".")[0], order[p.rpartition(".")[2]]))
    return modules, parameters


def from_file(
    tensors: Mapping[str, torch.Tensor], banks: Banks, glus: Glus, scales: AdapterScales
) -> Tensors:
    """A file's tensors with every bank and one-A GLU in the trainer's form; a `UserError`
    naming the first tensor that is not representable."""
    read = dict(tensors)
    r = scales.rank
    for path, rows in glus.items():
        keys = {
            (name, m): adapter_key(f"{path}.{name}", m)
            for name in ("gate_proj", "up_proj")
            for m in ("A", "B")
        }
        present = [key for key in keys.values() if key in read]
        if not present:
            continue
        if len(present) != len(keys):
            missing = next(key for key in keys.values() if key not in read)
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {missing} is missing: {path}'s gate and up are adapted"
                " together, with one A"
            )
        if adapter_key(f"{path}.{GATE_UP}", "A") in read:
            raise UserError(
                f"{ADAPTER_WEIGHTS}: {path}.{GATE_UP} is given twice (and as gate_proj/up_proj)"
            )
        gate_a, gate_b = read.pop(keys["gate_proj", "A"]), read.pop(keys["gate_proj", "B"])
        up_a, up_b = read.pop(keys["up_proj", "A"]), read.pop(keys["up_proj", "B"])
        for key, tensor, want in (
            (keys["gate_proj", "A"], gate_a, (r, up_a.shape[-1])),
            (keys["up_proj", "A"], up_a, (r, gate_a.shape[-1])),
            (keys["gate_proj", "B"], gate_b, (rows, r)),
        ):
            if tuple(tensor.shape) != want:
                raise UserError(
                    f"{ADAPTER_WEIGHTS}: {key} has shape {tuple(tensor.shape)}, expected {want}"
                )
        scales.check(f"{path}.gate_proj", keys["gate_proj", "A"], r)
        scales.check(f"{path}.up_proj", keys["up_proj", "A"], r)
        check_equal(torch.stack([gate_a, up_a]), [keys["gate_proj", "A"], keys["up_proj", "A"]], 0)
        read[adapter_key(f"{path}.{GATE_UP}", "A")] = gate_a.clone()
        read[adapter_key(f"{path}.{GATE_UP}", "B")] = torch.cat([gate_b, up_b])
    for path, (n, inter, hidden) in banks.items():
        for name, nesting in BANK_NESTING.items():
            key_a, key_b = adapter_key(path + nesting, "A"), adapter_key(path + nesting, "B")
            if key_a not in read and key_b not in read:
                continue
            if key_a not in read or key_b not in read:
                raise UserError(f"{ADAPTER_WEIGHTS}: no complete A/B pair for {path}.{name}")
            if adapter_key(f"{path}.{name}", "A") in read:
                raise UserError(f"{ADAPTER_WEIGHTS}: {path}.{name} is given twice")
            a, b = read.pop(key_a), read.pop(key_b)
            in_f, out_f = (inter, hidden) if name == "down_proj" else (hidden, inter)
            for key, tensor, want in ((key_a, a, (n * r, in_f)), (key_b, b, (out_f, r * n))):
                if tuple(tensor.shape) != want:
                    raise UserError(
                        f"{ADAPTER_WEIGHTS}: {key} has shape {tuple(tensor.shape)}, expected"
                        f" {want} ({path}.{name}: {n} experts at rank {r})"
                    )
            scales.check(f"{path}.{name}", key_a, r)
            if name == "down_proj":
                check_equal(b.view(hidden, r, n).movedim(-1, 0), key_b, 0)
                pair_a = a.view(n, r, inter).permute(1, 0, 2).reshape(r, n * inter)
                pair_b = b.view(hidden, r, n)[..., 0]
            else:
                check_equal(a.view(n, r, hidden), key_a, 0)
                pair_a = a.view(n, r, hidden)[0]
                pair_b = b.view(inter, r, n).permute(2, 0, 1).reshape(n * inter, r)
            read[adapter_key(f"{path}.{name}", "A")] = pair_a.clone()
            read[adapter_key(f"{path}.{name}", "B")] = pair_b.clone()
    return read
