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
from typing import Any

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


# -- tokens: the longest datum a worker trains and the longest sequence it samples ------------

# the values a token keeps in a pass whose layers are recomputed (`workers.engine.recompute`),
# per unit of the sizes below: each layer's input and attention output (2·h a layer), and the
# one layer being recomputed, forward and backward at once: about twice what a layer keeps
# without recomputation, which is 6·h + 6·I values a token (18·h measured on Qwen3 with
# I = 2·h, docs/long-context.md)
LAYER_KEPT_H, LAYER_WORK_H, LAYER_WORK_I = 2, 12, 12
PLAN_MARGIN = 1.25  # the plan's headroom over its estimate (the allocator, the loss's chunks)
# The most positions (rows x columns) one prefill chunk of the torch sampler runs
# (`workers.sampler.torch_sampler`): a sequence holds its KV cache and, while it is prefilled,
# one chunk's activations.
PREFILL_TOKENS = 4096
PLAN_SHARE = 0.8  # of the free memory after the model and its slots


@dataclass(frozen=True)
class TokenPlan:
    """The longest datum a pass trains and the longest prompt + `max_tokens` one sequence
    samples on this device, and why."""

    train_tokens: int
    sample_tokens: int
    free_bytes: int
    train_bytes_per_token: int
    sample_bytes_per_token: int
    max_context: int
    ranks: int = 1  # the ranks a long datum's positions are split over

    def describe(self) -> str:
        split = f", its positions split over {self.ranks} ranks" if self.ranks > 1 else ""
        return (
            f"datums of up to {self.train_tokens} tokens, samples of up to {self.sample_tokens}"
            f" (prompt + max_tokens): {PLAN_SHARE:.0%} of {self.free_bytes / 2**30:.1f} GiB free"
            f" after the model and its slots, {self.train_bytes_per_token / 2**10:.1f} KiB a"
            f" trained token (layers recomputed{split}),"
            f" {self.sample_bytes_per_token / 2**10:.1f} KiB a sampled one, at most the model's"
            f" context of {self.max_context}"
        )


def _widths(config: Any) -> tuple[int, int, int, int]:
    """(hidden h, layers L, MLP width a token goes through I, KV values a token keeps a layer)."""
    text = config.get_text_config()
    hidden = int(text.hidden_size)
    layers = int(text.num_hidden_layers)
    dense = int(getattr(text, "intermediate_size", 0) or 0)
    routed = int(getattr(text, "moe_intermediate_size", 0) or 0)
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    shared = int(getattr(text, "n_shared_experts", 0) or 0) * routed + int(
        getattr(text, "shared_expert_intermediate_size", 0) or 0
    )
    width = max(dense, routed * top_k + shared, hidden)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    latent = getattr(text, "kv_lora_rank", None)
    if latent:  # MLA keeps its compressed KV and the rotary key
        kv = int(latent) + int(getattr(text, "qk_rope_head_dim", 0) or 0)
    else:
        kv = 2 * kv_heads * head_dim
    return hidden, layers, width, kv


def _exchanged(config: Any) -> int:
    """The values a token of a pass split over ranks (`workers.engine.context_parallel`) costs
    every rank while one layer runs: its keys and values gathered, and their gradients in the
    backward; a MoE layer's gathered input and summed output beside them."""
    text = config.get_text_config()
    hidden, _, _, kv = _widths(config)
    if getattr(text, "kv_lora_rank", None):  # MLA gathers its decompressed keys and values
        heads = int(text.num_attention_heads)
        kv = heads * (int(text.qk_nope_head_dim) + int(text.qk_rope_head_dim))
        kv += heads * int(text.v_head_dim)
    moe = 4 * hidden if getattr(text, "num_experts_per_tok", None) else 0
    return 2 * kv + moe


def plan_tokens(
    config: Any, *, dtype_bytes: int, free_bytes: int, max_context: int, ranks: int = 1
) -> TokenPlan:
    """What a pass and a sequence may hold in `PLAN_SHARE` of `free_bytes` (the device's free
    memory once the model and its slots are on it), at most `max_context` tokens each.
    `ranks`: how many ranks split a long datum by position (each keeps 1/ranks of its
    activations, and every rank holds one layer's gathered keys and values for all of it)."""
    hidden, layers, width, kv = _widths(config)
    work = LAYER_WORK_H * hidden + LAYER_WORK_I * width
    per_token = (LAYER_KEPT_H * layers * hidden + work) / ranks
    if ranks > 1:
        per_token += _exchanged(config)
    train = int(PLAN_MARGIN * dtype_bytes * per_token)
    # a sequence keeps its KV cache in every layer; its prefill runs in chunks, one layer of
    # one chunk at a time
    sample = int(PLAN_MARGIN * dtype_bytes * layers * kv)
    prefill = int(PLAN_MARGIN * dtype_bytes * PREFILL_TOKENS * work // 2)
    budget = int(free_bytes * PLAN_SHARE)
    return TokenPlan(
        train_tokens=max(1, min(max_context, budget // train)),
        sample_tokens=max(1, min(max_context, max(0, budget - prefill) // sample)),
        free_bytes=free_bytes,
        train_bytes_per_token=train,
        sample_bytes_per_token=sample,
        max_context=max_context,
        ranks=ranks,
    )


def cached_tokens(config: Any, *, dtype_bytes: int, cache_bytes: int, max_context: int) -> int:
    """The longest prompt + completion a KV cache of `cache_bytes` holds for one sequence of
    `config`'s model, at most `max_context` (vLLM's `max_model_len` from its cache's size)."""
    _, layers, _, kv = _widths(config)
    return max(1, min(max_context, cache_bytes // max(1, dtype_bytes * layers * kv)))
