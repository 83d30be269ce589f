"""The adapter the bank would build on a model, counted per unit of rank, from its config alone.

Job: answer "how many LoRA parameters per unit of rank does a slot hold on this model, per layer
group (`attn`, `mlp`, `unembed`)?" without weights or memory: the model is built from its config
on the meta device, and the count is read off the bank's own layout (`lay_out_slot` in
`workers.engine.lora`, laid out for rank 1), so it covers exactly the linears
`find_target_linears` selects and the fused experts `find_expert_modules` finds, each costed as
the bank stores it: a linear `in + out`, a fused experts block Tinker's shared-outer
`3·(H + E·I)` (`workers.engine.moe_lora`). When the engine's rules change, the count follows.

Invariants: nothing is allocated (every tensor is on the meta device); the model class is the
one the engine loads (`workers.engine.model.load_causal_lm`): the causal LM where transformers
has one for the config, else a vision-language composite.

Place in the flow: not on a request's path. `bench/lora_param_counts.py` compares the counts
with Tinker's published table, and the tests pin the models that already match.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from workers.engine.configs import MODEL_TYPE_ALIASES
from workers.engine.lora import (
    LAYER_GROUPS,
    LayerGroup,
    find_unwrappable_experts,
    lay_out_slot,
)


@dataclass(frozen=True)
class RankCounts:
    """A slot's parameters per unit of rank, per layer group, and what the bank leaves out."""

    per_group: dict[LayerGroup, int]
    # Expert blocks the bank cannot adapt (not the fused 3-D layout): their weights are in no
    # group, and an adapter that trains the MLP is refused on such a model.
    unwrappable_experts: tuple[str, ...]


def config_from_fields(fields: Mapping[str, Any]) -> PretrainedConfig:
    """A transformers config from `config.json`-shaped fields: `model_type` picks the class,
    `architectures` is informative, every other field a config argument (the class's defaults
    fill the rest)."""
    rest = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    model_type = str(fields["model_type"])
    config: PretrainedConfig = AutoConfig.for_model(
        MODEL_TYPE_ALIASES.get(model_type, model_type), **rest
    )
    return config


def build_on_meta(config: PretrainedConfig) -> nn.Module:
    """The model the engine would load for `config`, with every tensor on the meta device."""
    text_model = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or not hasattr(config, "vision_config")
    auto = AutoModelForCausalLM if text_model else AutoModelForImageTextToText
    with torch.device("meta"):
        model: nn.Module = auto.from_config(config)  # type: ignore[no-untyped-call]
    return model


def count_per_rank(model: nn.Module) -> RankCounts:
    """Parameters per unit of rank of the adapter the bank builds on `model`, per layer group."""
    layouts, _ = lay_out_slot(model, max_rank=1)
    per_group: dict[LayerGroup, int] = dict.fromkeys(LAYER_GROUPS, 0)
    for layout in layouts:
        per_group[layout.group] += layout.a_size + layout.b_size
    return RankCounts(per_group, tuple(find_unwrappable_experts(model)))
