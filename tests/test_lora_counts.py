"""Our adapter's parameters per unit of rank against Tinker's published table.

Each model of the lineup (`tests/data/lineup/models.json`, one `config.json`-shaped file per
distinct text config) is built on the meta device and counted with the bank's own layout
(`workers.engine.lora_counts`). The models of the families the engine serves whose adapter
already has Tinker's shape are pinned here, one test per model id; `bench/lora_param_counts.py`
prints the others' differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tinker_cookbook.hyperparam_utils import _LORA_PARAMS_PER_RANK_BY_COMPONENT as PUBLISHED
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from workers.engine.lora import (
    LAYER_GROUPS,
    LoraBank,
    SlotRouting,
    find_target_linears,
    lay_out_slot,
)
from workers.engine.lora_counts import build_on_meta, config_from_fields, count_per_rank

LINEUP = Path(__file__).parent / "data" / "lineup"
INDEX: dict[str, str] = json.loads((LINEUP / "models.json").read_text())
# Tinker models with no config to count: no transformers class (Kimi-K3.1-Pro's `kimi_k3`,
# GLM-5.3-Flash's `glm5_next`) or no config seen (Inkling-2-Small).
UNCOVERED = frozenset(
    {"moonshotai/Kimi-K3.1-Pro", "zai-org/GLM-5.3-Flash", "thinkingmachines/Inkling-2-Small"}
)
# Families whose adapter has Tinker's shape: the dense and MoE Qwen3 and gpt-oss, Llama (the same
# module names as Qwen3), the multi-head latent attention families (DeepSeek-V3.1 and Kimi-K2,
# GLM-5.3, DeepSeek-V4.1), whose `q_b_proj`/`kv_b_proj` and grouped `o_a_proj` are left alone,
# Qwen3.5 and Qwen3.5-MoE (one pair per q, k, v slice of the linear attention's `in_proj_qkv`;
# `in_proj_a`/`in_proj_b` left alone) and Nemotron-H (its Mamba2 `in_proj`'s z and x slices,
# `out_proj`, and non-gated experts) and Inkling (its shared-expert bank as the shared-outer bank
# of two, one A over its dense gate and up).
MATCHING_FAMILIES = frozenset(
    {
        "llama",
        "qwen3",
        "qwen3_moe",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "gpt_oss",
        "deepseek_v3",
        "glm_moe_dsa",
        "deepseek_v4",
        "nemotron_h",
        "inkling_mm_model",
    }
)
# Nemotron-3-Ultra's published `mlp` is 77,824 per rank below what the rule that reproduces Nano's
# and Super's gives (2·(D + E·I) + 2·(H + Is) + 2·(H + latent) per MoE layer; 48 layers): its
# `attn` and `unembed` are pinned, its `mlp` is printed by `bench/lora_param_counts.py`.
UNEXPLAINED = {"nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16": frozenset({"mlp"})}


def _fields(model_id: str) -> dict[str, object]:
    fields: dict[str, object] = json.loads((LINEUP / INDEX[model_id]).read_text())
    return fields


MATCHING = [m for m in INDEX if _fields(m)["model_type"] in MATCHING_FAMILIES]


def test_the_index_covers_tinkers_table() -> None:
    published = set(PUBLISHED)
    assert set(INDEX) == published - UNCOVERED
    assert {path.name for path in LINEUP.glob("*.json")} == set(INDEX.values()) | {"models.json"}


@pytest.mark.parametrize("name", sorted(set(INDEX.values())))
def test_every_config_builds_on_meta(name: str) -> None:
    fields = json.loads((LINEUP / name).read_text())
    assert isinstance(fields["architectures"], list)
    model = build_on_meta(config_from_fields(fields))
    assert all(p.is_meta for p in model.parameters())
    counts = count_per_rank(model).per_group
    assert counts["unembed"] > 0


@pytest.mark.parametrize("model_id", MATCHING)
def test_counts_equal_tinkers(model_id: str) -> None:
    expected = PUBLISHED[model_id]
    counts = count_per_rank(build_on_meta(config_from_fields(_fields(model_id))))
    assert counts.unwrappable_experts == ()
    pinned = [group for group in LAYER_GROUPS if group not in UNEXPLAINED.get(model_id, ())]
    assert {group: counts.per_group[group] for group in pinned} == {
        group: expected[group] for group in pinned
    }


def test_the_count_is_what_the_bank_allocates() -> None:
    """The count per rank, times a rank, is the row the bank gives a slot on a real model."""
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        mlp_only_layers=[1],
    )
    counts = count_per_rank(build_on_meta(config)).per_group
    bank = LoraBank(
        Qwen3MoeForCausalLM(config),  # type: ignore[no-untyped-call]
        max_slots=1,
        max_rank=3,
        routing=SlotRouting(),
        device=torch.device("cpu"),
    )
    assert bank.slot_numel == 3 * sum(counts.values())
    # layer 0: experts 3·(64 + 4·32); layer 1: a dense MLP 3·(64 + 96)
    assert counts["mlp"] == 3 * (64 + 4 * 32) + 3 * (64 + 96)


def test_only_linears_that_compute_a_linear_are_adapted() -> None:
    """DeepSeek-V4's grouped `o_a_proj` subclasses `nn.Linear` but multiplies per head group:
    a LoRA pair on its `in`/`out` features gave a term of the wrong width, so the first pass of
    a DeepSeek-V4 adapter failed. A frozen linear sharded over a group's ranks computes the
    plain linear and stays adapted."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    from workers.engine.collective import Collective
    from workers.engine.frozen_shards import GatheredLinear
    from workers.engine.lora import computes_linear

    assert computes_linear(torch.nn.Linear(4, 3))
    assert not computes_linear(DeepseekV4GroupedLinear(4, 3, n_groups=2))
    assert computes_linear(GatheredLinear(torch.nn.Linear(4, 3), Collective()))
    assert not computes_linear(torch.nn.Conv1d(4, 3, 1))
    v4 = json.loads((LINEUP / INDEX["deepseek-ai/DeepSeek-V4.1-Flash"]).read_text())
    targets = find_target_linears(build_on_meta(config_from_fields(v4)))
    leaves = {path.rsplit(".", 1)[-1] for path in targets}
    assert "o_b_proj" in leaves and not leaves & {"o_a_proj", "q_b_proj", "kv_b_proj"}


def test_inklings_shared_expert_bank_and_dense_glu_are_adapted() -> None:
    """Inkling holds its two shared experts as a 3-D bank (`shared_experts.gate_proj
    [2, I, H]`) and its dense MLP as separate gate and up linears: the bank is adapted as the
    shared-outer bank of two, `3·(H + 2·I)`, and gate and up share one A, `(H + 2·Id) +
    (Id + H)`; no expert block is left unadapted."""
    inkling = json.loads((LINEUP / INDEX["thinkingmachines/Inkling-Small"]).read_text())
    model = build_on_meta(config_from_fields(inkling))
    layouts, _ = lay_out_slot(model, max_rank=1)
    by_path = {layout.path: layout for layout in layouts}
    bank = "model.language_model.layers.10.mlp.shared_experts"
    assert (
        by_path[f"{bank}.gate_proj"].in_features,
        by_path[f"{bank}.gate_proj"].out_features,
    ) == (
        4096,
        2 * 2048,
    )
    dense = "model.language_model.layers.0.mlp"
    assert by_path[f"{dense}.gate_up_proj"].out_features == 2 * 16384
    assert f"{dense}.gate_proj" not in by_path and f"{dense}.up_proj" not in by_path
    assert count_per_rank(model).unwrappable_experts == ()
