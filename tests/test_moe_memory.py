"""bench/moe_memory.py: it counts with the engine's own rules (`workers.engine.lora_counts`), its
counts equal Tinker's per-rank table where the engine already has Tinker's adapter, the shipped
MoE configs are the lineup's, its expert-parallel figures are the engine's split, a model whose
experts the engine cannot adapt is planned with Tinker's count and marked so, and the memory
plan's arithmetic."""

from __future__ import annotations

import pytest
import torch
from tinker_cookbook.hyperparam_utils import _LORA_PARAMS_PER_RANK_BY_COMPONENT
from transformers import AutoConfig, AutoModelForCausalLM

from bench.moe_memory import (
    CONFIGS,
    MODELS,
    ModelCount,
    _PlannedRank,
    count_model,
    load,
    load_fields,
    main,
    slot_bytes,
    slots_that_fit,
)
from workers.engine.expert_parallel import split_experts
from workers.engine.lora import lay_out_slot, per_expert_start
from workers.engine.lora_counts import build_on_meta, config_from_fields, count_per_rank

# The three configs shipped before the lineup: printed name -> tests/data/moe_configs directory.
SHIPPED = ("Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "gpt-oss-20b")
# Models whose adapter has Tinker's shape on every group; Qwen3.5-35B-A3B's MLP and unembedding.
EQUAL_TO_TINKER = ("Qwen3-30B-A3B", "gpt-oss-20b", "DeepSeek-V3.1", "Kimi-K2.6", "GLM-5.3")
NEMOTRON = "Nemotron-3-Ultra"


@pytest.fixture(scope="module")
def counts() -> dict[str, ModelCount]:
    return {name: count_model(name, model_id) for name, model_id in MODELS.items()}


@pytest.mark.parametrize("name", EQUAL_TO_TINKER)
def test_counts_equal_tinkers_table(counts: dict[str, ModelCount], name: str) -> None:
    tinker = _LORA_PARAMS_PER_RANK_BY_COMPONENT[MODELS[name]]
    assert counts[name].engine == dict(tinker)
    assert counts[name].per_rank == dict(tinker) and not counts[name].from_tinker


def test_qwen35_moe_equals_tinker(counts: dict[str, ModelCount]) -> None:
    # The linear attention's `in_proj_qkv` adapted per q, k, v slice and its per-head scalar
    # projections `in_proj_a`/`in_proj_b` left alone, as Tinker does
    ours = counts["Qwen3.5-35B-A3B"].engine
    tinker = _LORA_PARAMS_PER_RANK_BY_COMPONENT["Qwen/Qwen3.5-35B-A3B"]
    assert ours == dict(tinker)


def test_the_shipped_three_print_what_they_printed(counts: dict[str, ModelCount]) -> None:
    # All groups, per unit of rank, as the bench printed them when it had its own rules; but
    # Qwen3.5's `in_proj_a`/`in_proj_b` (1,920 a unit of rank), which Tinker does not adapt.
    totals = {name: (counts[name].per_rank["mlp"], counts[name].total) for name in SHIPPED}
    assert totals == {
        "Qwen3-30B-A3B": (14_450_688, 15_440_256),
        "Qwen3.5-35B-A3B": (16_281_600, 17_545_728),
        "gpt-oss-20b": (6_842_880, 7_544_512),
    }


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_configs_are_the_lineup_files(name: str) -> None:
    shipped = build_on_meta(AutoConfig.from_pretrained(CONFIGS / name))
    lineup = build_on_meta(config_from_fields(load_fields(MODELS[name])))
    assert count_per_rank(shipped) == count_per_rank(lineup)
    assert sum(p.numel() for p in shipped.parameters()) == sum(
        p.numel() for p in lineup.parameters()
    )


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "gpt-oss-20b", "DeepSeek-V3.1", "Kimi-K2.6"])
def test_an_expert_parallel_rank_is_the_engines_split(
    counts: dict[str, ModelCount], name: str
) -> None:
    # A slot's row: the factors every rank holds whole, then the per-expert ones
    # (`per_expert_start`), of which a rank of 8 holds 1/8; its base weights are what
    # `split_experts` leaves on rank 0 of 8.
    count = counts[name]
    model = build_on_meta(config_from_fields(load_fields(MODELS[name])))
    layouts, row = lay_out_slot(model, max_rank=1)
    start = per_expert_start(layouts, row, max_rank=1)
    assert count.total == row and 0 < start < row
    assert count.ep_total == start + (row - start) // 8
    split_experts(model, _PlannedRank(8))
    assert count.base_per_device == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "billions"),
    [("DeepSeek-V3.1", 671), ("Kimi-K2.6", 1_000), ("Nemotron-3-Ultra", 550)],
)
def test_base_parameters_are_the_models_size(
    counts: dict[str, ModelCount], name: str, billions: int
) -> None:
    # Kimi-K2 is "1T" (1.03 T built); no multi-token-prediction layer is built.
    assert abs(counts[name].base_params / 1e9 - billions) / billions < 0.03


