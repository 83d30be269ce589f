"""State snapshots: a model's whole adapter state on disk, so another worker can carry on.

A snapshot holds what a slot holds (weights, both Adam moments, pending gradients, step count,
scales, LoRA config; see `parking.SlotState`) and where in the model's op log it stands: the
last applied `seq_id` and that op's stream sequence in `TW_OPS`. It is taken after an
`optim_step` every `snapshot_every` steps, after every `save_state`, and once a model that
changed since its snapshot has been idle for `snapshot_idle_s` (the ops log, which keeps what
its limits allow, then need not reach back far for it).

Layout: `<checkpoint root>/<run_id>/.state/state-<seq>.safetensors` (one tensor per stored
buffer row) and `state-<seq>.json` (everything else). Files are written under temporary names
and renamed; then the `SnapshotRecord` in KV moves to them (the commit point); then older files
go. A reader trusts only the record, so a crash at any point leaves the previous snapshot whole.
The directory starts with '.', which no checkpoint kind or name does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import safetensors.torch

from protocol.api import LoraConfig
from protocol.errors import ServerError
from workers.engine.lora import LAYER_GROUPS, LayerGroup
from workers.trainer.parking import HostRow, SlotState

STATE_DIR = ".state"


def state_dir(root: Path, run_id: str) -> Path:
    return root / run_id / STATE_DIR


def write_state(directory: Path, seq_id: int, state: SlotState, meta: dict[str, Any]) -> Path:
    """Write one snapshot's files; returns the JSON file's path (the snapshot's name)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"state-{seq_id}"
    tensors = {name: row.values.contiguous() for name, row in state.rows.items()}
    body = {
        **meta,
        "spec": msgspec.structs.asdict(state.spec),
        "lora_alpha": state.lora_alpha,
        "step": state.step,
        "scales": state.scales,
        "whole_rows": {name: row.whole_row for name, row in state.rows.items()},
    }
    weights = directory / f"{stem}.safetensors"
    temporary = weights.with_name(weights.name + ".tmp")
    safetensors.torch.save_file(tensors, str(temporary))
    os.replace(temporary, weights)
    described = directory / f"{stem}.json"
    temporary = described.with_name(described.name + ".tmp")
    temporary.write_text(json.dumps(body))
    os.replace(temporary, described)
    return described


def read_state(described: Path) -> SlotState:
    """A snapshot as a slot state, ready to be adopted; a missing or broken file is our fault."""
    try:
        body = json.loads(described.read_text())
        tensors = safetensors.torch.load_file(str(described.with_suffix(".safetensors")))
        spec = msgspec.convert(body["spec"], LoraConfig)
        scales: dict[LayerGroup, float] = {
            group: float(body["scales"][group]) for group in LAYER_GROUPS
        }
        rows = {
            name: HostRow(values=tensors[name], whole_row=bool(whole))
            for name, whole in body["whole_rows"].items()
        }
        return SlotState(
            spec=spec,
            lora_alpha=float(body["lora_alpha"]),
            step=int(body["step"]),
            scales=scales,
            rows=rows,
        )
    except (OSError, KeyError, ValueError, msgspec.ValidationError) as err:
        raise ServerError(f"state snapshot {described} is unreadable: {err}") from err


def prune(directory: Path, keep: Path) -> None:
    """Remove the directory's snapshot files older than `keep` (a lower seq). Newer ones, and
    files being written, may be another worker's: the model's next owner after a handover."""
    kept = _seq_of(keep.name)
    for path in directory.glob("state-*"):
        seq = _seq_of(path.name)
        if seq is not None and kept is not None and seq < kept:
            path.unlink(missing_ok=True)


def _seq_of(name: str) -> int | None:
    """The seq in a snapshot file's name (`state-<seq>.json`, `.safetensors`, `.tmp`)."""
    digits = name.removeprefix("state-").split(".", 1)[0]
    return int(digits) if digits.isdigit() else None
