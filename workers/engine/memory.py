"""How many adapter slots a device holds: planned from its free memory, not hoped for.

Job: given the free memory of the device once the base model is loaded and the bytes one slot
costs, choose `max_slots`, and say in words how it was chosen (the worker logs it). A slot costs
five fp32 copies of its row of the bank: the weights, their gradients, AdamW's two moments and
the copy of the pending gradients a pass keeps for its transaction. Half the free memory is
left for the activations of passes (and a sampler's KV cache); the rest holds slots, at least
one and at most `cap`.

A Qwen3-30B-A3B rank-32 adapter is 494 M parameters on every layer group (`bench/moe_memory.py`),
9.9 GB a slot: on a 141 GB device with a 61 GB bf16 base model that is 4 slots, where a dense
Qwen3-8B's rank-32 adapter (about 92 M parameters, 1.8 GB a slot, beside a 16 GB base) fits
33.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SLOT_BUFFERS = 5  # weights, grads, exp_avg, exp_avg_sq, the pass's pending copy
BYTES_PER_VALUE = 4  # fp32
PASS_SHARE = 0.5  # of the free memory, kept for passes
MAX_SLOTS_CAP = 64


@dataclass(frozen=True)
class SlotPlan:
    """The chosen slot count and why."""

    max_slots: int
    free_bytes: int
    slot_bytes: int

    def describe(self) -> str:
        return (
            f"max_slots={self.max_slots}: {self.free_bytes / 2**30:.1f} GiB free after the base"
            f" model, {self.slot_bytes / 2**20:.1f} MiB a slot ({SLOT_BUFFERS} fp32 copies:"
            f" weights, gradients, two AdamW moments, a pending copy), {PASS_SHARE:.0%} of the"
            f" free memory kept for passes, at most {MAX_SLOTS_CAP}"
        )


def slot_bytes(slot_numel: int) -> int:
    """What one slot costs on the device."""
    return SLOT_BUFFERS * BYTES_PER_VALUE * slot_numel


def plan_slots(free_bytes: int, slot_numel: int, *, cap: int = MAX_SLOTS_CAP) -> SlotPlan:
    """The slots that fit in the share of `free_bytes` not kept for passes (1 at least)."""
    per_slot = slot_bytes(slot_numel)
    fits = int(free_bytes * (1 - PASS_SHARE)) // max(1, per_slot)
    return SlotPlan(max(1, min(cap, fits)), free_bytes, per_slot)


def free_memory(device: torch.device) -> int:
    """Free bytes on `device`: the CUDA allocator's view of the GPU, else available host memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
