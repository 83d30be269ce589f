"""Which compute path a model runs: the linear-attention kernels and the LoRA kind.

Job: answer, for logs, metrics and benchmarks, the two questions that decide a trainer's speed on
a GPU beyond its GEMMs: does a hybrid model's linear attention run on fused kernels or on
transformers' reference PyTorch code, and which `segment_lora` kind does a device run.

How transformers (5.x) chooses the linear-attention kernels. Hybrid models with Gated DeltaNet
layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: blocks named `linear_attn`) call module-level functions
of their modeling module: `torch_chunk_gated_delta_rule` (the training/prefill recurrence) and
`causal_conv1d_fn` (the short convolution before it). Each is wrapped, when the modeling module is
imported, by `use_kernel_func_from_hub_with_fallback`, which binds the first of: a hub kernel
(only with the `kernels` package and a mapping for this device), the original package's function
(`fla.ops.gated_delta_rule.chunk_gated_delta_rule` from `flash-linear-attention`,
`causal_conv1d.causal_conv1d_fn` from `causal-conv1d`), or the torch reference code (an order
of magnitude slower on a GPU). The choice is fixed at import time, so we read it from the
wrapper's closure instead of guessing from what is installed.

Invariant: reading the path never imports or calls a kernel.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from workers.engine.lora_kernels import LoraKind, choose_kind

LinearAttentionPath = Literal["none", "torch", "fla", "causal-conv1d+fla", "causal-conv1d+torch"]

# Modules that hold a hybrid model's linear-attention layers (see `workers.engine.lora._ATTN_PARENTS`).
_LINEAR_ATTENTION_NAMES = frozenset({"linear_attn"})
_CHUNK_RULE = "torch_chunk_gated_delta_rule"
_CONV = "causal_conv1d_fn"


def linear_attention_path(model: nn.Module) -> LinearAttentionPath:
    """The kernels a model's linear-attention layers run in a training pass.

    "none": no linear attention (e.g. Qwen3). "torch": transformers' reference code for both the
    convolution and the delta rule. "fla": flash-linear-attention's delta rule with the torch
    convolution; "causal-conv1d+fla": both fused; "causal-conv1d+torch": only the convolution
    fused. A model whose layer class has been replaced by a hub kernel reports what its
    modeling module would otherwise run.
    """
    modeling_modules = {
        type(module).__module__
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in _LINEAR_ATTENTION_NAMES
    }
    if not modeling_modules:
        return "none"
    rule_sources, conv_sources = set(), set()
    for module_name in sorted(modeling_modules):
        modeling = sys.modules.get(module_name)
        rule_sources.add(_source(getattr(modeling, _CHUNK_RULE, None)))
        conv_sources.add(_source(getattr(modeling, _CONV, None)))
    # Several modeling modules in one model (none today) must agree, else the slow one counts.
    rule = "fla" if rule_sources == {"fla"} else "torch"
    conv = "causal-conv1d" if conv_sources == {"causal_conv1d"} else "torch"
    if conv == "causal-conv1d":
        return "causal-conv1d+fla" if rule == "fla" else "causal-conv1d+torch"
    return "fla" if rule == "fla" else "torch"


def _source(function: Callable[..., object] | None) -> str:
    """The top-level package whose code a (possibly wrapped) modeling function runs."""
    if function is None:
        return "missing"
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None)
    if code is not None and closure is not None and "implementation" in code.co_freevars:
        try:
            function = closure[code.co_freevars.index("implementation")].cell_contents
        except ValueError:  # an empty cell: the wrapper was never finished
            return "torch"
    module = getattr(function, "__module__", None) or ""
    root = module.partition(".")[0]
    return "torch" if root in ("transformers", "torch", "") else root


def lora_path(device: torch.device | str, dtype: torch.dtype | None = None) -> LoraKind:
    """The `segment_lora` kind a pass on `device` runs, for the engine's dtype by default.

    The engine computes in bf16 on CUDA and fp32 elsewhere (`workers.engine.model.MultiSlotModel`); shapes are
    assumed aligned (every Qwen3 / Qwen3.5 size and the usual ranks are multiples of 8).
    """
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return choose_kind(device, dtype)