def test_nemotron_is_planned_with_the_engines_count(counts: dict[str, ModelCount]) -> None:
    count = counts[NEMOTRON]
    tinker = _LORA_PARAMS_PER_RANK_BY_COMPONENT[MODELS[NEMOTRON]]
    assert not count.from_tinker and not count.unwrappable
    assert count.per_rank == count.engine
    # attention (the Mamba2 slices included) and the output layer are Tinker's; the MLP is the
    # rule that gives Nano's and Super's, 77,824 a unit of rank over Ultra's published one
    assert (count.engine["attn"], count.engine["unembed"]) == (tinker["attn"], tinker["unembed"])
    assert count.engine["mlp"] - tinker["mlp"] == 77_824
    # 48 MoE layers of 512 experts, up and down each E·I per expert (I = 5120): 7/8 of that
    # leaves each rank of 8.
    per_expert = 48 * 2 * 512 * 5120
    assert count.ep_per_rank["mlp"] == count.engine["mlp"] - per_expert + per_expert // 8
    assert count.ep_per_rank["attn"] == tinker["attn"]


def test_a_slot_holds_four_fp32_values_per_parameter() -> None:
    assert slot_bytes(1) == 16
    # Qwen3-30B-A3B's experts at rank 32: 462 M parameters, ~7.4 GB with grads and Adam.
    assert slot_bytes(14_450_688 * 32) == 7_398_752_256


def test_slots_fit_in_what_the_base_and_the_reserve_leave() -> None:
    assert slots_that_fit(80e9, 10e9, 60e9, 10**9) == 10
    assert slots_that_fit(80e9, 10e9, 60e9, 3 * 10**9) == 3
    assert slots_that_fit(80e9, 10e9, 75e9, 10**9) == 0  # the base does not fit


def test_the_bench_prints_the_plan_and_marks_tinkers_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V3.1", MODELS[NEMOTRON]])
    out = capsys.readouterr().out
    lines = out.splitlines()
    qwen = next(line for line in lines if line.startswith("Qwen3-30B-A3B "))
    assert "14,450,688" in qwen and "494,088,192" in qwen and "7,905,411,072" in qwen
    assert "= Tinker" in qwen
    assert any(line.startswith("DeepSeek-V3.1     mlp") for line in lines)
    assert "8x80GB" in out and "8x141GB" in out
    assert any(line.startswith(f"{NEMOTRON} ") for line in lines)
    assert "CANNOT ADAPT" not in out


@pytest.mark.parametrize("name", ["Qwen3-235B-A22B", "Qwen3.5-397B-A17B"])
def test_sharded_memory_counts_the_base_model_transformers_builds(name: str) -> None:
    """bench/sharded_memory.py's base-model count is the language model transformers builds
    from the shipped config (on the meta device), and the total is the model's name."""
    from bench.sharded_memory import base_params

    config = load(CONFIGS / name)[1]
    routed, text, tower = base_params(config)
    with torch.device("meta"):
        hf_config = AutoConfig.from_pretrained(CONFIGS / name)
        model = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    built = {"routed": 0, "other": 0}
    for path, parameter in model.named_parameters():
        if path.startswith(("model.visual", "visual")):
            continue
        routed_expert = ".experts." in path and "shared" not in path
        built["routed" if routed_expert else "other"] += parameter.numel()
    assert built == {"routed": routed, "other": text}
    billions = int(name.split("-")[1].removesuffix("B"))
    assert abs((routed + text + tower) / 1e9 - billions) / billions < 0.005
