"""How many devices (ranks) one base model may be split over: a MoE model's routed experts
are divided evenly between a worker group's ranks, so the count must divide theirs.

Pure: it reads a checkpoint's parsed `config.json` (the text config of a multimodal one). The
`up` and `worker` command lines check a local model directory with it before anything starts;
a model named by hub id is checked when the engine loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_DEVICES = 64


def routed_experts(config: Mapping[str, Any]) -> int:
    """Routed experts per MoE block (0 for a dense model)."""
    text = config.get("text_config")
    fields = text if isinstance(text, Mapping) else config
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = fields.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def check_devices(config: Mapping[str, Any], devices: int) -> None:
    """A `ValueError` naming the problem unless `devices` ranks can share this model."""
    if not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"--devices {devices}: between 1 and {MAX_DEVICES}")
    experts = routed_experts(config)
    if experts and experts % devices:
        divisors = [n for n in range(1, min(experts, MAX_DEVICES) + 1) if experts % n == 0]
        raise ValueError(
            f"--devices {devices}: the model's {experts} experts per block do not split evenly"
            f" over {devices} devices (choose one of {', '.join(map(str, divisors))})"
        )
